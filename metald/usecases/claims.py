"""Claims as the API shows and drives them: claim machines for a tenant, list and show
claims with each machine's progress, release a claim or one machine of it. The flows are
``metald.claims.workflow``'s; this module decides what a caller may see and act on.

An orchestrator acts for the tenants in its scope only; another tenant's claim is reported as
absent, so scoped tokens cannot probe for ids."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from sqlmodel import Session, col, select

from metald.auth import Principal, Role
from metald.claims import tenant_os
from metald.claims.allocation import Selector
from metald.claims.placement import Placement
from metald.claims.records import claim_machines, latest_progress
from metald.claims.tenant_os import OsRequest
from metald.claims.workflow import ClaimRequest, ClaimWorkflow
from metald.errors import Conflict, NotFound
from metald.machines import ConcurrentUpdate, add_event
from metald.provision.metadata import hostname
from metald.store.models import Claim, Machine, WgPeer, utcnow
from metald.tenants import slurm
from metald.usecases import Transactions
from metald.usecases.reads import Page, Pager, page

#: Newest first.
DEFAULT_ORDER = ["-created_at", "id"]


class ClaimFilter(Protocol):
    """What a claim list is narrowed by (``api.routes_claims.ClaimQuery``)."""

    tenant_id: str | None
    state: str | None


def claim_view(s: Session, c: Claim, *, replayed: bool = False) -> dict[str, Any]:
    """A claim with each of its machines' state and latest progress."""
    ms = claim_machines(s, c.id)
    progress = latest_progress(s, ms)
    return {
        **c.model_dump(exclude={"image", "ssh_authorized_keys"}),
        "image_id": c.image,
        "ssh_authorized_keys": list(c.ssh_authorized_keys or []),
        # Never the user-data itself: its form, size and digest.
        "user_data": tenant_os.user_data_summary(s, c.id),
        "addresses": tenant_os.addresses(s, c.id),
        "replayed": replayed,
        "machines": [
            {
                **m.model_dump(
                    include={
                        "id",
                        "name",
                        "state",
                        "gpu_model",
                        "gpu_count",
                        "rack",
                        "nvlink_domain",
                        "ib_leaf",
                        "power_domain",
                    }
                ),
                "last_error": m.last_error,
                "progress": progress.get(m.id),
            }
            for m in ms
        ],
    }


def claim_topology(s: Session, c: Claim) -> dict[str, Any]:
    ms = claim_machines(s, c.id)
    ids = [m.id for m in ms]
    rows = s.exec(select(WgPeer.machine_id, WgPeer.address).where(col(WgPeer.machine_id).in_(ids)))
    peers = {mid: addr for mid, addr in rows.all()}
    nodes = [
        slurm.TopoNode(
            name=hostname(m.id, m.name),
            nvlink_domain=m.nvlink_domain if m.nvlink_ready else None,
            ib_leaf=m.ib_leaf,
            address=peers.get(m.id),
        )
        for m in ms
    ]
    imex = slurm.imex_nodes_config(nodes)
    return {
        "claim_id": c.id,
        "placement": c.placement,
        "nodes": [
            {
                "name": n.name,
                "nvlink_domain": n.nvlink_domain,
                "ib_leaf": n.ib_leaf,
                "address": n.address,
                "features": slurm.topology_features(n.nvlink_domain, n.ib_leaf, m.rack),
            }
            for n, m in zip(nodes, ms, strict=True)
        ],
        "slurm_topology_tree": slurm.render_topology_tree(nodes),
        "slurm_topology_block": slurm.render_topology_block(nodes),
        "imex_nodes_config": [{"nvlink_domain": d, "nodes_config": t} for d, t in imex.items()],
        "unaddressed": sorted(n.name for n in nodes if n.nvlink_domain and not n.address),
    }


def _views(s: Session, rows: list[Claim]) -> list[dict[str, Any]]:
    return [claim_view(s, c) for c in rows]


def load_claim(s: Session, p: Principal, claim_id: str) -> Claim:
    c = s.get(Claim, claim_id, populate_existing=True)
    if c is None or not p.can_see_tenant(c.tenant_id):
        raise NotFound(f"no claim with id {claim_id!r} among the claims this token may see")
    return c


