"""The remediation workflow: every step of ``metald.health.remediation`` carried out, with the
tenant's scheduler in the loop.

A remediation row is opened (``open_for``) in the transaction that records a machine's fault
at degraded or worse, one per machine. ``Remediations.advance`` then takes it one step at a
time: ``decide`` names the action and the step after it; the action runs; the step is written
with a compare-and-swap on the row's version (another instance that got there first wins and
this one stops). Actions and where they run:

- admission (``waiting``): in one transaction holding the admission lock (PostgreSQL: an
  advisory transaction lock; SQLite: the write lock its transactions take at once), so two
  instances never both admit past ``[health.limits]``. A refusal is an event with its sentence
  (once per change of sentence, not every round);
- drain / undrain / remove from the cluster: the tenant's scheduler (idempotent calls), then
  the step;
- out of the claim (``remove``): in the step's transaction: the node token and the peer go
  (the hub and the mesh drop it), the machine leaves the tenant (``release``: releasing, not
  wiped yet) and the claim;
- replacement (``replace``): in the step's transaction: one machine of the claim's selector is
  claimed (``claims.allocation.claim_replacement``) and recorded on the row, so a crash never
  claims two; after the commit it is provisioned like any machine of a claim;
- repair (``repair``): the ``RepairQueue`` opens the machine's repair in the step's
  transaction, with its faults as evidence.

Every step is an event on the machine and on the claim's tenant stream (``data.claim_id``),
with the decision's sentence as its reason.
"""

from __future__ import annotations

import asyncio
import logging
import zlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any, Protocol

from sqlalchemy import text, update
from sqlmodel import Session, col, select

from metald import machines
from metald.auth import revoke_machine_tokens
from metald.claims import allocation
from metald.claims.workflow import HubSync
from metald.health import remediation as core
from metald.health.classify import Severity
from metald.health.config import HealthConfig, PolicyConfig
from metald.health.scheduler import NodeState, NodeStatus, SchedulerError, TenantScheduler
from metald.health.trust import Fault, Health
from metald.healthwatch import faults
from metald.lifecycle import ALLOCATED, State, Trigger, sources
from metald.provision.intents import DeployImage
from metald.provision.metadata import hostname
from metald.store.db import Store
from metald.store.models import Claim, Machine, Remediation, Tenant, as_utc, utcnow
from metald.tenants import clusters

log = logging.getLogger("metald.health")

#: The admission lock's key (PostgreSQL advisory lock): admissions are decided one at a time.
ADMISSION_LOCK = zlib.crc32(b"metald:health:admission")
#: Steps at which the machine is still in its claim (the remediation has not taken it out).
_BEFORE_TAKE_OUT = frozenset(
    {core.Step.WAITING, core.Step.DRAIN, core.Step.WAIT_JOBS, core.Step.DRAINED,
     core.Step.REMOVE, core.Step.UNDRAIN}
)  # fmt: skip
_OPEN = [s.value for s in core.Step if s is not core.Step.DONE]
_HOLDING = [s.value for s in core.HOLDS_SLOT]


class RepairQueue(Protocol):
    """Where a machine taken out of its claim goes for a technician (in the step's
    transaction, not committed)."""

    def open(
        self, session: Session, *, machine_id: str, remediation_id: str, faults: list[Fault]
    ) -> None: ...


@dataclass(frozen=True)
class MarkBroken:
    """The default repair hand-off: the machine is marked broken through the lifecycle, with
    its evidence on the event (a technician repairs it with the machine actions)."""

    actor: str
    instance: str | None = None

    def open(
        self, session: Session, *, machine_id: str, remediation_id: str, faults: list[Fault]
    ) -> None:
        m = machines.get_machine(session, machine_id)
        if State(m.state) not in sources(Trigger.MARK_BROKEN):
            return  # broken (or retired) already
        evidence = "; ".join(dict.fromkeys(f.evidence for f in faults)) or "no evidence kept"
        machines.transition(
            session,
            machine_id,
            Trigger.MARK_BROKEN,
            actor=self.actor,
            reason=f"health remediation {remediation_id}: {evidence}"[:1000],
            data={
                "remediation_id": remediation_id,
                "faults": [
                    {
                        "severity": f.severity,
                        "witness": f.witness,
                        "kind": f.kind,
                        "subject": f.subject,
                        "rule": f.rule,
                        "part": f.part,
                        "evidence": f.evidence,
                        "first_at": f.first_at.isoformat(),
                    }
                    for f in faults
                ],
            },
            instance=self.instance,
            commit=False,
        )


