"""Commissioning as the API drives it: a technician starts a run and reads the results; the
discovery agent asks for its plan and posts what it measured.

With the ``bmc-sel`` check, metald reads the machine's BMC event log before the checks and
again after the last one (``provision.commissioning.sel_read``, in the background); the
agent's request waits for that read at most ``sel_wait_s``."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlmodel import Session

from metald import machines, repairs
from metald.auth import Principal, Role, require_agent_phase
from metald.claims.workflow import ClaimWorkflow
from metald.commissioning.profile import CommissioningProfile
from metald.errors import Conflict
from metald.inventory.normalize import NormalizedInventory
from metald.inventory.rules import profile_for
from metald.lifecycle import COMMISSION_RUNNING, State
from metald.provision import commissioning as runs
from metald.provision.commissioning import SelReads
from metald.store.db import Store
from metald.store.models import CommissioningRun, Machine
from metald.usecases import Writes
from metald.usecases.machines import load_visible

#: How long an agent's request waits for metald's reading of the BMC event log (bmc-sel)
#: before it is answered without it; the agent's own requests give up at 30 s.
SEL_WAIT_S = 20.0


def commissioning_view(s: Session, machine_id: str) -> dict[str, Any]:
    """The machine's state, its newest run (or None) and the older runs, newest first."""
    m = machines.get_machine(s, machine_id)
    hist = runs.history(s, machine_id)
    return {
        "machine_id": m.id,
        "state": m.state,
        "last": hist[0] if hist else None,
        "history": hist[1:],
    }


def _agent_machine(s: Session, p: Principal) -> Machine:
    """The agent's machine, while it commissions in the boot the token was minted for."""
    mid = next(iter(p.scope))
    m = machines.get_machine(s, mid)
    require_agent_phase(p, m.state, {"inspect"})
    if State(m.state) not in COMMISSION_RUNNING:
        raise Conflict(f"machine {mid} is {m.state}, not commissioning; ask /api/v1/agent/next")
    if p.boot is not None and p.boot != m.boot_current:
        raise Conflict("this agent token belongs to an earlier boot of the machine; boot again")
    return m


def _not_in_repair(s: Session, p: Principal, m: Machine) -> Machine:
    """A machine the repair queue holds is commissioned through it ("repaired")."""
    repairs.check_manual(s, m.id, "commission", admin=p.role is Role.ADMIN)
    return m


@dataclass
class Commissioning:
    store: Store
    #: Where the agent's results are written: the request's transactions (an agent token's
    #: first use is stamped in the same commit).
    tx: Writes
    instance: str
    #: Wakes the live event streams after a commit.
    notify: Callable[[], None]
    #: enroll.rules: which profile a machine's inventory gets.
    rules: Any
    #: Reads a machine's BMC event log (the BMC service's ``event_log``); None: no BMC service.
    sel_reader: Any
    #: How long one event-log read may take.
    sel_timeout_s: float
    #: The daemon's background event-log reads (``provision.commissioning.SelReads``).
    sel_reads: SelReads
    workflow: ClaimWorkflow | None = None
    #: How long an agent's request waits for it before it is answered without it.
    sel_wait_s: float = SEL_WAIT_S

    async def show(self, p: Principal, machine_id: str) -> dict[str, Any]:
        return await self.store.run(
            lambda s: commissioning_view(s, load_visible(s, p, machine_id).id)
        )

    def _profile_of(self, m: Machine) -> CommissioningProfile | None:
        inv = (m.inventory or {}).get("normalized")
        if inv is None:
            return None
        return profile_for(self.rules, NormalizedInventory.model_validate(inv), m.rack_position)

    async def commission(
        self, p: Principal, machine_id: str, *, actor: str, reason: str | None
    ) -> dict[str, Any]:
        """Inspect the machine again (booted through its BMC) and commission it with the
        profile the enroll rules give its fresh inventory (``ClaimWorkflow.commission``)."""
        assert self.workflow is not None, "Commissioning built without its claim workflow"
        return await self.workflow.commission(
            machine_id,
            actor=actor,
            load=lambda s, mid: _not_in_repair(s, p, load_visible(s, p, mid)),
            render=lambda s, m: commissioning_view(s, m.id),
            profile_of=self._profile_of,
            reason=reason,
        )

    def _sel_read(self, phase: str, run_id: str, machine_id: str, actor: str) -> Any:
        return self.sel_reads.read(
            phase,
            run_id,
            machine_id,
            store=self.store,
            reader=self.sel_reader,
            timeout_s=self.sel_timeout_s,
            actor=actor,
            instance=self.instance,
            notify=self.notify,
        )

    async def agent_plan(self, p: Principal, *, actor: str) -> dict[str, Any] | None:
        """The checks the agent's run selects, with timeouts; None while metald is still
        reading the BMC event log the run wants first (the agent asks again)."""

        def run(s: Session) -> tuple[str, str, bool, dict[str, Any]]:
            mid = _agent_machine(s, p).id
            r = runs.current_run(s, mid)
            if r is None:
                raise Conflict(f"machine {mid} has no running commissioning run")
            plan = {"run_id": r.id, "profile": r.profile, "checks": runs.run_profile(r).plan()}
            return mid, r.id, runs.sel_wanted(r) and r.sel_before is None, plan

        mid, run_id, need_sel, plan = await self.store.read_aside(run)
        if need_sel:
            task = self._sel_read("before", run_id, mid, actor)
            done, _ = await asyncio.wait({task}, timeout=self.sel_wait_s)
            if not done:
                return None
        return plan

    async def agent_results(
        self, p: Principal, results: list[Any], *, done: bool, actor: str
    ) -> dict[str, Any]:
        """Record the agent's reports (``runs.record_results``: metald judges each check);
        when that finishes the run and it wants the event log read again, wait (bounded) for
        that read and answer the run as it then stands."""

        def run(s: Session) -> tuple[dict[str, Any], bool]:
            m = _agent_machine(s, p)
            rec = runs.record_results(
                s, m.id, results, done=done, actor=actor, instance=self.instance, machine=m
            )
            out = {"run_id": rec.run.id, "status": rec.run.status, "state": rec.state}
            return out, rec.awaits_sel

        try:
            out, awaits = await self.tx.run(run)
        finally:
            self.notify()
        if awaits:
            task = self._sel_read("after", out["run_id"], next(iter(p.scope)), actor)
            await asyncio.wait({task}, timeout=self.sel_wait_s)
            run_id = out["run_id"]

            def reread(s: Session) -> dict[str, Any]:
                r = s.get(CommissioningRun, run_id)
                m = machines.get_machine(s, r.machine_id if r else "")
                return {"run_id": run_id, "status": r.status if r else "", "state": m.state}

            out = await self.store.read_aside(reread)
        return out
