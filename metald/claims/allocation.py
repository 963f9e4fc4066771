"""Allocation: a tenant asks for N machines matching a selector, and gets all N or none.

Allocation runs in one transaction. Candidates are read, then locked and moved to ``claimed``
with a compare-and-swap on each machine's version (``machines.transition``) guarded by
``state = 'ready' AND tenant_id IS NULL``. On PostgreSQL the lock is ``FOR UPDATE SKIP
LOCKED``, so concurrent claims (from any number of metald processes) never wait on each other
and never take the same machine; on SQLite the transaction holds the write lock from its first
statement (``BEGIN IMMEDIATE``), so claims run one after another. If fewer than ``count``
machines could be taken, nothing is written and the refusal says how many matched.
"""

from __future__ import annotations

import fnmatch
import random
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from sqlalchemy import exists, or_
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, select

from metald import arch as arches
from metald import machines
from metald.bmc.secureboot import enforced as secure_boot_enforced
from metald.claims import placement as placing
from metald.claims import tenant_os
from metald.claims.placement import Candidate, Placement, Unplaceable
from metald.claims.records import retrying, switch_plan
from metald.claims.tenant_os import OsRequest
from metald.errors import Conflict, NotFound, Unprocessable
from metald.lifecycle import State, Trigger
from metald.provision.commissioning import require_passed
from metald.provision.intents import DeployImage, provision_intent
from metald.store.models import Bmc, Claim, Image, Machine, Tenant

#: How long a claim may wait for machines locked by other in-flight claims before refusing.
CONTENDED_WAIT_S = 10.0


class _Shortfall(Exception):
    """Fewer free machines could be locked than the claim asks for."""