class NoScheduler:
    """A tenant whose cluster has no scheduler metald runs (Kubernetes here): draining is the
    tenant's own business; the node reads absent and runs no job metald knows of."""

    def drain(self, node: str, reason: str) -> None:
        return None

    def undrain(self, node: str) -> None:
        return None

    def node_state(self, node: str) -> NodeStatus:
        return NodeStatus(NodeState.ABSENT)

    def running_jobs(self, node: str) -> list[str]:
        return []

    def remove_node(self, node: str, reason: str) -> None:
        return None


#: The tenant's scheduler as this instance can reach it; None: not here (another instance
#: runs the tenant's control plane, or it is not up yet).
SchedulerFor = Callable[[str], TenantScheduler | None]


class Booter(Protocol):
    """What the workflow needs of the claim workflow once a replacement is claimed."""

    def start_provisioning(
        self, session: Session, machine_ids: list[str], *, actor: str, instance: str | None = None
    ) -> list[str]: ...


def policy_of(s: Session, m: Machine, cfg: HealthConfig) -> PolicyConfig:
    tenant = s.get(Tenant, m.tenant_id) if m.tenant_id else None
    sku = (m.labels or {}).get("sku")
    return cfg.policy_for(tenant=tenant.name if tenant else None, sku=sku)


def open_for(
    s: Session,
    m: Machine,
    health: Health,
    cfg: HealthConfig,
    *,
    actor: str,
    instance: str | None,
) -> Remediation | None:
    """A new remediation (``waiting``) for a machine of a claim whose health is degraded or
    worse and that has none open; not committed. None when nothing is to open."""
    if health.severity.rank < Severity.DEGRADED.rank or not m.claim_id or not m.tenant_id:
        return None
    if State(m.state) not in ALLOCATED:
        return None
    if s.exec(select(Remediation.id).where(Remediation.open_machine == m.id)).first():
        return None
    policy = policy_of(s, m, cfg)
    if health.severity is not Severity.FATAL and policy.degraded == "none":
        return None  # the claim's policy does nothing for degraded: no record to open and end
    ev = faults.evidence(health)
    return _open(
        s,
        m,
        severity=health.severity,
        cause=core.Cause.HEALTH,
        evidence=ev,
        policy=policy,
        reason=f"{m.id} is {health.severity}: {ev}",
        actor=actor,
        instance=instance,
    )


def _open(
    s: Session,
    m: Machine,
    *,
    severity: Severity,
    cause: core.Cause,
    evidence: str,
    policy: PolicyConfig,
    reason: str,
    actor: str,
    instance: str | None,
) -> Remediation:
    """The remediation row of a machine in use, added and flushed (not committed), with its
    ``health.remediation.opened`` event."""
    if not m.claim_id or not m.tenant_id:
        raise ValueError(f"machine {m.id} is not in use by a claim: nothing to remediate")
    row = Remediation(
        machine_id=m.id,
        open_machine=m.id,
        claim_id=m.claim_id,
        tenant_id=m.tenant_id,
        rack=m.rack,
        node=hostname(m.id, m.name),
        step=core.Step.WAITING,
        severity=severity,
        cause=cause,
        evidence=evidence,
        policy=policy.model_dump(),
        reason=reason,
        owner=instance,
    )
    s.add(row)
    s.flush()
    _event(s, row, "health.remediation.opened", row.reason, actor=actor, instance=instance)
    return row


