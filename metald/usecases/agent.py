"""What the agents in a machine's RAM ask of metald (agent tokens only, each scoped to its
machine): the discovery agent posts inventory and asks what next; the deploy agent asks what
to install or wipe and reports progress.

An agent token's writes run in the request's own transactions (``tx``: its first use is
stamped in the same commit); its reads aside the writes (``Store.read_aside``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from sqlmodel import Session

from metald import enrollment, machines
from metald.auth import Principal, require_agent_phase
from metald.bmc.links import link_probe
from metald.claims.provisioning import next_step
from metald.claims.workflow import ClaimWorkflow
from metald.lifecycle import State
from metald.provision import commissioning
from metald.provision.progress import Progress, record_progress
from metald.store.db import Store
from metald.store.models import Machine
from metald.usecases import Writes


class AgentBmc(Protocol):
    """The BMC service as the agent's reports reach it (``metald.bmc``)."""

    def link_by_identity_in(self, s: Session, machine_id: str, *, actor: str) -> bool: ...

    def after_inspection(self, machine_id: str) -> object: ...


def _machine_id(p: Principal) -> str:
    return next(iter(p.scope))


def instruction(s: Session, m: Machine, cfg: Any) -> dict[str, Any]:
    """``enrollment.next_instruction``, with the commissioning plan when it may be served."""
    out = enrollment.next_instruction(m, cfg)
    run = commissioning.current_run(s, m.id) if out["action"] == "commission" else None
    plan = None if run is None else commissioning.agent_plan(run)
    if plan is not None:
        out["plan"] = plan
    return out


@dataclass
class Agent:
    store: Store
    #: The request's transactions (``api.routing.ApiRequest``).
    tx: Writes
    instance: str
    #: Wakes the live event streams after a commit.
    notify: Callable[[], None]
    #: The [enroll] settings: what a machine does next, its commissioning rules.
    enroll: Any
    #: provision.progress_event_interval_s: progress events at most this often.
    progress_interval_s: float
    #: tenants.join_token_ttl_s: how long a node's join token lives.
    join_token_ttl_s: int
    #: The BMC service; None when this daemon runs none.
    bmc: Any
    workflow: ClaimWorkflow

    async def post_inventory(self, p: Principal, payload: Any, *, actor: str) -> dict[str, Any]:
        """Accept the inspecting machine's inventory (``enrollment.accept_inventory``) and
        answer what it does next, and link a BMC registered before the machine was known, in
        one transaction (an instance killed between the two left ready machines without their
        BMC: unclaimable under ``enroll.require_bmc``, unpowerable); then read its firmware
        (in the background)."""
        mid = _machine_id(p)
        cfg = self.enroll

        def run(s: Session) -> tuple[dict[str, Any], bool]:
            # A provisioning or wipe token of this machine cannot rewrite its inventory.
            m = machines.get_machine(s, mid)
            require_agent_phase(p, m.state, {"inspect"})
            m = enrollment.accept_inventory(
                s,
                mid,
                payload,
                actor=actor,
                cfg=cfg,
                instance=self.instance,
                commit=False,
                machine=m,
            )
            nxt = instruction(s, m, cfg)  # in the same transaction: the run it just started
            # One Core read says whether there is BMC work at all: a storm's machines have no
            # BMC and none is unlinked.
            linked, unlinked = link_probe(s, mid) if self.bmc is not None else (False, False)
            if not linked and unlinked:
                # A BMC registered before its machine was known: linked by UUID, serial or MAC.
                linked = self.bmc.link_by_identity_in(s, mid, actor=f"metald:{self.instance}")
            s.commit()
            return {
                "machine_id": m.id,
                "state": m.state,
                "gpu_model": m.gpu_model,
                "gpu_count": m.gpu_count,
                "next": nxt,
            }, linked

        try:
            out, linked = await self.tx.run(run)
        finally:
            self.notify()
        if self.bmc is not None and linked:
            # Firmware versions, BIOS profile, a virtual-media ISO to eject (background).
            # Without a BMC there is none of these to read, stage or eject.
            self.bmc.after_inspection(mid)
        return out

    async def next_instruction(self, p: Principal) -> dict[str, Any]:
        """What the discovery agent does next; a read that never queues behind the writes."""
        mid = _machine_id(p)
        return await self.store.read_aside(
            lambda s: instruction(s, machines.get_machine(s, mid), self.enroll)
        )

    async def post_progress(
        self, p: Principal, progress: dict[str, Any], *, actor: str
    ) -> dict[str, Any]:
        """Record an install's or wipe's progress (``record_progress``); once it ends, the
        BMC ejects a virtual-media boot's ISO, and a wiped machine whose profile asks to be
        commissioned again is booted into inspection."""
        mid = _machine_id(p)
        rules = self.enroll.rules

        def run(s: Session) -> dict[str, Any]:
            require_agent_phase(p, machines.get_machine(s, mid).state, {"provision", "wipe"})
            m: Machine = record_progress(
                s,
                mid,
                Progress(**progress),
                actor=actor,
                instance=self.instance,
                min_interval_s=self.progress_interval_s,
                token_boot=p.boot,
                on_wiped=lambda s, m: commissioning.after_wipe(
                    s, m, rules, actor=actor, instance=self.instance
                ),
            )
            return {"machine_id": m.id, "state": m.state}

        out = await self.tx.run(run)
        self.notify()
        after = getattr(self.bmc, "after_report", None)
        if (progress.get("done") or progress.get("error")) and after is not None:
            after(mid)  # a virtual-media boot's ISO is ejected
        if State(out["state"]) is State.INSPECTING:  # wiped; its profile asks to commission
            self.workflow.network_boot([mid], f"metald:{self.instance}")
        return out

    async def provision(
        self, p: Principal, *, actor: str, join_url: str, join_ca: str = ""
    ) -> dict[str, Any]:
        """What the deploy agent installs or wipes (``claims.provisioning.next_step``);
        ``join_ca`` the fingerprint of the CA the node pins for an https ``join_url``."""
        mid = _machine_id(p)

        def run(s: Session) -> dict[str, Any]:
            m = s.get(Machine, mid)
            if m is not None:
                # A discovery token of this machine, once it is claimed, gets nothing here.
                require_agent_phase(p, m.state, {"provision", "wipe"})
            step = next_step(
                s,
                m,
                mid,
                actor=actor,
                join_url=join_url,
                join_ca=join_ca,
                join_token_ttl_s=self.join_token_ttl_s,
                instance=self.instance,
                settings=self.workflow.tenant_os,
            )
            return asdict(step)

        return await self.tx.run(run)