@dataclass(frozen=True)
class Selector:
    """Which machines a claim accepts. Every given criterion must hold."""

    #: Exact model name, or a glob (``NVIDIA H100*``).
    gpu_model: str | None = None
    min_gpu_count: int = 0
    min_memory_mb: int | None = None
    #: Every label must be present with exactly this value.
    labels: dict[str, str] = field(default_factory=dict)
    rack: str | None = None
    #: Only machines whose commissioning passed within this many days / with this profile.
    commissioned_within_days: float | None = None
    commission_profile: str | None = None
    #: Firmware inventory id -> version or glob (metald.bmc.firmware records them).
    firmware: dict[str, str] = field(default_factory=dict)
    #: Only machines whose current boot passed measured-boot attestation (the wipe boot after
    #: their last tenant, or their discovery boot): docs/attestation.md.
    attested: bool = False
    #: CPU architecture (amd64, arm64). A machine with none recorded counts as amd64. Unset,
    #: a claim takes its image's architecture (``for_image``).
    arch: str | None = None
    #: Only machines whose BMC reports UEFI Secure Boot enabled and the current boot verified
    #: (``SecureBootEnable`` and ``SecureBootCurrentBoot``; metald.bmc.secureboot).
    secure_boot: bool = False

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> Selector:
        d = dict(d or {})
        return cls(
            gpu_model=d.get("gpu_model") or None,
            min_gpu_count=int(d.get("min_gpu_count") or 0),
            min_memory_mb=d.get("min_memory_mb"),
            labels={str(k): str(v) for k, v in (d.get("labels") or {}).items()},
            rack=d.get("rack") or None,
            commissioned_within_days=d.get("commissioned_within_days"),
            commission_profile=d.get("commission_profile") or None,
            firmware={str(k): str(v) for k, v in (d.get("firmware") or {}).items()},
            attested=bool(d.get("attested", False)),
            arch=d.get("arch") or None,
            secure_boot=bool(d.get("secure_boot", False)),
        )

    def check(self) -> Selector:
        """This selector, or Unprocessable naming what is wrong with it."""
        if self.arch is not None and self.arch not in arches.ARCHES:
            raise Unprocessable(
                f"selector arch must be one of {', '.join(arches.ARCHES)}, not {self.arch!r}"
            )
        return self

    def for_image(self, image: Image) -> Selector:
        """The selector allocation uses for ``image``: its architecture, and Unprocessable
        when the claim asks for machines of another (they could not boot it)."""
        built_for = image_arch(image)
        if self.arch is not None and self.arch != built_for:
            raise Unprocessable(
                f"image {image.name!r} is built for {built_for} and the selector asks for "
                f"{self.arch} machines, which cannot boot it; pick an image built for "
                f"{self.arch} (GET /api/v1/images shows each image's arch) or drop the "
                "selector's arch",
                image_arch=built_for,
                selector_arch=self.arch,
            )
        return replace(self, arch=built_for)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def _glob(self) -> bool:
        return self.gpu_model is not None and any(c in self.gpu_model for c in "*?[")

    def matches(self, m: Machine) -> bool:
        """Pure check of one machine against every criterion (state is not considered)."""
        if self.gpu_model is not None and (
            m.gpu_model is None or not fnmatch.fnmatchcase(m.gpu_model, self.gpu_model)
        ):
            return False
        if m.gpu_count < self.min_gpu_count:
            return False
        if self.min_memory_mb is not None and (m.memory_mb or 0) < self.min_memory_mb:
            return False
        if self.rack is not None and m.rack != self.rack:
            return False
        if self.attested and (m.attested_boot is None or m.attested_boot != m.boot_current):
            return False
        if self.arch is not None and (m.arch or arches.DEFAULT) != self.arch:
            return False
        if self.secure_boot and not secure_boot_enforced(m.secure_boot):
            return False
        labels = m.labels or {}
        versions = m.firmware_versions or {}
        return all(labels.get(k) == v for k, v in self.labels.items()) and all(
            k in versions and fnmatch.fnmatchcase(versions[k], v) for k, v in self.firmware.items()
        )

    def prefilter(self, stmt: Any) -> Any:
        """Narrow a machines query in SQL by the criteria SQL can check on every backend; labels
        and globs are checked by ``matches`` afterwards."""
        if self.gpu_model is not None and not self._glob:
            stmt = stmt.where(Machine.gpu_model == self.gpu_model)
        if self.min_gpu_count:
            stmt = stmt.where(Machine.gpu_count >= self.min_gpu_count)
        if self.min_memory_mb is not None:
            stmt = stmt.where(Machine.memory_mb >= self.min_memory_mb)  # type: ignore[operator]
        if self.rack is not None:
            stmt = stmt.where(Machine.rack == self.rack)
        if self.attested:
            stmt = stmt.where(col(Machine.attested_boot) == col(Machine.boot_current))
        if self.arch == arches.DEFAULT:
            stmt = stmt.where(or_(col(Machine.arch) == self.arch, col(Machine.arch).is_(None)))
        elif self.arch is not None:
            stmt = stmt.where(Machine.arch == self.arch)
        return require_passed(
            stmt, within_days=self.commissioned_within_days, profile=self.commission_profile
        )

    def narrow(self, stmt: Any, dialect: str) -> tuple[Any, bool]:
        """``prefilter`` plus the globs and labels SQL can check with the same meaning as
        ``matches``. Returns (statement, exact): exact when SQL alone decides, so the database
        can order and limit the matches itself (no candidate list read into Python)."""
        stmt, exact = self.prefilter(stmt), not self.firmware  # firmware: checked by matches
        if self.secure_boot:
            if dialect in ("sqlite", "postgresql"):
                sb = Machine.secure_boot
                stmt = stmt.where(
                    sb["enabled"].as_boolean().is_(True),  # type: ignore[index]
                    sb["current_boot"].as_boolean().is_(True),  # type: ignore[index]
                )
            else:
                exact = False
        if self._glob:
            assert self.gpu_model is not None
            pattern = self.gpu_model
            if "[" in pattern or dialect not in ("sqlite", "postgresql"):
                exact = False  # character classes: fnmatch and SQL spell them differently
            elif dialect == "sqlite":
                # GLOB: case-sensitive, * and ? as fnmatchcase.
                stmt = stmt.where(col(Machine.gpu_model).op("GLOB")(pattern))
            else:
                like = pattern.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
                like = like.replace("*", "%").replace("?", "_")
                stmt = stmt.where(col(Machine.gpu_model).like(like, escape="\\"))
        for key, value in self.labels.items():
            if dialect in ("sqlite", "postgresql") and _PLAIN_LABEL_KEY.match(key):
                stmt = stmt.where(Machine.labels[key].as_string() == value)  # type: ignore[index]
            else:
                exact = False
        return stmt, exact