@dataclass(frozen=True)
class FirmwareDrain:
    """A firmware rollout's way into the Day-2 path (``metald.firmware.rollouts.Drainer``): a
    machine in use whose tenant consented (``claims.firmware_consent``) gets a remediation of
    cause ``firmware``, carried by ``Remediations`` like any other (the tenant's limits, its
    scheduler drained, running jobs up to its policy's ``job_wait_s``, out of the claim, a
    replacement when its policy replaces) and ending without a repair once the machine is out
    of the claim; the rollout takes it when it is back in the pool."""

    cfg: HealthConfig

    def open(
        self, s: Session, machine_id: str, *, reason: str, actor: str, instance: str | None
    ) -> str | None:
        """The remediation opened (not committed), or None: the machine is not in use by a
        claim whose tenant consented, or has a remediation open already (it is taken out
        anyway)."""
        m = s.get(Machine, machine_id)
        if m is None or not m.claim_id or not m.tenant_id or State(m.state) not in ALLOCATED:
            return None
        claim = s.get(Claim, m.claim_id)
        if claim is None or not claim.firmware_consent:
            return None
        if s.exec(select(Remediation.id).where(Remediation.open_machine == m.id)).first():
            return None
        row = _open(
            s,
            m,
            severity=Severity.FATAL,
            cause=core.Cause.FIRMWARE,
            evidence=reason,
            policy=policy_of(s, m, self.cfg),
            reason=f"{m.id}: {reason}",
            actor=actor,
            instance=instance,
        )
        return row.id


def _event(
    s: Session,
    row: Remediation,
    kind: str,
    reason: str,
    *,
    actor: str,
    instance: str | None,
    **data: Any,
) -> None:
    machines.add_event(
        s,
        kind,
        actor,
        machine_id=row.machine_id,
        tenant_id=row.tenant_id,
        reason=reason,
        data={
            "claim_id": row.claim_id,
            "remediation_id": row.id,
            "step": row.step,
            "node": row.node,
            "cause": row.cause,
            **data,
        },
        instance=instance,
    )


def core_of(row: Remediation) -> core.Remediation:
    return core.Remediation(
        id=row.id,
        machine=row.machine_id,
        node=row.node,
        claim=row.claim_id,
        rack=row.rack,
        severity=Severity(row.severity),
        evidence=row.evidence,
        policy=PolicyConfig.model_validate(row.policy),
        step=core.Step(row.step),
        drained_at=as_utc(row.drained_at) if row.drained_at else None,
        replacement=row.replacement_id,
        cause=core.Cause(row.cause),
    )


class Lost(Exception):
    """Another writer moved the remediation first: this round stops (it is not an error)."""


def _write(
    s: Session,
    row: Remediation,
    after: core.Remediation,
    d: core.Decision,
    *,
    actor: str,
    instance: str | None,
    now: datetime,
) -> None:
    """The step after ``d``, compare-and-swapped on the version read; with its event."""
    values: dict[str, Any] = {
        "step": after.step.value,
        "severity": after.severity.value,
        "evidence": after.evidence,
        "drained_at": after.drained_at,
        "replacement_id": after.replacement,
        "reason": d.reason,
        "owner": instance,
        "version": row.version + 1,
        "updated_at": now,
    }
    if after.step is core.Step.DONE:
        values.update(open_machine=None, done_at=now)
    res = s.connection().execute(
        update(Remediation)
        .where(col(Remediation.id) == row.id, col(Remediation.version) == row.version)
        .values(**values)
    )
    if res.rowcount != 1:
        s.rollback()
        raise Lost(row.id)
    row.step = after.step.value  # for the event
    _event(
        s,
        row,
        f"health.remediation.{after.step.value}",
        d.reason,
        actor=actor,
        instance=instance,
        action=d.action.value,
        outcome=d.outcome.value,
        replacement_id=after.replacement,
    )


