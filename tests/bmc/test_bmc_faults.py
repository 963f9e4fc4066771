"""Fault injection: the IPMI driver under the scheduler against pyghmi BMC servers that time
out, answer slowly, hold another password, or vanish in the middle of a command."""

from __future__ import annotations

import pytest

from metald.bmc.base import (
    BmcAuthError,
    BmcEndpoint,
    BmcTimeout,
    BmcUnreachable,
    PowerAction,
    PowerState,
)
from metald.bmc.ipmi import IpmiDriver
from metald.bmc.scheduler import BmcScheduler, Health, attempts_retried
from tests.bmc.peers import PASSWORD


def _driver(port: int, password: str = PASSWORD, timeout: float = 3.0) -> IpmiDriver:
    return IpmiDriver(
        BmcEndpoint("127.0.0.1", port, "admin", password), request_timeout_s=timeout, resend_s=0.3
    )


def _sched(timeout: float = 3.0, retries: int = 2) -> BmcScheduler:
    return BmcScheduler(
        max_concurrency=8,
        min_interval_s=0,
        timeout_s=timeout,
        retries=retries,
        backoff_base_s=0.05,
        backoff_cap_s=0.1,
    )


def _retries(op: str) -> float:
    return attempts_retried.labels(op)._value.get()


async def test_a_healthy_pyghmi_bmc_cycles_exactly_once(fault_bmc) -> None:
    bmc = fault_bmc("ok")
    d, s = _driver(bmc.port), _sched()
    try:
        assert await s.run("b", d.get_power, name="status") is PowerState.OFF
        await s.run("b", lambda: d.set_power(PowerAction.CYCLE), name="cycle", idempotent=False)
        assert await s.run("b", d.get_power, name="status") is PowerState.ON
    finally:
        await d.close()
    assert bmc.controls() == ["control on"]
    assert s.health("b") == (Health.OK, None)


async def test_slow_bmc_within_the_deadline_is_ok(fault_bmc) -> None:
    bmc = fault_bmc("slow")  # 1.5 s per chassis command
    d, s = _driver(bmc.port, timeout=3.5), _sched(timeout=4.0)
    try:
        await s.run("b", lambda: d.set_power(PowerAction.ON), name="on")
    finally:
        await d.close()
    assert bmc.controls() == ["control on"]
    assert s.health("b")[0] is Health.OK


async def test_bmc_that_never_answers_commands_ends_unreachable(fault_bmc) -> None:
    bmc = fault_bmc("timeout")  # logs in, then ignores chassis commands
    d, s = _driver(bmc.port, timeout=0.8), _sched(timeout=1.0, retries=1)
    before = _retries("status-timeout")
    try:
        with pytest.raises(BmcTimeout, match="no reply"):
            await s.run("b", d.get_power, name="status-timeout")
    finally:
        await d.close()
    assert _retries("status-timeout") == before + 1  # retried once, then gave up
    health, detail = s.health("b")
    assert health is Health.UNREACHABLE and detail and "no reply" in detail


async def test_wrong_password_is_auth_failed_at_once_and_not_retried(fault_bmc) -> None:
    bmc = fault_bmc("ok", password="another-password")
    d, s = _driver(bmc.port), _sched(retries=3)
    before = _retries("status-auth")
    try:
        with pytest.raises(BmcAuthError, match="different password"):
            await s.run("b", d.get_power, name="status-auth")
    finally:
        await d.close()
    assert _retries("status-auth") == before
    health, detail = s.health("b")
    assert health is Health.AUTH_FAILED
    assert detail and "login refused" in detail and PASSWORD not in detail


async def test_bmc_vanishing_mid_cycle_is_not_sent_again(fault_bmc) -> None:
    bmc = fault_bmc("vanish")  # exits on receiving chassis control, before acting or answering
    d, s = _driver(bmc.port, timeout=1.5), _sched(timeout=2.0, retries=3)
    before = _retries("cycle-vanish")
    try:
        assert await s.run("b", d.get_power, name="status") is PowerState.OFF
        with pytest.raises((BmcTimeout, BmcUnreachable)) as ei:
            await s.run(
                "b", lambda: d.set_power(PowerAction.CYCLE), name="cycle-vanish", idempotent=False
            )
    finally:
        await d.close()
    assert ei.value.maybe_delivered
    assert _retries("cycle-vanish") == before  # a cycle that may have landed is not repeated
    assert bmc.proc.wait(5) == 3  # it did receive the command, once
    assert s.health("b")[0] is Health.UNREACHABLE
