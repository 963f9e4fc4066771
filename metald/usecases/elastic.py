"""Elastic pools as the API and the control plane's spool drive them (docs/elastic.md).

CRUD for a tenant's pools (admin, or an orchestrator for the tenants in its scope, as claims);
``resume``: one claim per node name slurmctld resumed, keyed ``elastic:<pool>:<node>`` so a
retried request (a metald killed between the claim and removing the request) never claims a
second machine for one name; ``suspend``: that claim released (its machine wiped, back in the
free pool). Which names get machines is ``metald.tenants.elastic.decide_resume``'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlmodel import Session, col, func, select

from metald.auth import Principal
from metald.claims.allocation import Selector, bmc_required, count_matching, get_image
from metald.claims.workflow import ClaimRequest, ClaimWorkflow
from metald.errors import Conflict, NotFound, Unprocessable
from metald.machines import ConcurrentUpdate, add_event
from metald.store.models import Claim, ElasticPoolRow, ElasticQuota, Machine, Tenant, utcnow
from metald.tenants import elastic
from metald.usecases import Transactions

LIVE = ("pending", "allocated")
KEY = "elastic:{pool}:{node}"


def key(pool_id: str, node: str) -> str:
    return KEY.format(pool=pool_id, node=node)


def node_of_key(k: str | None) -> tuple[str, str] | None:
    """(pool id, node name) of a claim made for an elastic node."""
    if not k or not k.startswith("elastic:"):
        return None
    parts = k.split(":")
    return (parts[1], parts[2]) if len(parts) == 3 else None


pool_of = elastic.pool_of


def _claimed(s: Session, pool_id: str) -> dict[str, Claim]:
    rows = s.exec(
        select(Claim).where(
            col(Claim.idempotency_key).startswith(f"elastic:{pool_id}:"),
            col(Claim.state).in_(LIVE),
        )
    ).all()
    out = {}
    for c in rows:
        k = node_of_key(c.idempotency_key)
        if k is not None:
            out[k[1]] = c
    return out


def view(s: Session, row: ElasticPoolRow) -> dict[str, Any]:
    claimed = _claimed(s, row.id)
    return {
        **row.model_dump(exclude={"image"}),
        "image_id": row.image,
        "hostlist": pool_of(row).hostlist,
        "partition": pool_of(row).feature,
        "nodes": {n: c.id for n, c in sorted(claimed.items())},
    }


@dataclass
class ElasticPools:
    store: Transactions
    workflow: ClaimWorkflow
    #: Rewrites the tenant's slurm.conf (restarting its slurmctld) after a change.
    changed: Any = None

    def _tenant(self, s: Session, p: Principal, tenant_id: str) -> Tenant:
        t = s.get(Tenant, tenant_id)
        if t is None or not p.can_see_tenant(tenant_id):
            raise NotFound(
                f"no tenant with id {tenant_id!r} among this token's tenants; an "
                "orchestrator token manages pools only for the tenants in its scope"
            )
        if t.cluster_kind != "slurm":
            raise Unprocessable(
                f"tenant {tenant_id} runs {t.cluster_kind!r}, not slurm: elastic pools are "
                "Slurm power saving; create the tenant with cluster_kind slurm"
            )
        return t

    def _load(self, s: Session, p: Principal, tenant_id: str, pool_id: str) -> ElasticPoolRow:
        row = s.get(ElasticPoolRow, pool_id, populate_existing=True)
        if row is None or row.tenant_id != tenant_id or not p.can_see_tenant(tenant_id):
            raise NotFound(f"no elastic pool {pool_id!r} of tenant {tenant_id!r}; list them")
        return row

    async def create(
        self, p: Principal, tenant_id: str, body: dict[str, Any], *, actor: str
    ) -> dict[str, Any]:
        def run(s: Session) -> dict[str, Any]:
            self._tenant(s, p, tenant_id)
            row = ElasticPoolRow(tenant_id=tenant_id, created_by=actor, **body)
            _check(row)
            others = s.exec(
                select(ElasticPoolRow).where(ElasticPoolRow.tenant_id == tenant_id)
            ).all()
            for o in others:
                if o.name == row.name or o.prefix == row.prefix:
                    raise Conflict(
                        f"tenant {tenant_id} already has pool {o.name!r} (prefix {o.prefix!r}); "
                        "pick another name and prefix, or change that pool"
                    )
                if o.prefix.startswith(row.prefix) or row.prefix.startswith(o.prefix):
                    raise Conflict(
                        f"prefix {row.prefix!r} overlaps pool {o.name!r}'s {o.prefix!r}: node "
                        "names would be ambiguous; pick a prefix neither starts with"
                    )
            s.add(row)
            add_event(
                s, "elastic.pool-created", actor, tenant_id=tenant_id,
                reason=f"elastic pool {row.name}: {row.prefix}[1-{row.max_nodes}], "
                f"min {row.min_nodes}",
                data={"pool_id": row.id}, instance=self.workflow.instance,
            )  # fmt: skip
            s.commit()
            return view(s, row)

        out = await self.store.run(run)
        await self._changed(tenant_id)
        return out

    async def list(self, p: Principal, tenant_id: str) -> list[dict[str, Any]]:
        def run(s: Session) -> list[dict[str, Any]]:
            self._tenant(s, p, tenant_id)
            rows = s.exec(
                select(ElasticPoolRow)
                .where(ElasticPoolRow.tenant_id == tenant_id)
                .order_by(col(ElasticPoolRow.name))
            ).all()
            return [view(s, r) for r in rows]

        return await self.store.read(run)

    async def show(self, p: Principal, tenant_id: str, pool_id: str) -> dict[str, Any]:
        return await self.store.read(lambda s: view(s, self._load(s, p, tenant_id, pool_id)))

    async def update(
        self,
        p: Principal,
        tenant_id: str,
        pool_id: str,
        body: dict[str, Any],
        *,
        actor: str,
        if_match: int | None,
    ) -> dict[str, Any]:
        def run(s: Session) -> dict[str, Any]:
            row = self._load(s, p, tenant_id, pool_id)
            if if_match is not None and row.version != if_match:
                raise ConcurrentUpdate(
                    f"pool {row.id} is at version {row.version}, not {if_match}; read it again"
                )
            for k, v in body.items():
                setattr(row, k, v)
            _check(row)
            held = _claimed(s, row.id)
            beyond = sorted(n for n in held if not pool_of(row).owns(n))
            if beyond:
                raise Conflict(
                    f"nodes {', '.join(beyond)} hold machines beyond the new max; let them "
                    "suspend (or release their claims) first"
                )
            row.version += 1
            row.updated_at = utcnow()
            s.add(row)
            s.commit()
            return view(s, row)

        out = await self.store.run(run)
        await self._changed(tenant_id)
        return out

    async def delete(self, p: Principal, tenant_id: str, pool_id: str, *, actor: str) -> None:
        def run(s: Session) -> None:
            row = self._load(s, p, tenant_id, pool_id)
            if _claimed(s, row.id):
                raise Conflict(
                    f"pool {row.name} still holds machines; set its min to 0 and let them "
                    "suspend, or release their claims, then delete it"
                )
            s.delete(row)
            add_event(
                s, "elastic.pool-deleted", actor, tenant_id=tenant_id,
                reason=f"elastic pool {row.name} deleted", data={"pool_id": row.id},
                instance=self.workflow.instance,
            )  # fmt: skip
            s.commit()

        await self.store.run(run)
        await self._changed(tenant_id)

    async def quota(self, p: Principal, tenant_id: str) -> dict[str, Any]:
        def run(s: Session) -> dict[str, Any]:
            self._tenant(s, p, tenant_id)
            return quota_view(s.get(ElasticQuota, tenant_id), tenant_id)

        return await self.store.read(run)

    async def set_quota(
        self,
        p: Principal,
        tenant_id: str,
        max_machines: int | None,
        per_sku: dict[str, int],
        *,
        actor: str,
    ) -> dict[str, Any]:
        """An admin caps what the tenant's pools may hold at once (the route allows admins
        only: a tenant does not set its own cap)."""

        def run(s: Session) -> dict[str, Any]:
            self._tenant(s, p, tenant_id)
            q = s.get(ElasticQuota, tenant_id) or ElasticQuota(tenant_id=tenant_id)
            q.max_machines, q.per_sku = max_machines, dict(per_sku)
            q.updated_by, q.updated_at = actor, utcnow()
            s.add(q)
            add_event(
                s, "elastic.quota", actor, tenant_id=tenant_id,
                reason=f"elastic quota: {max_machines if max_machines is not None else 'no'} "
                f"machines at once, per GPU model {per_sku or 'none'}",
                data={"max_machines": max_machines, "per_sku": per_sku},
                instance=self.workflow.instance,
            )  # fmt: skip
            s.commit()
            return quota_view(q, tenant_id)

        return await self.store.run(run)

    async def _changed(self, tenant_id: str) -> None:
        if self.changed is not None:
            await self.changed(tenant_id)

    # ---- what the control plane's spool asks ----------------------------------------------

    async def resume(self, tenant_id: str, names: list[str], *, actor: str) -> dict[str, str]:
        """Claim one machine per resumed name; the names to set down, with their reason."""

        def plan(s: Session) -> list[tuple[ElasticPoolRow, elastic.ResumeDecision]]:
            rows = s.exec(select(ElasticPoolRow).where(ElasticPoolRow.tenant_id == tenant_id)).all()
            out = []
            left = list(names)
            for row in rows:
                pool = pool_of(row)
                mine = [n for n in left if pool.owns(n)]
                left = [n for n in left if not pool.owns(n)]
                if not mine:
                    continue
                claimed = _claimed(s, row.id)
                # A released claim still holds its key: free the key for this new claim.
                for n in mine:
                    old = s.exec(
                        select(Claim).where(
                            Claim.tenant_id == tenant_id, Claim.idempotency_key == key(row.id, n)
                        )
                    ).first()
                    if old is not None and old.state not in LIVE:
                        old.idempotency_key = f"{key(row.id, n)}:was:{old.id}"
                        s.add(old)
                quota, held, sku = _limits(s, tenant_id, row, claimed)
                d = elastic.decide_resume(pool, mine, held, quota, sku=sku, free_machines=len(mine))
                out.append((row, d))
            s.commit()
            if left:
                out.append(
                    (
                        ElasticPoolRow(tenant_id=tenant_id, name="", prefix="x", max_nodes=1,
                                       image=""),
                        elastic.ResumeDecision([], [], dict.fromkeys(left, elastic.REASON_NOT_POOL)),
                    )
                )  # fmt: skip
            return out

        down: dict[str, str] = {}
        for row, d in await self.store.run(plan):
            down.update(d.down)
            for n in d.claim:
                req = ClaimRequest(
                    tenant_id=tenant_id,
                    count=1,
                    selector=Selector.from_dict(dict(row.selector)),
                    image_id=row.image,
                    idempotency_key=key(row.id, n),
                    ssh_authorized_keys=[],
                )
                try:
                    await self.workflow.claim(req, actor=actor, render=lambda s, c, r: c.id)
                except (Conflict, Unprocessable) as e:
                    # First come: another claim (this tenant's or another's) got the last
                    # matching machines; the node waits down, the job stays queued.
                    down[n] = elastic.REASON_NO_MACHINE
                    await self.store.run(_no_machine, tenant_id, n, e, actor)
        return down

    async def retry(self, tenant_id: str, stuck: dict[str, bool], *, actor: str) -> list[str]:
        """Nodes set down for want of a machine (or quota), name -> still powering up: the
        ones that can have a machine now, to return to service. One slurmctld still powers up
        gets its claim here first (it then waits for the machine to register); one it gave up
        on (powered down) is only returned: slurmctld resumes it through ResumeProgram for the
        job still queued. Bounded by the free matching machines, the pool's max and the quota,
        so no node comes back only to be set down again."""

        def plan(s: Session) -> list[str]:
            out: list[str] = []
            rows = s.exec(select(ElasticPoolRow).where(ElasticPoolRow.tenant_id == tenant_id)).all()
            for row in rows:
                pool = pool_of(row)
                mine = [n for n in stuck if pool.owns(n)]
                if not mine:
                    continue
                claimed = _claimed(s, row.id)
                quota, held, sku = _limits(s, tenant_id, row, claimed)
                try:
                    selector = Selector.from_dict(dict(row.selector)).for_image(
                        get_image(s, row.image, tenant_id)
                    )
                except Unprocessable:
                    continue  # the image is gone: the node stays down with its reason
                strict = bmc_required(s, self.workflow.require_bmc)
                _, free = count_matching(s, selector, vouched_only=strict)
                d = elastic.decide_resume(pool, mine, held, quota, sku=sku, free_machines=free)
                out += d.already + d.claim
            return out

        ready = await self.store.read(plan)
        if not ready:
            return []
        up = [n for n in ready if stuck[n]]
        down = await self.resume(tenant_id, up, actor=actor) if up else {}
        back = [n for n in ready if n not in down]
        if back:
            await self.store.run(_retried, tenant_id, back, actor)
        return back

    async def suspend(self, tenant_id: str, names: list[str], *, actor: str) -> list[str]:
        """Release the claims of suspended names (never below min); the names released."""

        def plan(s: Session) -> list[str]:
            out = []
            rows = s.exec(select(ElasticPoolRow).where(ElasticPoolRow.tenant_id == tenant_id)).all()
            for row in rows:
                claimed = _claimed(s, row.id)
                for n in elastic.decide_suspend(pool_of(row), names, set(claimed)):
                    out.append(claimed[n].id)
            return out

        released = []
        for claim_id in await self.store.run(plan):

            def load(s: Session, cid: str) -> Claim:
                c = s.get(Claim, cid, populate_existing=True)
                if c is None:
                    raise NotFound(f"claim {cid} is gone")
                return c

            name = await self.workflow.release(
                claim_id,
                actor=actor,
                load=load,
                render=lambda s, c: (node_of_key(c.idempotency_key) or ("", ""))[1],
            )
            released.append(name)
        return released


def _limits(
    s: Session, tenant_id: str, row: ElasticPoolRow, claimed: dict[str, Claim]
) -> tuple[elastic.Quota, elastic.Holdings, str | None]:
    """The tenant's quota, what it and the pool hold now, and the pool's exact SKU."""
    q = s.get(ElasticQuota, tenant_id)
    quota = elastic.Quota(
        max_machines=q.max_machines if q else None,
        per_sku=dict(q.per_sku) if q else {},
    )
    sku = exact_sku(row.selector)
    held = elastic.Holdings(
        pool_claimed=frozenset(claimed),
        tenant_machines=_count(s, tenant_id, None),
        tenant_by_sku={sku: _count(s, tenant_id, sku)} if sku else {},
    )
    return quota, held, sku


def _retried(s: Session, tenant_id: str, nodes: list[str], actor: str) -> None:
    add_event(
        s, "elastic.retry", actor, tenant_id=tenant_id,
        reason=f"elastic nodes {', '.join(nodes)}: set down for want of a machine, back in "
        "service now that one is free",
        data={"nodes": nodes},
    )  # fmt: skip
    s.commit()


def exact_sku(selector: dict[str, Any]) -> str | None:
    """The GPU model a pool's machines all have (a per-SKU quota applies), or None (no
    model, or a glob)."""
    g = selector.get("gpu_model")
    return g if isinstance(g, str) and not any(c in g for c in "*?[") else None


def _count(s: Session, tenant_id: str, sku: str | None) -> int:
    """The tenant's machines now (of one GPU model)."""
    stmt = select(func.count()).select_from(Machine).where(Machine.tenant_id == tenant_id)
    if sku is not None:
        stmt = stmt.where(Machine.gpu_model == sku)
    return int(s.exec(stmt).one())


def quota_view(q: ElasticQuota | None, tenant_id: str) -> dict[str, Any]:
    if q is None:
        return {"tenant_id": tenant_id, "max_machines": None, "per_sku": {}}
    return q.model_dump(include={"tenant_id", "max_machines", "per_sku", "updated_by",
                                 "updated_at"})  # fmt: skip


def _no_machine(s: Session, tenant_id: str, node: str, e: Exception, actor: str) -> None:
    add_event(
        s, "elastic.no-machine", actor, tenant_id=tenant_id,
        reason=f"elastic node {node}: no machine could be claimed ({e}); set down, its jobs "
        "stay queued until slurmctld resumes it again",
        data={"node": node},
    )  # fmt: skip
    s.commit()


def _check(row: ElasticPoolRow) -> None:
    try:
        pool_of(row)
    except ValueError as e:
        raise Unprocessable(str(e)) from e
