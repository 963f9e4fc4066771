"""The scheduler's rules, with a driver that records what it was asked and fails on demand.

The driver here stands for "some BMC"; the conformance and fault tests run the same scheduler
against real peers (ipmi_sim, sushy-emulator, pyghmi BMC servers)."""

from __future__ import annotations

import asyncio
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from metald.bmc.base import BmcAuthError, BmcProtocolError, BmcTimeout, BmcUnreachable
from metald.bmc.scheduler import BmcScheduler, Health, backoff_delay


class Recorder:
    def __init__(self) -> None:
        self.log: list[tuple[str, str, float]] = []
        self.active: dict[str, int] = {}
        self.overlap = False

    def op(self, key: str, fail: list[BaseException] | None = None, hold: float = 0.01):
        async def run() -> str:
            loop = asyncio.get_running_loop()
            self.active[key] = self.active.get(key, 0) + 1
            self.overlap |= self.active[key] > 1
            self.log.append((key, "start", loop.time()))
            try:
                await asyncio.sleep(hold)
                if fail:
                    raise fail.pop(0)
                return key
            finally:
                self.active[key] -= 1
                self.log.append((key, "end", loop.time()))

        return run


def sched(**kw: object) -> BmcScheduler:
    base = dict(
        max_concurrency=4,
        min_interval_s=0.0,
        timeout_s=1.0,
        retries=2,
        backoff_base_s=0.001,
        backoff_cap_s=0.01,
        rng=random.Random(1),
    )
    base.update(kw)
    return BmcScheduler(**base)  # type: ignore[arg-type]


async def test_commands_to_one_bmc_never_overlap_and_keep_order() -> None:
    s, r = sched(min_interval_s=0.05), Recorder()
    order: list[int] = []

    async def one(i: int) -> None:
        await s.run("b1", r.op("b1"), name="x")
        order.append(i)

    await asyncio.gather(*(one(i) for i in range(5)))
    assert not r.overlap
    assert order == list(range(5))
    starts = [t for k, e, t in r.log if e == "start"]
    ends = [t for k, e, t in r.log if e == "end"]
    # Each start is at least min_interval after the previous end (sleep never returns early).
    for prev_end, start in zip(ends, starts[1:], strict=False):
        assert start - prev_end >= 0.05 - 0.002


async def test_global_bound_holds_across_bmcs() -> None:
    s, r = sched(max_concurrency=3), Recorder()
    await asyncio.gather(*(s.run(f"b{i}", r.op(f"b{i}", hold=0.02), name="x") for i in range(20)))
    assert s.peak_in_flight == 3


async def test_auth_failure_is_not_retried_and_sets_health() -> None:
    s, r = sched(), Recorder()
    with pytest.raises(BmcAuthError):
        await s.run("b", r.op("b", [BmcAuthError("nope")]), name="x")
    assert sum(1 for _, e, _ in r.log if e == "start") == 1
    assert s.health("b") == (Health.AUTH_FAILED, "nope")


async def test_retryable_failures_are_retried_then_succeed() -> None:
    s, r = sched(retries=2), Recorder()
    fails: list[BaseException] = [BmcUnreachable("a"), BmcProtocolError("b")]
    assert await s.run("b", r.op("b", fails), name="x") == "b"
    assert sum(1 for _, e, _ in r.log if e == "start") == 3
    assert s.health("b") == (Health.OK, None)


async def test_retries_run_out_and_health_says_why() -> None:
    s, r = sched(retries=1), Recorder()
    with pytest.raises(BmcUnreachable):
        await s.run("b", r.op("b", [BmcUnreachable("x"), BmcUnreachable("y")]), name="x")
    assert s.health("b") == (Health.UNREACHABLE, "y")
    with pytest.raises(BmcProtocolError):
        await s.run("b", r.op("b", [BmcProtocolError("p"), BmcProtocolError("q")]), name="x")
    assert s.health("b")[0] is Health.ERROR


async def test_a_non_idempotent_command_that_may_have_arrived_is_not_resent() -> None:
    s, r = sched(retries=3), Recorder()
    lost_reply = BmcTimeout("reply lost")
    lost_reply.maybe_delivered = True
    with pytest.raises(BmcTimeout):
        await s.run("b", r.op("b", [lost_reply]), name="cycle", idempotent=False)
    assert sum(1 for _, e, _ in r.log if e == "start") == 1
    # Never delivered (login failed): safe to retry even a cycle.
    assert await s.run("b", r.op("b", [BmcTimeout("login")]), name="cycle", idempotent=False)


async def test_the_deadline_cuts_a_hung_command() -> None:
    s, r = sched(timeout_s=0.05, retries=0), Recorder()
    with pytest.raises(BmcTimeout):
        await s.run("b", r.op("b", hold=5), name="x")
    assert s.health("b")[0] is Health.UNREACHABLE


async def test_health_listener_hears_changes_only() -> None:
    heard: list[tuple[str, Health, str | None]] = []
    s, r = sched(on_health=lambda *a: heard.append(a)), Recorder()
    await s.run("b", r.op("b"), name="x")
    await s.run("b", r.op("b"), name="x")
    with pytest.raises(BmcAuthError):
        await s.run("b", r.op("b", [BmcAuthError("no")]), name="x")
    assert heard == [("b", Health.OK, None), ("b", Health.AUTH_FAILED, "no")]


@given(st.integers(0, 30), st.floats(0.001, 5), st.floats(0.001, 60), st.integers(0, 2**32))
def test_backoff_stays_within_its_ceiling(attempt: int, base: float, cap: float, seed: int) -> None:
    d = backoff_delay(attempt, base, cap, random.Random(seed))
    assert 0 <= d <= min(cap, base * 2**attempt)