#: Label keys safe to put in a JSON path as they are (others are matched in Python).
_PLAIN_LABEL_KEY = re.compile(r"^[A-Za-z0-9_.\-/]{1,253}$")

#: What ``Selector.matches`` reads: candidate scans load these columns, not whole machines.
_MATCH_COLUMNS = (
    Machine.id,
    Machine.state,
    Machine.tenant_id,
    Machine.gpu_model,
    Machine.gpu_count,
    Machine.memory_mb,
    Machine.rack,
    Machine.labels,
    Machine.firmware_versions,
    Machine.attested_boot,
    Machine.boot_current,
    Machine.arch,
    Machine.secure_boot,
)


def image_arch(image: Image) -> str:
    """The architecture an image is built for (one registered before arm64: amd64)."""
    return str((image.spec or {}).get("arch") or arches.DEFAULT)


def _free(stmt: Any) -> Any:
    return stmt.where(Machine.state == State.READY.value, col(Machine.tenant_id).is_(None))


def bmc_required(session: Session, setting: bool | None) -> bool:
    """enroll.require_bmc as set, or (unset) on as soon as any BMC is registered."""
    if setting is not None:
        return setting
    return session.exec(select(Bmc.id).limit(1)).first() is not None


def _vouched(stmt: Any) -> Any:
    """Machines something other than their own word vouches for: linked to a BMC, or approved
    by a technician. A host that invented a MAC and an inventory has neither."""
    has_bmc = exists().where(col(Bmc.machine_id) == col(Machine.id))
    return stmt.where(or_(col(Machine.approved_at).is_not(None), has_bmc))


def _claimable(strict: bool) -> Callable[[Any], Any]:
    return (lambda stmt: _vouched(_free(stmt))) if strict else _free


def count_matching(
    session: Session, selector: Selector, *, vouched_only: bool = False
) -> tuple[int, int]:
    """(machines matching the selector in any state but retired, of those ready and free, and
    with ``vouched_only`` linked to a BMC or approved)."""
    stmt, _exact = selector.narrow(
        select(*_MATCH_COLUMNS).where(Machine.state != State.RETIRED.value),
        session.get_bind().dialect.name,
    )
    rows = session.exec(stmt).all()
    hits = [m for m in rows if selector.matches(m)]
    free = [m for m in hits if m.state == State.READY.value and m.tenant_id is None]
    if vouched_only and free:
        ids = [m.id for m in free]
        free = list(session.exec(_vouched(select(Machine.id).where(col(Machine.id).in_(ids)))))
    return len(hits), len(free)


def get_image(session: Session, image_id: str, tenant_id: str | None = None) -> Image:
    img = session.get(Image, image_id)
    if img is None or (tenant_id is not None and img.tenants and tenant_id not in img.tenants):
        raise Unprocessable(f"no image with id {image_id!r}; list images with GET /api/v1/images")
    return img


def _same_request(
    session: Session,
    c: Claim,
    count: int,
    selector: Selector,
    image_id: str,
    keys: list[str],
    os: OsRequest,
    placement: Placement | None = None,
) -> bool:
    return (
        c.count == count
        and Selector.from_dict(c.selector) == selector
        and c.image == image_id
        and list(c.ssh_authorized_keys or []) == keys
        and (c.network or None) == (os.network or None)
        and (c.storage or None) == (os.storage or None)
        and tenant_os.same_user_data(session, c.id, os)
        and (c.placement or None) == (placement.to_dict() if placement else None)
    )