@dataclass
class Claims:
    store: Transactions
    workflow: ClaimWorkflow

    async def claim(
        self,
        p: Principal,
        *,
        actor: str,
        tenant_id: str,
        count: int,
        selector: dict[str, Any],
        image_id: str,
        idempotency_key: str | None,
        ssh_authorized_keys: list[str],
        os: OsRequest | None = None,
        placement: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Allocate the machines and start installing the image (``ClaimWorkflow.claim``),
        for a tenant the caller may claim for."""
        if not p.can_see_tenant(tenant_id):
            raise NotFound(
                f"no tenant with id {tenant_id!r} among this token's tenants; "
                "an orchestrator token claims only for the tenants in its scope"
            )
        request = ClaimRequest(
            tenant_id=tenant_id,
            count=count,
            selector=Selector.from_dict(selector),
            image_id=image_id,
            idempotency_key=idempotency_key,
            ssh_authorized_keys=ssh_authorized_keys,
            os=os or OsRequest(),
            placement=Placement.from_dict(placement, count),
        )
        return await self.workflow.claim(
            request,
            actor=actor,
            render=lambda s, c, replayed: claim_view(s, c, replayed=replayed),
        )

    async def set_machine_user_data(
        self,
        p: Principal,
        claim_id: str,
        machine_id: str,
        *,
        actor: str,
        user_data: str | None,
        meta_data: dict[str, Any],
    ) -> dict[str, Any]:
        """Give one machine of the claim its own user-data and meta-data (None and {}: back to
        the claim's). It is what the machine's next provisioning serves; the event names its
        digest, never its content."""
        settings = self.workflow.tenant_os

        def run(s: Session) -> dict[str, Any]:
            c = load_claim(s, p, claim_id)
            # Checked here, off the event loop (a large cloud-config takes a while).
            checked = tenant_os.check_user_data(settings, user_data, meta_data)
            m = s.get(Machine, machine_id)
            if m is None or m.claim_id != c.id or m.tenant_id != c.tenant_id:
                raise NotFound(f"claim {c.id} holds no machine {machine_id!r}")
            tenant_os.save_user_data(s, c.id, user_data, meta_data, checked, machine_id=m.id)
            add_event(
                s,
                "claim.user-data.set",
                actor,
                machine_id=m.id,
                tenant_id=c.tenant_id,
                data={
                    "claim_id": c.id,
                    "sha256": checked.sha256 if checked else None,
                    "form": checked.form if checked else None,
                },
            )
            s.commit()
            return claim_view(s, c)

        return await self.store.run(run)

    async def list(self, p: Principal, f: ClaimFilter, pager: Pager) -> Page[dict[str, Any]]:
        """The claims the caller may see (an orchestrator: its tenants'), newest first."""

        def run(s: Session) -> Page[dict[str, Any]]:
            stmt = select(Claim)
            if p.role is Role.ORCHESTRATOR:
                stmt = stmt.where(col(Claim.tenant_id).in_(sorted(p.scope)))
            if f.tenant_id:
                stmt = stmt.where(Claim.tenant_id == f.tenant_id)
            if f.state:
                stmt = stmt.where(Claim.state == f.state)
            return page(s, stmt, Claim, pager, DEFAULT_ORDER, _views)

        return await self.store.run(run)

    async def show(self, p: Principal, claim_id: str) -> dict[str, Any]:
        return await self.store.run(lambda s: claim_view(s, load_claim(s, p, claim_id)))

    async def firmware_consent(
        self, p: Principal, claim_id: str, consent: bool, *, actor: str, if_match: int | None
    ) -> dict[str, Any]:
        """The tenant consents (or no longer) to its machines of this claim being drained
        through the Day-2 path by a firmware rollout with ``in_use = drain``: drained in its
        scheduler, out of the claim, replaced by its health policy (docs/firmware.md). An event
        on the claim's stream says who changed it."""

        def run(s: Session) -> dict[str, Any]:
            c = load_claim(s, p, claim_id)
            if if_match is not None and c.version != if_match:
                raise ConcurrentUpdate(
                    f"claim {c.id} is at version {c.version}, not {if_match}; read it again "
                    "and retry"
                )
            if c.state == "released":
                raise Conflict(f"claim {c.id} is released: there is nothing to consent for")
            if c.firmware_consent != consent:
                c.firmware_consent = consent
                c.version += 1
                c.updated_at = utcnow()
                s.add(c)
                add_event(
                    s,
                    "claim.firmware-consent",
                    actor,
                    tenant_id=c.tenant_id,
                    reason=(
                        f"claim {c.id}: the tenant consents to its machines being drained "
                        "(out of the claim, replaced) for firmware updates"
                        if consent
                        else f"claim {c.id}: the tenant withdrew its consent to firmware "
                        "drains; its machines are updated only once released"
                    ),
                    data={"claim_id": c.id, "consent": consent},
                    instance=self.workflow.instance,
                )
                s.commit()
            return claim_view(s, c)

        out = await self.store.run(run)
        self.workflow.notify()
        return out

    async def topology(self, p: Principal, claim_id: str) -> dict[str, Any]:
        """The claim's machines as its tenant's scheduler should see them: topology.conf for
        Slurm's tree and block plugins, and IMEX nodes_config.cfg per NVLink domain."""
        return await self.store.read(lambda s: claim_topology(s, load_claim(s, p, claim_id)))

    async def release(
        self,
        p: Principal,
        claim_id: str,
        *,
        actor: str,
        if_match: int | None,
        machine_id: str | None = None,
    ) -> dict[str, Any]:
        """End the claim, or release one machine of it (``ClaimWorkflow.release``); with
        ``if_match``, only while the claim is at that version (checked in the release's own
        transaction, so nothing is released on a stale read)."""
        checked: list[bool] = []  # the workflow loads again to render its answer: check once

        def load(s: Session, cid: str) -> Claim:
            c = load_claim(s, p, cid)
            if if_match is not None and not checked and c.version != if_match:
                raise ConcurrentUpdate(
                    f"claim {c.id} is at version {c.version}, not {if_match}; "
                    "read it again and retry"
                )
            checked.append(True)
            return c

        return await self.workflow.release(
            claim_id, actor=actor, load=load, render=claim_view, machine_id=machine_id
        )
