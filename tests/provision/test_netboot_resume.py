"""The network-boot step's shell against a real store: the process is killed at any point of
the step (before or after any store transaction, before or after any journal write, before or
after any command reaches the BMC), any number of times, and each restart runs the step again
from what the store holds. The BMC's journal and the core decide: no power-off and no power-on
ever reaches the BMC twice, and a step that ends booting did so in order."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import update
from sqlmodel import select

from metald.bmc import ownership
from metald.bmc.base import BootTarget, PowerAction, PowerState
from metald.bmc.control import step_key
from metald.lifecycle import State
from metald.provision import netboot, netboot_core
from metald.store import Store
from metald.store.models import Bmc, Machine, utcnow
from tests.claims.helpers import claimed


class Killed(BaseException):
    """The process died here: nothing after this point ran."""


class Deaths:
    """Counts the points where the process may die and kills it at the chosen ones."""

    def __init__(self, at: frozenset[int]) -> None:
        self.at = at
        self.passed = 0

    def point(self) -> None:
        self.passed += 1
        if self.passed in self.at:
            raise Killed


class DyingStore:
    """The store as the step sees it: the process may die before or after any transaction."""

    def __init__(self, store: Store, deaths: Deaths) -> None:
        self.store = store
        self.deaths = deaths

    async def run(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        self.deaths.point()
        out = await self.store.run(fn, *args, **kwargs)
        self.deaths.point()
        return out


class JournalingBmc:
    """A BMC control that journals each step command in the store before sending it, as
    metald's fenced executor does, and remembers what reached the BMC."""

    def __init__(self, store: Store, bmc_id: str, power: str, deaths: Deaths) -> None:
        self.store = store
        self.bmc_id = bmc_id
        self.state = power
        self.deaths = deaths
        self.sent: list[str] = []

    async def _send(self, step: str | None, command: str) -> None:
        self.deaths.point()
        assert step is not None
        assert await self.store.run(
            ownership.check_and_journal, self.bmc_id, None, None, step, command
        )
        self.deaths.point()  # journaled, not sent

    async def read_power(self, machine_id: str, *, actor: str = "") -> PowerState:
        self.deaths.point()
        return PowerState(self.state)

    async def power(
        self, machine_id: str, action: PowerAction, *, actor: str = "", step: str | None = None
    ) -> PowerState:
        await self._send(step, f"power:{action}")
        self.sent.append(str(action))
        self.state = "off" if action == PowerAction.OFF else "on"
        self.deaths.point()  # sent, not acknowledged
        return PowerState(self.state)

    async def set_boot_device(
        self,
        machine_id: str,
        device: BootTarget,
        persistent: bool = False,
        *,
        uefi: bool | None = None,
        actor: str = "",
        step: str | None = None,
    ) -> None:
        await self._send(step, f"boot:{device}")
        self.sent.append(str(device))
        self.deaths.point()


def _machine_with_bmc(store: Store) -> tuple[str, str]:
    mid = claimed(store, 1)[0]
    with store.session() as s:
        s.add(
            Bmc(
                address="10.9.0.7",
                port=623,
                protocol="ipmi",
                username="u",
                password_enc=b"x",
                machine_id=mid,
            )
        )
        s.commit()
        return mid, s.exec(select(Bmc.id).where(Bmc.machine_id == mid)).one()


def _fresh_step(store: Store, mid: str, bid: str) -> str:
    """Enter provisioning again (a new step) with nothing journaled or armed."""
    with store.session() as s:
        s.execute(
            update(Machine)
            .where(Machine.id == mid)  # type: ignore[arg-type]
            .values(state=State.PROVISIONING.value, state_changed_at=utcnow(), boot_armed=None)
        )
        s.execute(
            update(Bmc)
            .where(Bmc.id == bid)  # type: ignore[arg-type]
            .values(step=None, step_command=None, step_done=False)
        )
        s.commit()
        return step_key(s.get(Machine, mid))  # type: ignore[arg-type]


@pytest.fixture
def fast_off_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """A lost power-off times out in a fraction of a second instead of a minute."""
    monkeypatch.setattr(netboot_core, "POWER_OFF_WAIT_S", 0.05)
    monkeypatch.setattr(netboot_core, "POWER_OFF_POLL_S", 0.01)


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    power=st.sampled_from(["on", "off"]),
    deaths=st.frozensets(st.integers(1, 30), max_size=5),
)
async def test_a_step_killed_anywhere_resumes_without_a_second_power_command(
    store: Store, fast_off_wait: None, power: str, deaths: frozenset[int]
) -> None:
    if not hasattr(store, "_netboot_machine"):
        store._netboot_machine = _machine_with_bmc(store)  # type: ignore[attr-defined]
    mid, bid = store._netboot_machine  # type: ignore[attr-defined]
    step = _fresh_step(store, mid, bid)
    dying = Deaths(deaths)
    bmc = JournalingBmc(store, bid, power, dying)
    outcome = None
    for _restart in range(len(deaths) + 1):
        try:
            outcome = await netboot.boot_from_network(
                DyingStore(store, dying),
                bmc,
                mid,
                actor="t",  # type: ignore[arg-type]
            )
            break
        except Killed:
            continue  # a new process: it knows only what the store holds
    assert outcome is not None, "the step never ended"
    assert bmc.sent.count("off") <= 1, bmc.sent
    assert bmc.sent.count("on") <= 1, bmc.sent
    with store.session() as s:
        journal = ownership.read_step(s, mid, step)
        m = s.get(Machine, mid)
        assert journal is not None and m is not None
        if outcome:
            assert journal.done and bmc.state == "on"
            on = bmc.sent.index("on")
            assert "pxe" in bmc.sent[:on], bmc.sent
            assert "off" in bmc.sent[:on] or power == "off", bmc.sent
            assert m.boot_armed is not None or m.boot_current is not None
        else:
            # The one way it fails: killed between journaling the power-off and sending it.
            # The machine never read off; the step failed visibly instead of sending it again.
            assert (journal.command, power, bmc.sent) == ("power:off", "on", [])
            # (a journal left open by a death after the move is closed by the watchdog)
            assert m.state == State.PROVISION_FAILED.value


async def test_a_step_killed_before_its_first_command_is_left_for_the_takeover(
    store: Store,
) -> None:
    """The step journals ``requested`` when it starts, in the transaction that loads it: an
    instance killed after that and before its first BMC command (the holder of the BMC running
    a release sent to its own API) leaves an unfinished step that the BMC's next holder
    resumes at takeover (``watchdog.unfinished_steps``). On the old code nothing was
    journaled before the first command: the step waited for the cut-off-boot sweep
    (``claimed_resume_s``, 120 s; bench/fleet.py's release phase, 2-6 wipes a run)."""
    from metald.provision import watchdog

    mid, bid = _machine_with_bmc(store)
    step = _fresh_step(store, mid, bid)
    dying = Deaths(frozenset({2}))  # after the step's first transaction (loading it)
    bmc = JournalingBmc(store, bid, "on", dying)
    with pytest.raises(Killed):
        await netboot.boot_from_network(DyingStore(store, dying), bmc, mid, actor="t")  # type: ignore[arg-type]
    assert bmc.sent == []
    with store.session() as s:
        journal = ownership.read_step(s, mid, step)
        assert journal is not None and journal.command == netboot_core.REQUESTED
        assert not journal.done
        assert watchdog.unfinished_steps(s, None) == [mid]
    # The survivor's resume runs the whole step, once.
    bmc.deaths = Deaths(frozenset())
    assert await netboot.boot_from_network(store, bmc, mid, actor="t")
    assert bmc.sent == ["off", "pxe", "on"]
