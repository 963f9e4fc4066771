"""The ``ipmi`` driver against OpenIPMI's ipmi_sim over lanplus, cross-checked with ipmitool."""

from __future__ import annotations

import asyncio
import time

import pytest

from metald.bmc.base import (
    BmcAuthError,
    BmcEndpoint,
    BmcUnreachable,
    BootDevice,
    BootTarget,
    PowerAction,
    PowerState,
)
from metald.bmc.ipmi import IpmiDriver
from tests.bmc.peers import IpmiSim, free_port


def _driver(sim: IpmiSim, password: str | None = None, user: str | None = None) -> IpmiDriver:
    ep = BmcEndpoint("127.0.0.1", sim.port, user or sim.username, password or sim.password)
    return IpmiDriver(ep, request_timeout_s=5.0, resend_s=0.3)


async def test_power_control_and_status(ipmi_sim: IpmiSim) -> None:
    d = _driver(ipmi_sim)
    try:
        assert await d.get_power() is PowerState.OFF
        await d.set_power(PowerAction.ON)
        assert await d.get_power() is PowerState.ON
        # A second, independent client sees the same BMC state.
        assert "on" in (await asyncio.to_thread(ipmi_sim.ipmitool, "power", "status")).lower()
        await d.set_power(PowerAction.RESET)
        await d.set_power(PowerAction.OFF)
        assert await d.get_power() is PowerState.OFF
    finally:
        await d.close()
    assert "set reset 1" in ipmi_sim.calls()
    assert "set power 1" in ipmi_sim.calls()
    assert "set power 0" in ipmi_sim.calls()


async def test_identify_reports_the_configured_guid(ipmi_sim: IpmiSim) -> None:
    d = _driver(ipmi_sim)
    try:
        ident = await d.identify()
    finally:
        await d.close()
    readings = {ident.system_uuid, *ident.extra["uuid_candidates"]}
    assert ipmi_sim.system_uuid in readings


@pytest.mark.parametrize("persistent", [False, True])
async def test_boot_device_pxe_and_disk(ipmi_sim: IpmiSim, persistent: bool) -> None:
    d = _driver(ipmi_sim)
    try:
        await d.set_boot_device(BootDevice(BootTarget.PXE, persistent=persistent, uefi=True))
        await d.set_boot_device(BootDevice(BootTarget.DISK, persistent=persistent, uefi=False))
    finally:
        await d.close()
    calls = ipmi_sim.calls()
    assert "set boot pxe" in calls
    assert "set boot default" in calls or any(
        c.startswith("set boot") and "pxe" not in c for c in calls
    )


async def test_session_is_reused_across_commands(ipmi_sim: IpmiSim) -> None:
    d = _driver(ipmi_sim)
    try:
        await d.get_power()
        keys = d.session.keys
        await d.get_power()
        assert d.session.keys is keys and keys is not None
    finally:
        await d.close()
    assert d.session.keys is None


async def test_an_idle_close_due_does_not_close_the_session_under_a_new_command(
    ipmi_sim: IpmiSim,
) -> None:
    """The idle timer fires in the loop iteration that also wakes a command (a starved loop
    runs long batches of callbacks: bench/fleet.py at 10,000 machines). The command takes the
    lock and sends first; the idle close must then stand down. The old close ran under the
    command: the BMC powered on, the command failed ('the session was closed while waiting'),
    and the scheduler sent the power-on again, executed twice (14 times in the 10,000 run).
    Fails on the old code: BmcUnreachable."""
    d = _driver(ipmi_sim)
    try:
        await d.set_power(PowerAction.OFF)  # logged in, with the admin privilege
        keys = d.session.keys
        before = ipmi_sim.calls().count("set power 1")
        command = asyncio.ensure_future(d.set_power(PowerAction.ON))
        d._expire()  # the idle timer, due in the same iteration, after the command's wake-up
        await command
        assert await d.get_power() is PowerState.ON
        assert d.session.keys is keys, "the session was closed under the command"
        assert ipmi_sim.calls().count("set power 1") == before + 1
        # Idle for real, the close still happens (nothing used the session since the timer).
        d._expire()
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert d.session.keys is None
    finally:
        await d.close()


async def test_wrong_password_is_an_auth_error_with_a_clear_message(ipmi_sim: IpmiSim) -> None:
    d = _driver(ipmi_sim, password="not-the-password")
    with pytest.raises(BmcAuthError, match="different password") as ei:
        await d.get_power()
    assert "not-the-password" not in str(ei.value) and "not-the-password" not in repr(ei.value)


async def test_unknown_user_is_an_auth_error(ipmi_sim: IpmiSim) -> None:
    d = _driver(ipmi_sim, user="mallory")
    with pytest.raises(BmcAuthError):
        await d.get_power()


async def test_nothing_listening_is_unreachable_quickly() -> None:
    port = free_port()
    d = IpmiDriver(BmcEndpoint("127.0.0.1", port, "admin", "x"), request_timeout_s=5.0)
    start = time.monotonic()
    with pytest.raises(BmcUnreachable, match="port unreachable"):
        await d.get_power()
    # ICMP port-unreachable ends the wait instead of the 5 s deadline (not a timing assertion
    # on the BMC: the kernel answers on loopback at once).
    assert time.monotonic() - start < 4.5


async def test_sensors_and_event_log_via_pyghmi(ipmi_sim: IpmiSim) -> None:
    d = _driver(ipmi_sim)
    try:
        sensors = await d.sensors()
        log = await d.event_log()
    finally:
        await d.close()
    temps = [s for s in sensors if s.name == "CPU Temp"]
    assert temps and temps[0].kind == "temperature" and temps[0].value == pytest.approx(45)
    assert temps[0].unit is not None and "C" in temps[0].unit
    assert len(log) == 1
    assert log[0].id == "1" and log[0].severity == "critical"
    assert "CPU Temp" in log[0].message and "Upper critical" in log[0].message