def _existing(session: Session, tenant_id: str, key: str) -> Claim | None:
    return session.exec(
        select(Claim).where(Claim.tenant_id == tenant_id, Claim.idempotency_key == key)
    ).first()


def _replay(
    session: Session,
    c: Claim,
    count: int,
    selector: Selector,
    image_id: str,
    keys: list[str],
    os: OsRequest,
    placement: Placement | None = None,
) -> Claim:
    if not _same_request(session, c, count, selector, image_id, keys, os, placement):
        raise Conflict(
            f"idempotency key {c.idempotency_key!r} was already used for claim {c.id} with a "
            "different request; use a new key for a new claim",
            claim_id=c.id,
        )
    return c


def create_claim(
    session: Session,
    tenant_id: str,
    count: int,
    selector: Selector,
    image_id: str,
    idempotency_key: str | None,
    actor: str,
    *,
    deploy: DeployImage,
    ssh_authorized_keys: list[str] | None = None,
    instance: str | None = None,
    require_bmc: bool | None = None,
    os: OsRequest | None = None,
    placement: Placement | None = None,
) -> tuple[Claim, bool]:
    """Allocate ``count`` machines to the tenant, all or none. Returns (claim, replayed):
    a repeated idempotency key with the same request returns the first claim unchanged.
    ``require_bmc`` (enroll.require_bmc; None: on once any BMC is registered): only machines
    linked to a BMC or approved by a technician are taken. ``placement``: packed into NVLink
    domains, racks or IB leaves, or spread over power domains (``metald.claims.placement``);
    one that cannot be placed raises ``Unplaceable`` with the free machines per domain."""
    if count < 1:
        raise Unprocessable("count must be at least 1")
    keys = list(ssh_authorized_keys or [])
    os = os or OsRequest()
    if session.get(Tenant, tenant_id) is None:
        raise NotFound(f"no tenant with id {tenant_id!r}")
    if idempotency_key and (c := _existing(session, tenant_id, idempotency_key)):
        return _replay(session, c, count, selector, image_id, keys, os, placement), True
    checked = tenant_os.check_user_data(os.settings, os.user_data, os.meta_data)
    image = get_image(session, image_id, tenant_id)  # scoped images: their tenants only
    requested, selector = selector, selector.check().for_image(image)
    intent = provision_intent(image.id, image.kind, image.spec, deploy)
    strict = bmc_required(session, require_bmc)
    claimable = _claimable(strict)

    def allocate() -> Claim:
        claim = Claim(
            tenant_id=tenant_id,
            idempotency_key=idempotency_key,
            count=count,
            selector=requested.to_dict(),
            image=image.id,
            ssh_authorized_keys=keys,
            network=os.network or None,
            storage=os.storage or None,
            placement=placement.to_dict() if placement else None,
            state="allocated",
            created_by=actor,
        )
        session.add(claim)
        session.flush()
        tenant_os.save_user_data(session, claim.id, os.user_data, os.meta_data, checked)
        dialect = session.get_bind().dialect.name
        if placement is not None:
            stmt = _placed(session, claimable, selector, count, placement)
        else:
            stmt, exact = selector.narrow(claimable(select(Machine)), dialect)
            if not exact:
                # Labels or globs SQL cannot check alike: match the candidates' columns in
                # Python.
                cand, _ = selector.narrow(claimable(select(*_MATCH_COLUMNS)), dialect)
                ids = [m.id for m in session.exec(cand).all() if selector.matches(m)]
                stmt = claimable(select(Machine).where(col(Machine.id).in_(ids)))
        # Best fit first, so the big machines stay free for the claims that need them (the
        # ix_machines_alloc order). populate_existing: the rows as locked now.
        locked = session.exec(
            stmt.order_by(col(Machine.gpu_count), col(Machine.memory_mb), col(Machine.id))
            .limit(count)
            .with_for_update(skip_locked=True)
            .execution_options(populate_existing=True)
        ).all()
        if len(locked) < count or not all(selector.matches(m) for m in locked):
            raise _Shortfall
        # Layouts fit and addresses are taken before any machine moves (a 422 rolls back).
        try:
            tenant_os.prepare(session, os.settings, claim, list(locked))
        except Unprocessable:
            session.rollback()
            raise
        for m in locked:
            machines.transition(
                session,
                m.id,
                Trigger.CLAIM,
                actor=actor,
                reason=f"claim {claim.id}",
                expected_version=m.version,
                # From now on the machine owes a wipe before it may be ready again.
                updates={
                    "tenant_id": tenant_id,
                    "claim_id": claim.id,
                    "boot_intent": intent,
                    "wipe_required": True,
                },
                data={"claim_id": claim.id},
                instance=instance,
                commit=False,
            )
        machines.add_event(
            session,
            "claim.created",
            actor,
            tenant_id=tenant_id,
            data={
                "claim_id": claim.id,
                "count": count,
                "machines": [m.id for m in locked],
                "image_id": image.id,
                "network": switch_plan(session, tenant_id, locked),
            },
            instance=instance,
        )
        session.commit()
        return claim

    try:
        return _allocate_or_explain(session, allocate, selector, count, strict=strict), False
    except IntegrityError:
        # The same idempotency key committed by a concurrent request a moment ago.
        session.rollback()
        c = _existing(session, tenant_id, idempotency_key) if idempotency_key else None
        if c is None:
            raise
        return _replay(session, c, count, requested, image_id, keys, os, placement), True


