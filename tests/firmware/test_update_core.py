"""The update step table (metald.firmware.updates) under crashes anywhere: the phase is
recorded before each action, a crash loses everything else, and a resume starts from the
recorded phase. Whatever the crash points and the BMC's behaviour, the image is offered at
most once, the host is never power-cycled while the BMC flashes, and "done" means the wanted
version was read back."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metald.firmware.updates import (
    FINAL,
    FLASH_WINDOW,
    Action,
    Decision,
    Event,
    IllegalEvent,
    Phase,
    decide,
    power_allowed,
)


@dataclass
class FakeBmc:
    refuse: bool = False
    fail_task: bool = False
    #: Polls the task takes to finish.
    polls: int = 2
    #: The offer is lost on the way (the BMC never sees it).
    lose_offer: bool = False
    offers: int = 0
    task: int | None = None
    flashing: bool = False
    written: bool = False
    running: str = "1.0"
    power_cycles_during_flash: int = 0
    power_cycles: int = 0

    def offer(self) -> bool | None:
        """True: accepted; False: refused; None: no answer (it may or may not have arrived)."""
        if self.lose_offer:
            self.lose_offer = False
            return None
        self.offers += 1
        if self.refuse:
            return False
        self.task, self.flashing = self.polls, True
        return True

    def poll(self) -> str:
        assert self.task is not None
        if self.task > 0:
            self.task -= 1
            return "running"
        if self.flashing:
            self.flashing = False
            self.written = not self.fail_task
        return "failed" if self.fail_task else "completed"

    def cycle(self) -> None:
        self.power_cycles += 1
        if self.flashing:
            self.power_cycles_during_flash += 1
        if self.written:
            self.running = "2.0"


@dataclass
class Run:
    bmc: FakeBmc
    crashes: list[int]
    apply: str = "host-reset"
    stored: Phase = Phase.QUEUED
    steps: int = 0
    phases: list[Phase] = field(default_factory=list)

    def crash_now(self) -> bool:
        self.steps += 1
        return self.steps in self.crashes

    def go(self) -> Phase:
        d = decide(self.stored, Event.START, apply=self.apply)
        for _ in range(200):
            # The phase is recorded before the action is taken (the service's order).
            self.stored = d.phase
            self.phases.append(d.phase)
            if self.crash_now():
                if self.stored in FINAL:
                    return self.stored  # nothing resumes an update that ended
                d = decide(self.stored, Event.RESUME, apply=self.apply)
                continue
            if d.action is Action.STOP:
                return d.phase
            d = self.act(d)
        raise AssertionError("no end")

    def act(self, d: Decision) -> Decision:
        b, ph = self.bmc, d.phase
        if d.action is Action.OFFER:
            self.stored = Phase.OFFERING  # recorded before it is sent
            self.phases.append(Phase.OFFERING)
            if self.crash_now():
                return decide(self.stored, Event.RESUME)
            answer = b.offer()
            if answer is None:  # as after a crash: look for the task, never resend
                return decide(Phase.OFFERING, Event.RESUME)
            return decide(Phase.OFFERING, Event.OFFERED if answer else Event.REFUSED)
        if d.action is Action.FIND_TASK:
            return decide(ph, Event.TASK_FOUND if b.task is not None else Event.TASK_MISSING)
        if d.action is Action.POLL_TASK:
            got = b.poll()
            ev = {"running": Event.TASK_RUNNING, "failed": Event.TASK_FAILED}.get(
                got, Event.TASK_COMPLETED
            )
            return decide(ph, ev, apply=self.apply)
        if d.action is Action.APPLY:
            assert power_allowed(ph)
            b.cycle()
            return decide(ph, Event.APPLIED)
        if d.action is Action.READ_VERSION:
            ok = b.running == "2.0"
            if not ok and self.apply == "none" and b.written:
                b.running, ok = "2.0", True  # takes effect at once
            return decide(ph, Event.VERSION_OK if ok else Event.TIMEOUT)
        raise AssertionError(d)


@settings(max_examples=400, deadline=None)
@given(
    crashes=st.lists(st.integers(1, 14), max_size=4),
    refuse=st.booleans(),
    fail_task=st.booleans(),
    lose_offer=st.booleans(),
    polls=st.integers(0, 3),
    apply=st.sampled_from(["none", "host-reset", "bmc-reset"]),
)
def test_never_twice_never_mid_flash_done_means_read_back(
    crashes: list[int], refuse: bool, fail_task: bool, lose_offer: bool, polls: int, apply: str
) -> None:
    bmc = FakeBmc(refuse=refuse, fail_task=fail_task, polls=polls, lose_offer=lose_offer)
    end = Run(bmc, crashes, apply=apply).go()
    assert bmc.offers <= 1
    assert bmc.power_cycles_during_flash == 0
    if end is Phase.DONE:
        assert bmc.running == "2.0" and bmc.offers == 1 and not refuse and not fail_task
    else:
        assert end is Phase.FAILED
    if apply == "none":
        assert bmc.power_cycles == 0


def test_a_lost_offer_fails_rather_than_flashing_again() -> None:
    bmc = FakeBmc(lose_offer=True)
    assert Run(bmc, crashes=[]).go() is Phase.FAILED
    assert bmc.offers == 0  # not sent a second time


def test_a_crash_after_the_offer_resumes_from_the_task() -> None:
    bmc = FakeBmc(polls=3)
    run = Run(bmc, crashes=[3, 4, 5])  # cut off repeatedly while the BMC flashes
    assert run.go() is Phase.DONE
    assert bmc.offers == 1 and bmc.running == "2.0"
    assert Phase.FLASHING in run.phases


def test_flash_window_refuses_power_and_illegal_events() -> None:
    assert {p for p in Phase if not power_allowed(p)} == FLASH_WINDOW
    with pytest.raises(IllegalEvent, match="phase done does not take resume"):
        decide(Phase.DONE, Event.RESUME)
    d = decide(Phase.FLASHING, Event.TASK_FAILED, detail="image failed its integrity check")
    assert d.phase is Phase.FAILED and d.reason is not None and "integrity" in d.reason
    assert decide(Phase.FLASHING, Event.TASK_COMPLETED, apply="none").action is Action.READ_VERSION
    assert decide(Phase.FLASHING, Event.TASK_COMPLETED, apply="bmc-reset").action is Action.APPLY


def test_a_crash_between_recording_and_sending_the_offer_never_resends() -> None:
    bmc = FakeBmc()
    run = Run(bmc, crashes=[2])  # "offering" recorded, cut off before it was sent
    assert run.go() is Phase.FAILED
    assert bmc.offers == 0