@dataclass
class Remediations:
    """Carries remediations forward (see the module docstring); one instance's view."""

    store: Store
    cfg: HealthConfig
    instance: str
    scheduler_for: SchedulerFor
    repair: RepairQueue
    deploy: DeployImage
    #: Provisions a claimed replacement (``ClaimWorkflow.boot``); None: left to the watchdog.
    boot: Booter | None = None
    #: Network-boots the replacement after commit (``ClaimWorkflow.network_boot``).
    network_boot: Callable[[list[str], str], None] | None = None
    #: A machine out of its claim with nothing to repair (a firmware drain): restored and
    #: wiped as a release is (the BMC clean-up, then the wipe's boot), in the background;
    #: (machine ids, claim id, actor). None: only its wipe is booted (``network_boot``).
    released: Callable[[list[str], str, str], None] | None = None
    require_bmc: bool | None = None
    #: The running tenant hubs, synced at once after a machine leaves its tenant.
    hubs: HubSync | None = None
    notify: Callable[[], None] = lambda: None
    clock: Callable[[], datetime] = lambda: datetime.now(UTC)

    @property
    def actor(self) -> str:
        return f"metald:{self.instance}"

    # -- reads ---------------------------------------------------------------------------

    def _load(self, s: Session, rem_id: str) -> tuple[Remediation, Health] | None:
        row = s.get(Remediation, rem_id, populate_existing=True)
        if row is None or row.step == core.Step.DONE:
            return None
        return row, faults.health_of(s, row.machine_id)

    def _facts(self, health: Health, running: int | None) -> core.Facts:
        return core.Facts(self.clock(), health.severity, faults.evidence(health), running)

    # -- the steps -----------------------------------------------------------------------

    def _admit(self, s: Session, rem_id: str) -> core.Decision | None:
        if s.get_bind().dialect.name == "postgresql":
            s.exec(text("SELECT pg_advisory_xact_lock(:k)").bindparams(k=ADMISSION_LOCK))  # type: ignore[call-overload]
        got = self._load(s, rem_id)
        if got is None:
            return None
        row, health = got
        if row.step != core.Step.WAITING:
            return None
        others = s.exec(
            select(Remediation).where(col(Remediation.step).in_(_HOLDING), Remediation.id != row.id)
        ).all()
        facts = self._facts(health, None)
        rem = core_of(row)
        d = core.decide(rem, facts, active=[core_of(o) for o in others], limits=self.cfg.limits)
        now = facts.now
        if d.next is core.Step.WAITING:
            if d.reason != row.reason:  # a refusal is told once per change of sentence
                row.reason, row.updated_at = d.reason, now
                row.version += 1
                s.add(row)
                _event(
                    s, row, "health.remediation.waiting", d.reason, actor=self.actor,
                    instance=self.instance,
                )  # fmt: skip
            s.commit()
            return d
        _write(s, row, core.advance(rem, d, facts), d, actor=self.actor, instance=self.instance,
               now=now)  # fmt: skip
        s.commit()
        return d

    def _take_out(self, s: Session, rem_id: str, version: int, d: core.Decision) -> bool:
        """``remove``'s store part with its step: the machine leaves the tenant and the claim."""
        got = self._load(s, rem_id)
        if got is None or got[0].version != version:
            s.rollback()
            return False
        row, health = got
        m = s.get(Machine, row.machine_id, populate_existing=True)
        assert m is not None
        if m.claim_id == row.claim_id and State(m.state) in ALLOCATED:
            revoke_machine_tokens(s, m.id, commit=False)
            clusters.remove_peer(s, m.id, actor=self.actor, instance=self.instance,
                                 reason="health remediation")  # fmt: skip
            machines.transition(
                s,
                m.id,
                Trigger.RELEASE,
                actor=self.actor,
                reason=d.reason,
                expected_version=m.version,
                updates={"tenant_id": None, "claim_id": None, "wipe_required": True},
                data={"claim_id": row.claim_id, "remediation_id": row.id},
                instance=self.instance,
                commit=False,
            )
        facts = self._facts(health, 0)
        _write(s, row, core.advance(core_of(row), d, facts), d, actor=self.actor,
               instance=self.instance, now=facts.now)  # fmt: skip
        s.commit()
        return True

    def _replace(self, s: Session, rem_id: str, version: int, d: core.Decision) -> str | None:
        """``replace``: one machine claimed for the claim and recorded with the step, in one
        transaction. None when none is free (the row says why; tried again later)."""
        got = self._load(s, rem_id)
        if got is None or got[0].version != version:
            s.rollback()
            return None
        row, health = got
        claim = s.get(Claim, row.claim_id, with_for_update=True, populate_existing=True)
        if claim is None or claim.state == "released":
            # Nothing to keep the count of: the repair goes on without a replacement.
            d = core.Decision(core.Action.NONE, d.outcome, core.Step.REPAIR,
                              f"claim {row.claim_id} was released: no replacement")  # fmt: skip
            after = core.advance(core_of(row), d, self._facts(health, 0))
            _write(s, row, after, d, actor=self.actor, instance=self.instance, now=self.clock())
            s.commit()
            return None
        new = allocation.claim_replacement(
            s,
            claim,
            self.actor,
            reason=f"replacement for {row.machine_id} (health remediation {row.id})",
            deploy=self.deploy,
            instance=self.instance,
            require_bmc=self.require_bmc,
        )
        if new is None:
            s.rollback()
            why = (
                f"no free machine matches claim {claim.id}'s selector to replace "
                f"{row.machine_id}; trying again (the bad machine stays out of the claim)"
            )
            self._note(s, rem_id, why)
            return None
        facts = self._facts(health, 0)
        after = core.advance(core_of(row), d, facts, replacement=new.id)
        _write(s, row, after, d, actor=self.actor, instance=self.instance, now=facts.now)
        if self.boot is not None:
            self.boot.start_provisioning(s, [new.id], actor=self.actor, instance=self.instance)
        s.commit()
        return new.id

    def _note(self, s: Session, rem_id: str, why: str) -> None:
        """Tell (once per sentence) why a step waits; committed."""
        row = s.get(Remediation, rem_id, populate_existing=True)
        if row is None or row.reason == why or row.step == core.Step.DONE:
            s.rollback()
            return
        row.reason, row.updated_at = why, utcnow()
        row.version += 1
        s.add(row)
        _event(s, row, "health.remediation.stalled", why, actor=self.actor,
               instance=self.instance)  # fmt: skip
        s.commit()

    def _repair(self, s: Session, rem_id: str, version: int, d: core.Decision) -> bool:
        got = self._load(s, rem_id)
        if got is None or got[0].version != version:
            s.rollback()
            return False
        row, health = got
        if self.boot is not None and row.replacement_id:
            r = s.get(Machine, row.replacement_id)
            if r is not None and r.state == State.CLAIMED:  # cut off before its provisioning
                self.boot.start_provisioning(s, [r.id], actor=self.actor, instance=self.instance)
        self.repair.open(
            s, machine_id=row.machine_id, remediation_id=row.id,
            faults=sorted(health.faults.values(), key=lambda f: (f.first_at, f.key)),
        )  # fmt: skip
        facts = self._facts(health, 0)
        _write(s, row, core.advance(core_of(row), d, facts), d, actor=self.actor,
               instance=self.instance, now=facts.now)  # fmt: skip
        s.commit()
        return True

    def _simple(self, s: Session, rem_id: str, version: int, d: core.Decision,
                running: int | None) -> bool:  # fmt: skip
        got = self._load(s, rem_id)
        if got is None or got[0].version != version:
            s.rollback()
            return False
        row, health = got
        facts = self._facts(health, running)
        _write(s, row, core.advance(core_of(row), d, facts), d, actor=self.actor,
               instance=self.instance, now=facts.now)  # fmt: skip
        s.commit()
        return True

    # -- one step ------------------------------------------------------------------------

    async def advance(self, rem_id: str) -> bool:
        """Carry one remediation one step forward; True when its step changed."""
        sched_tenant = await self.store.read(self._peek, rem_id)
        if sched_tenant is None:
            return False
        row_step, version, tenant_id, node, cluster_kind, _cause = sched_tenant
        if row_step in _BEFORE_TAKE_OUT and await self.store.run(self._left, rem_id, version):
            return True
        if row_step == core.Step.WAITING:
            d = await self.store.run(self._admit, rem_id)
            return d is not None and d.next is not core.Step.WAITING
        sched: TenantScheduler | None = (
            NoScheduler() if cluster_kind != "slurm" else self.scheduler_for(tenant_id)
        )
        if sched is None:
            return False  # the tenant's control plane is not run here (or not up yet)
        running: int | None = None
        if row_step == core.Step.WAIT_JOBS:
            try:
                running = len(await asyncio.to_thread(sched.running_jobs, node))
            except SchedulerError as e:
                log.info("remediation %s: %s", rem_id, e)
        got = await self.store.read(self._decide, rem_id, version, running)
        if got is None:
            return False
        rem, d = got
        try:
            if d.action is core.Action.DRAIN:
                await asyncio.to_thread(sched.drain, node, core.drain_reason(rem))
            elif d.action is core.Action.UNDRAIN:
                await asyncio.to_thread(sched.undrain, node)
            elif d.action is core.Action.REMOVE:
                await asyncio.to_thread(sched.remove_node, node, core.drain_reason(rem))
        except SchedulerError as e:
            await self.store.run(self._note, rem_id, f"{d.reason} (not yet: {e})")
            return False
        if d.action is core.Action.REMOVE:
            moved = await self.store.run(self._take_out, rem_id, version, d)
            if moved and self.hubs is not None:
                try:  # off the running hub now; the runtime's own loop would do it later
                    await self.hubs.sync()
                except Exception:
                    log.exception("tenant runtime sync after remediation %s failed", rem_id)
        elif d.action is core.Action.REPLACE:
            new = await self.store.run(self._replace, rem_id, version, d)
            moved = new is not None
            if new is not None and self.network_boot is not None:
                self.network_boot([new], self.actor)
            if new is None:
                moved = False  # why it waits is on the row and the claim's stream
        elif d.action is core.Action.REPAIR:
            moved = await self.store.run(self._repair, rem_id, version, d)
        else:
            if d.next.value == row_step:
                return False  # waiting (jobs, drained): nothing written
            moved = await self.store.run(self._simple, rem_id, version, d, running)
        if moved and d.outcome is core.Outcome.RELEASED:
            # Out of the claim for its firmware update, nothing to repair: cleaned up and wiped
            # now as a release is (a fault's machine is wiped after its repair); the rollout
            # takes it from the pool.
            left = await self.store.read(_machine_of, rem_id)
            if left is not None and self.released is not None:
                self.released([left[0]], left[1], self.actor)
            elif left is not None and self.network_boot is not None:
                self.network_boot([left[0]], self.actor)
        if moved:
            self.notify()
        return moved

    def _left(self, s: Session, rem_id: str, version: int) -> bool:
        """A machine that left its claim some other way (the tenant released it) before the
        remediation took it out: the remediation ends there (no replacement for a machine the
        tenant gave back). A node drained here stays drained: it is off the cluster anyway."""
        row = s.get(Remediation, rem_id, populate_existing=True)
        m = s.get(Machine, row.machine_id) if row is not None else None
        if row is None or row.version != version or m is None:
            s.rollback()
            return False
        if m.claim_id == row.claim_id and State(m.state) in ALLOCATED:
            s.rollback()
            return False
        why = f"{m.id} left claim {row.claim_id} ({m.state}): the remediation ends"
        d = core.Decision(core.Action.NONE, core.Outcome.NOTHING, core.Step.DONE, why)
        after = replace(core_of(row), step=core.Step.DONE)
        _write(s, row, after, d, actor=self.actor, instance=self.instance, now=self.clock())
        s.commit()
        return True

    def _peek(self, s: Session, rem_id: str) -> tuple[str, int, str, str, str, str] | None:
        row = s.get(Remediation, rem_id)
        if row is None or row.step == core.Step.DONE:
            return None
        tenant = s.get(Tenant, row.tenant_id)
        kind = tenant.cluster_kind if tenant else "slurm"
        return row.step, row.version, row.tenant_id, row.node, kind or "slurm", row.cause

    def _decide(
        self, s: Session, rem_id: str, version: int, running: int | None
    ) -> tuple[core.Remediation, core.Decision] | None:
        got = self._load(s, rem_id)
        if got is None or got[0].version != version:
            return None
        row, health = got
        rem = core_of(row)
        return rem, core.decide(rem, self._facts(health, running))

    async def run_all(self, owns_tenant: Callable[[str], bool] = lambda _t: True) -> int:
        """Advance every open remediation of the tenants this instance drives until none
        moves; returns how many steps moved."""
        moved = 0
        for _ in range(len(core.Step) + 1):
            ids = await self.store.read(_open_ids)
            round_moved = 0
            for rem_id, tenant_id in ids:
                if not owns_tenant(tenant_id):
                    continue
                try:
                    if await self.advance(rem_id):
                        round_moved += 1
                except Lost:
                    continue
            moved += round_moved
            if not round_moved:
                break
        return moved


def _machine_of(s: Session, rem_id: str) -> tuple[str, str] | None:
    row = s.get(Remediation, rem_id)
    return (row.machine_id, row.claim_id) if row is not None else None


def _open_ids(s: Session) -> list[tuple[str, str]]:
    rows = s.exec(
        select(Remediation.id, Remediation.tenant_id)
        .where(col(Remediation.step).in_(_OPEN))
        .order_by(col(Remediation.created_at), col(Remediation.id))
    ).all()
    return [(r[0], r[1]) for r in rows]