#: What placement reads of each candidate, besides what ``Selector.matches`` reads.
_PLACE_COLUMNS = (
    *_MATCH_COLUMNS,
    Machine.nvlink_domain,
    Machine.nvlink_ready,
    Machine.ib_leaf,
    Machine.power_domain,
)


def _placed(
    session: Session,
    claimable: Callable[[Any], Any],
    selector: Selector,
    count: int,
    placement: Placement,
) -> Any:
    """The machines ``placement`` picks among the free ones matching ``selector``, as a
    statement to lock them with. Every candidate's domains are read (a placement weighs the
    whole fleet); refuses with ``Unplaceable`` when they do not fit."""
    dialect = session.get_bind().dialect.name
    cand, _ = selector.narrow(claimable(select(*_PLACE_COLUMNS)), dialect)
    rows = [
        m
        for m in session.exec(
            cand.order_by(col(Machine.gpu_count), col(Machine.memory_mb), col(Machine.id))
        ).all()
        if selector.matches(m)
    ]
    candidates = [
        Candidate(
            id=m.id,
            # A tray whose GPUs are not all registered in the domain would slow the job.
            nvlink_domain=m.nvlink_domain if m.nvlink_ready else None,
            rack=m.rack,
            ib_leaf=m.ib_leaf,
            power_domain=m.power_domain,
        )
        for m in rows
    ]
    ids = placing.choose(candidates, count, placement)
    return claimable(select(Machine).where(col(Machine.id).in_(ids)))


def _allocate_or_explain(
    session: Session,
    allocate: Callable[[], Claim],
    selector: Selector,
    count: int,
    *,
    strict: bool = False,
) -> Claim:
    """Run ``allocate``; when it falls short, wait briefly if machines held by in-flight claims
    (locked, not yet committed) might still come free, else refuse with the numbers."""
    deadline = time.monotonic() + CONTENDED_WAIT_S
    while True:
        try:
            return retrying(session, allocate)
        except _Shortfall:
            session.rollback()
        except Unplaceable:
            session.rollback()
            raise
        matched, available = count_matching(session, selector, vouched_only=strict)
        session.rollback()
        if available < count or time.monotonic() > deadline:
            vouched = (
                " (enroll.require_bmc: only machines linked to a BMC or approved by a "
                "technician count)"
                if strict
                else ""
            )
            raise Unprocessable(
                f"cannot claim {count} machine(s): {matched} match the selector and "
                f"{available} of them are ready and unallocated{vouched}; "
                f"{_secure_boot_shortfall(session, selector, strict)}ask for fewer, widen "
                "the selector, or wait for machines to be released",
                matched=matched,
                available=available,
                requested=count,
            )
        # Some are locked by claims still in flight (PostgreSQL, SKIP LOCKED): they commit or
        # roll back within milliseconds, so look again shortly.
        time.sleep(random.uniform(0.005, 0.05))


