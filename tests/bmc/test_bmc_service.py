"""BmcService end to end on a real store (SQLite and PostgreSQL: the shared ``store`` fixture),
against ipmi_sim, sushy-emulator and pyghmi BMCs."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

import pytest
from sqlmodel import select

from metald.bmc.service import BmcCommandFailed, BmcService
from metald.config import BmcConfig
from metald.errors import Conflict, NotFound, Unprocessable
from metald.machines import create_machine
from metald.secrets import SecretBox
from metald.store.db import Store
from metald.store.models import Bmc, Event, Machine
from tests.bmc.peers import PASSWORD, IpmiSim, Sushy, free_port
from tests.conftest import LAB_BMC_NETWORKS


@pytest.fixture
async def svc(store: Store, tmp_path: Path):
    key = tmp_path / "state" / "secrets.key"
    box = SecretBox.from_file(key)
    assert key.stat().st_mode & 0o777 == 0o600
    cfg = BmcConfig(
        networks=LAB_BMC_NETWORKS,
        min_interval_ms=0,
        timeout_s=3,
        retries=1,
        backoff_base_ms=20,
        power_sync_interval_s=0,
        verify_s=2,
    )
    service = BmcService(store, box, cfg, instance="test")
    yield service
    await service.stop()


async def _machine(store: Store, mac: str, **cols: str) -> str:
    def do(s):
        m = create_machine(s, macs=[mac], actor="test", commit=False)
        for k, v in cols.items():
            setattr(m, k, v)
        s.add(m)
        s.commit()
        return m.id

    return await store.run(do)


async def _events(store: Store, kind: str) -> list[Event]:
    return await store.run(lambda s: list(s.exec(select(Event).where(Event.kind == kind)).all()))


async def test_register_links_by_system_uuid_and_stores_no_plaintext(
    svc: BmcService, store: Store, ipmi_sim: IpmiSim
) -> None:
    mid = await _machine(store, "52:54:00:00:00:01", system_uuid=ipmi_sim.system_uuid.upper())
    bmc = await svc.register(
        "127.0.0.1", ipmi_sim.port, "ipmi", "admin", ipmi_sim.password, actor="tech"
    )
    assert bmc["machine_id"] == mid and bmc["protocol"] == "ipmi" and bmc["health"] == "ok"
    assert "password" not in str(bmc) and "password_enc" not in bmc
    row = await store.run(lambda s: s.get(Bmc, bmc["id"]))
    assert ipmi_sim.password.encode() not in row.password_enc
    assert svc.secrets.decrypt(row.password_enc) == ipmi_sim.password
    ev = await _events(store, "bmc.registered")
    assert ev[0].actor == "tech" and ev[0].data["linked"] == "system-uuid"
    assert await svc.list() == [await svc.get(bmc["id"])]


async def test_auto_falls_back_to_ipmi(svc: BmcService, ipmi_sim: IpmiSim) -> None:
    bmc = await svc.register("127.0.0.1", ipmi_sim.port, "auto", "admin", ipmi_sim.password)
    assert bmc["protocol"] == "ipmi" and bmc["machine_id"] is None


async def test_auto_finds_redfish_and_links_by_mac(
    svc: BmcService, store: Store, sushy: Sushy
) -> None:
    mid = await _machine(store, sushy.mac.upper())
    bmc = await svc.register("http://127.0.0.1", sushy.port, "auto", "admin", "unused")
    assert bmc["protocol"] == "redfish" and bmc["machine_id"] == mid
    assert bmc["system_uuid"] == sushy.system_uuid
    await svc.power(mid, "on", actor="tech")
    assert (await svc.power(mid, "status"))["power_state"] == "on"
    sensors = await svc.sensors(mid)
    assert any(s["kind"] == "temperature" for s in sensors)
    with pytest.raises(Unprocessable, match="log service"):
        await svc.event_log(mid)
    assert await svc.event_log_stamp(mid) is None  # Redfish: the full read says


async def test_refused_credentials_store_nothing(svc: BmcService, sushy_auth: Sushy) -> None:
    with pytest.raises(Unprocessable, match="the login step did not succeed"):
        await svc.register("http://127.0.0.1", sushy_auth.port, "redfish", "admin", "wrong")
    assert await svc.list() == []


async def test_unreachable_and_duplicate_and_bad_input(svc: BmcService, ipmi_sim: IpmiSim) -> None:
    with pytest.raises(Unprocessable, match="could not verify the BMC"):
        await svc.register("127.0.0.1", free_port(), "ipmi", "admin", "x")
    with pytest.raises(Unprocessable, match="protocol"):
        await svc.register("127.0.0.1", 623, "snmp", "admin", "x")
    await svc.register("127.0.0.1", ipmi_sim.port, "ipmi", "admin", ipmi_sim.password)
    with pytest.raises(Conflict, match="already registered"):
        await svc.register("127.0.0.1", ipmi_sim.port, "ipmi", "admin", ipmi_sim.password)


async def test_power_and_boot_device_through_the_machine(
    svc: BmcService, store: Store, ipmi_sim: IpmiSim
) -> None:
    mid = await _machine(store, "52:54:00:00:00:02")
    with pytest.raises(NotFound, match="has no BMC"):
        await svc.power(mid, "on")
    bmc = await svc.register("127.0.0.1", ipmi_sim.port, "ipmi", "admin", ipmi_sim.password)
    await svc.link(bmc["id"], mid, actor="tech")
    other = await _machine(store, "52:54:00:00:00:03")
    with pytest.raises(Conflict):
        await svc.register("127.0.0.1", free_port(), "ipmi", "admin", "x", machine_id=mid)
    assert (await svc.power(mid, "on", actor="tech"))["power_state"] == "on"
    await svc.set_boot_device(mid, "pxe", persistent=False, uefi=True, actor="tech")
    with pytest.raises(Unprocessable, match="unknown power action"):
        await svc.power(mid, "explode")
    with pytest.raises(Unprocessable, match="pxe or disk"):
        await svc.set_boot_device(mid, "floppy")
    assert "set power 1" in ipmi_sim.calls() and "set boot pxe" in ipmi_sim.calls()
    m = await store.run(lambda s: s.get(Machine, mid))
    assert m.power_state == "on"
    power_ev = await _events(store, "bmc.power")
    assert [(e.machine_id, e.actor, e.data["action"]) for e in power_ev] == [(mid, "tech", "on")]
    assert (await _events(store, "bmc.boot-device"))[0].data["device"] == "pxe"
    sensors = await svc.sensors(mid)
    assert any(s["name"] == "CPU Temp" for s in sensors)
    assert len(await svc.event_log(mid)) == 1
    # Get SEL Info through the fenced executor: one entry, as the full read says.
    stamp = await svc.event_log_stamp(mid)
    assert stamp is not None and stamp.startswith("ipmi-sel:1:")
    await svc.link(bmc["id"], other)
    assert (await svc.get(bmc["id"]))["machine_id"] == other


async def test_power_sync_reports_drift_not_our_own_commands(
    store: Store, tmp_path: Path, ipmi_sim: IpmiSim
) -> None:
    cfg = BmcConfig(
        networks=LAB_BMC_NETWORKS,
        min_interval_ms=0,
        timeout_s=3,
        retries=1,
        power_sync_interval_s=0.2,
    )
    svc = BmcService(store, SecretBox.from_file(tmp_path / "k"), cfg, instance="test")
    mid = await _machine(store, "52:54:00:00:00:04")
    await svc.register(
        "127.0.0.1", ipmi_sim.port, "ipmi", "admin", ipmi_sim.password, machine_id=mid
    )
    await svc.start()
    try:
        await svc.power(mid, "on")  # ours: never drift
        await asyncio.sleep(0.5)
        assert await _events(store, "bmc.power-drift") == []
        await asyncio.to_thread(ipmi_sim.ipmitool, "power", "off")  # behind metald's back
        svc.control.expected.clear()  # the grace period of our own command is over
        # A deadline, not a count: on a loaded box one sync pass (an IPMI session to ipmi_sim)
        # can take seconds; 5 s of polling once failed here at load 10.
        deadline = asyncio.get_running_loop().time() + 30
        while not (drift := await _events(store, "bmc.power-drift")):
            if asyncio.get_running_loop().time() > deadline:
                break
            await asyncio.sleep(0.1)
    finally:
        await svc.stop()
    assert len(drift) == 1
    assert (drift[0].machine_id, drift[0].from_state, drift[0].to_state) == (mid, "on", "off")
    assert drift[0].actor == "metald:test"


async def test_unreachable_bmc_health_is_persisted_with_a_reason(
    svc: BmcService, store: Store, fault_bmc
) -> None:
    peer = fault_bmc("ok")
    mid = await _machine(store, "52:54:00:00:00:05")
    bmc = await svc.register("127.0.0.1", peer.port, "ipmi", "admin", PASSWORD, machine_id=mid)
    peer.stop()
    with pytest.raises(BmcCommandFailed, match="check the BMC's network") as ei:
        await svc.power(mid, "status")
    assert ei.value.status == 502
    got = await svc.get(bmc["id"])
    assert got["health"] == "unreachable" and got["health_detail"]


async def test_the_password_never_reaches_logs_events_or_answers(
    svc: BmcService,
    store: Store,
    ipmi_sim: IpmiSim,
    sushy_auth: Sushy,
    fault_bmc,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)  # every logger, pyghmi's and aiohttp's included
    asyncio.get_running_loop().set_debug(True)
    seen: list[str] = []
    mid = await _machine(store, "52:54:00:00:00:06")
    seen.append(
        str(
            await svc.register(
                "127.0.0.1", ipmi_sim.port, "ipmi", "admin", ipmi_sim.password, machine_id=mid
            )
        )
    )
    seen.append(str(await svc.power(mid, "on", actor="tech")))
    seen.append(str(await svc.sensors(mid)))
    for wrong in ("Wr0ng-Secret-1", "Wr0ng-Secret-2"):
        with pytest.raises(Unprocessable) as ei:
            await svc.register("http://127.0.0.1", sushy_auth.port, "auto", "admin", wrong)
        seen += [str(ei.value), repr(ei.value), str(ei.value.extra)]
    seen.append(
        str(
            await svc.register(
                "http://127.0.0.1", sushy_auth.port, "redfish", "admin", sushy_auth.password
            )
        )
    )
    # Stored credentials that the BMC stops accepting: auth-failed on a command.
    peer = fault_bmc("ok", password="Old-Secret-9")
    m2 = await _machine(store, "52:54:00:00:00:07")
    await svc.register("127.0.0.1", peer.port, "ipmi", "admin", "Old-Secret-9", machine_id=m2)
    peer.stop()
    port = peer.port
    replacement = _restart_with_password(fault_bmc, port, "New-Secret-8")
    with pytest.raises(BmcCommandFailed, match="credentials") as ei2:
        await svc.power(m2, "on")
    assert (await svc.get(ei2.value.extra["bmc_id"]))["health"] == "auth-failed"
    seen += [str(ei2.value), str(ei2.value.extra), str(await svc.list())]
    replacement.stop()
    events = await store.run(lambda s: list(s.exec(select(Event)).all()))
    seen += [repr(e) for e in events]
    text = caplog.text + "\n".join(seen)
    assert caplog.records, "debug logging captured nothing: the test would prove nothing"
    for secret in (
        ipmi_sim.password,
        sushy_auth.password,
        "Wr0ng-Secret-1",
        "Wr0ng-Secret-2",
        "Old-Secret-9",
        "New-Secret-8",
    ):
        assert secret not in text


def _restart_with_password(fault_bmc, port: int, password: str):
    """A new BMC process on the old port with another password (the BMC's password changed)."""
    from tests.bmc import peers

    original = peers.free_port
    peers.free_port = lambda *a: port
    try:
        return fault_bmc("ok", password=password)
    finally:
        peers.free_port = original


def test_key_file_is_created_private(tmp_path: Path) -> None:
    path = tmp_path / "new" / "secrets.key"
    SecretBox.from_file(path)
    assert path.stat().st_mode & 0o777 == 0o600
    os.chmod(path, 0o644)
    with pytest.raises(Exception, match="chmod 600"):
        SecretBox.from_file(path)
