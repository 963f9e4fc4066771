"""Builders for the Day-2 loop's tests: a claim of active machines with spares, a recording
scheduler, and the workflow wired to them."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sqlmodel import Session, col, select

from metald import machines
from metald.claims.allocation import Selector, create_claim
from metald.health.config import HealthConfig, LimitsConfig, PolicyConfig
from metald.health.scheduler import NodeState, NodeStatus
from metald.health.signals import Kind, Signal, Witness
from metald.healthwatch.watch import record_signals
from metald.healthwatch.workflow import MarkBroken, Remediations
from metald.lifecycle import Trigger
from metald.provision import netboot
from metald.store import Store
from metald.store.models import Event, Machine, Remediation
from tests.claims.helpers import DEPLOY, add_image, add_ready, add_tenant

UECC = "critical: Memory #0x01 Uncorrectable ECC | Asserted"


@dataclass
class ActiveClaim:
    claim_id: str
    tenant_id: str
    machines: list[str]
    spares: list[str]


def active_claim(
    store: Store, n: int, *, spares: int = 1, racks: list[str] | None = None, tenant: str = "acme"
) -> ActiveClaim:
    """``n`` machines of a claim, active in the tenant's cluster, and ``spares`` ready ones of
    the same selector."""
    ids = []
    for i, rack in enumerate(racks or [None] * n):  # type: ignore[list-item]
        ids += add_ready(store, 1, labels={"pool": "p"}, rack=rack, prefix=f"gpu{i}-")
    spare = add_ready(store, spares, labels={"pool": "p"}, prefix="spare") if spares else []
    tenant_id = add_tenant(store, tenant)
    with store.session() as s:
        claim, _ = create_claim(
            s, tenant_id, n, Selector(labels={"pool": "p"}), add_image(store), None, "test",
            deploy=DEPLOY,
        )  # fmt: skip
        mine = [m.id for m in s.exec(select(Machine).where(Machine.claim_id == claim.id))]
        netboot.start_provisioning(s, mine, actor="test")
        for mid in mine:
            for t in (Trigger.PROVISIONED, Trigger.JOIN, Trigger.JOINED):
                machines.transition(s, mid, t, actor="test")
        spare = [x for x in ids + spare if x not in mine]
        return ActiveClaim(claim.id, tenant_id, sorted(mine), spare)


@dataclass
class FakeScheduler:
    """The TenantScheduler interface in memory, recording every call."""

    jobs: dict[str, list[str]] = field(default_factory=dict)
    drained: dict[str, str] = field(default_factory=dict)
    removed: set[str] = field(default_factory=set)
    calls: list[tuple[str, str]] = field(default_factory=list)
    #: States set by the test (DOWN, NOT_RESPONDING) win over the recorded ones.
    states: dict[str, NodeState] = field(default_factory=dict)

    def drain(self, node: str, reason: str) -> None:
        self.calls.append(("drain", node))
        self.drained[node] = reason

    def undrain(self, node: str) -> None:
        self.calls.append(("undrain", node))
        self.drained.pop(node, None)

    def node_state(self, node: str) -> NodeStatus:
        if node in self.states:
            return NodeStatus(self.states[node], "Not responding", self.states[node].upper())
        if node in self.removed:
            return NodeStatus(NodeState.ABSENT)
        if node in self.drained:
            return NodeStatus(NodeState.DRAINED, self.drained[node])
        return NodeStatus(NodeState.IDLE)

    def running_jobs(self, node: str) -> list[str]:
        return list(self.jobs.get(node, []))

    def remove_node(self, node: str, reason: str) -> None:
        self.calls.append(("remove", node))
        self.removed.add(node)
        self.jobs.pop(node, None)


def health_cfg(**kw: Any) -> HealthConfig:
    policy = PolicyConfig(job_wait_s=kw.pop("job_wait_s", 0))
    limits = LimitsConfig(**kw.pop("limits", {}))
    return HealthConfig(policy=policy, limits=limits, **kw)


def workflow(
    store: Store, sched: Any, cfg: HealthConfig, instance: str = "i1", **kw: Any
) -> Remediations:
    return Remediations(
        store=store,
        cfg=cfg,
        instance=instance,
        scheduler_for=lambda _t: sched,
        repair=kw.pop("repair", MarkBroken(f"metald:{instance}", instance)),
        deploy=DEPLOY,
        boot=kw.pop("boot", netboot.Provisioner()),
        **kw,
    )


def bmc_fault(store: Store, machine_id: str, cfg: HealthConfig, message: str = UECC) -> int:
    """A fatal BMC event-log signal for the machine, recorded as the watch records it."""
    sig = Signal(Kind.SEL, Witness.BMC, "bmc", message, datetime.now(UTC), f"#0042 {message}")
    return store_run(store, record_signals, machine_id, [sig], cfg=cfg, table=cfg.table(),
                     now=datetime.now(UTC), actor="metald:i1", instance="i1")  # fmt: skip


def store_run(store: Store, fn: Any, *a: Any, **kw: Any) -> Any:
    with store.session() as s:
        return fn(s, *a, **kw)


def rem_rows(store: Store) -> list[Remediation]:
    with store.session() as s:
        return list(s.exec(select(Remediation).order_by(col(Remediation.created_at))))


def events(store: Store, prefix: str) -> list[Event]:
    with store.session() as s:
        return list(
            s.exec(select(Event).where(col(Event.kind).startswith(prefix)).order_by(col(Event.id)))
        )


def claim_members(s: Session, claim_id: str) -> list[str]:
    return sorted(m.id for m in s.exec(select(Machine).where(Machine.claim_id == claim_id)))


def node_name(store: Store, machine_id: str) -> str:
    """The machine's node name in the tenant's scheduler."""
    from metald.provision.metadata import hostname

    with store.session() as s:
        m = s.get(Machine, machine_id)
        assert m is not None
        return hostname(m.id, m.name)