def _secure_boot_shortfall(session: Session, selector: Selector, strict: bool) -> str:
    """Why ``secure_boot`` cost the claim machines, in words ("" when it did not)."""
    if not selector.secure_boot:
        return ""
    _, without = count_matching(session, replace(selector, secure_boot=False), vouched_only=strict)
    _, with_it = count_matching(session, selector, vouched_only=strict)
    session.rollback()
    if without <= with_it:
        return ""
    return (
        f"{without - with_it} more ready machine(s) match all but secure_boot: their BMC does "
        "not report Secure Boot enabled with the current boot verified (an admin enables it "
        "with POST /api/v1/machines/{id}/secure-boot, and it holds from the next reboot); "
    )


def _same_domains(
    session: Session, claim: Claim, claimable: Callable[[Any], Any]
) -> Callable[[Any], Any]:
    """For a packed claim, only machines in the domains its machines sit in (a replacement
    outside the NVLink domain would slow the whole job); else ``claimable`` unchanged."""
    placement = Placement.from_dict(claim.placement, claim.count) if claim.placement else None
    if placement is None or placement.pack is None:
        return claimable
    column = getattr(Machine, placement.key)
    held = {
        v
        for v in session.exec(select(column).where(Machine.claim_id == claim.id)).all()
        if v is not None
    }

    def narrowed(stmt: Any) -> Any:
        stmt = claimable(stmt).where(col(column).in_(sorted(held)))
        if placement.pack == "nvlink-domain":
            stmt = stmt.where(col(Machine.nvlink_ready).is_(True))
        return stmt

    return narrowed


def claim_replacement(
    session: Session,
    claim: Claim,
    actor: str,
    *,
    reason: str,
    deploy: DeployImage,
    instance: str | None = None,
    require_bmc: bool | None = None,
) -> Machine | None:
    """One more machine for ``claim``, of its selector and image, locked and moved to
    ``claimed`` like the claim's own (``create_claim``) but not committed: the caller records
    what it was claimed for in the same transaction (a remediation's replacement, so a crash
    never claims two). A packed claim's replacement comes from the domains its machines sit
    in. None when no free machine matches."""
    image = get_image(session, claim.image or "", claim.tenant_id)
    selector = Selector.from_dict(claim.selector).for_image(image)
    intent = provision_intent(image.id, image.kind, image.spec, deploy)
    claimable = _claimable(bmc_required(session, require_bmc))
    claimable = _same_domains(session, claim, claimable)
    dialect = session.get_bind().dialect.name
    stmt, exact = selector.narrow(claimable(select(Machine)), dialect)
    if not exact:
        cand, _ = selector.narrow(claimable(select(*_MATCH_COLUMNS)), dialect)
        ids = [m.id for m in session.exec(cand).all() if selector.matches(m)]
        stmt = claimable(select(Machine).where(col(Machine.id).in_(ids)))
    m = session.exec(
        stmt.order_by(col(Machine.gpu_count), col(Machine.memory_mb), col(Machine.id))
        .limit(1)
        .with_for_update(skip_locked=True)
        .execution_options(populate_existing=True)
    ).first()
    if m is None or not selector.matches(m):
        return None
    return machines.transition(
        session,
        m.id,
        Trigger.CLAIM,
        actor=actor,
        reason=reason,
        expected_version=m.version,
        updates={
            "tenant_id": claim.tenant_id,
            "claim_id": claim.id,
            "boot_intent": intent,
            "wipe_required": True,
        },
        data={"claim_id": claim.id},
        instance=instance,
        commit=False,
    )
