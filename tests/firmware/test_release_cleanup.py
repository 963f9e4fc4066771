"""Release leaves nothing behind (issue 27, item 4), against the lab Redfish BMC in front of a
real QEMU: a tenant changes a BIOS setting and adds a BMC account during its claim; after the
release the BIOS is back to the profile and only metald's (and the operator's) accounts
remain, with an event saying so; firmware a tenant changed is flashed back to the baseline
before the wipe, or, with no image to restore it from, the machine is held in the repair
queue with the evidence."""

from __future__ import annotations

from typing import Any

import aiohttp
from sqlmodel import select

from metald.store.models import Event, Machine, Repair
from tests.bmc.peers import LabRedfish
from tests.firmware.lab import Env, _image, _prepare
from vmlab.redfish_accounts import ACCOUNT_STATE
from vmlab.redfish_bios import BIOS
from vmlab.redfish_update import UPDATES, make_image

PROFILE = {"SriovGlobalEnable": "Enabled", "LogicalProc": "Disabled"}


async def _tenant(peer: LabRedfish) -> None:
    """What a tenant with root does in band: a BIOS setting of its own (applied at its next
    reboot) and a BMC account of its own."""
    auth = {"Authorization": aiohttp.encode_basic_auth(peer.username, peer.password)}
    base = f"http://127.0.0.1:{peer.port}/redfish/v1"
    async with aiohttp.ClientSession(headers=auth) as http:
        r = await http.patch(
            f"{base}/Systems/m0/Bios/Settings",
            json={"Attributes": {"SriovGlobalEnable": "Disabled"}},
        )
        assert r.status == 204
        r = await http.post(
            f"{base}/Systems/m0/Actions/ComputerSystem.Reset", json={"ResetType": "ForceRestart"}
        )
        assert r.status == 204
        body = {"UserName": "backdoor", "Password": "tenant-pass-1", "RoleId": "Administrator"}
        r = await http.post(f"{base}/AccountService/Accounts", json=body)
        assert r.status == 201, await r.text()
    # The tenant's account works on the BMC.
    tenant = {"Authorization": aiohttp.encode_basic_auth("backdoor", "tenant-pass-1")}
    async with aiohttp.ClientSession(headers=tenant) as http:
        r = await http.get(f"{base}/Systems/m0")
        assert r.status == 200


async def _set_profile(e: Env, mid: str) -> None:
    r = await e.client.put(
        f"/api/v1/machines/{mid}/bios",
        json={"attributes": PROFILE},
        headers=e.tokens.header("technician"),
    )
    assert r.status == 200, await r.text()


async def test_bios_and_accounts_restored_at_release(env: Env, lab_redfish: LabRedfish) -> None:
    e = env
    mid = await _prepare(e, lab_redfish, [{"id": "BIOS", "version": "2022.11"}])
    e.cfg.firmware.keep_accounts = ["operator"]
    accounts = lab_redfish.app[ACCOUNT_STATE]
    from vmlab.redfish_accounts import Account

    accounts.by_id["9"] = Account("9", "operator", "operator-pass")
    await _set_profile(e, mid)
    lab_redfish.app[BIOS].reboot()  # the profile applied (as commissioning's reboot does)
    assert lab_redfish.app[BIOS].current["SriovGlobalEnable"] == "Enabled"
    await _tenant(lab_redfish)
    assert lab_redfish.app[BIOS].current["SriovGlobalEnable"] == "Disabled"

    held = await e.fw.after_release([mid], "claim-1", "test")
    assert held == []
    assert sorted(a.user for a in accounts.by_id.values()) == ["admin", "operator"]
    bios = lab_redfish.app[BIOS]
    assert bios.pending == {"SriovGlobalEnable": "Enabled"}  # staged: the wipe's reboot applies it
    bios.reboot()
    assert {k: bios.current[k] for k in PROFILE} == PROFILE
    with e.store.session() as s:
        [ev] = s.exec(select(Event).where(Event.kind == "release.restored")).all()
        m = s.get(Machine, mid)
    assert ev.data["claim_id"] == "claim-1" and ev.data["accounts_removed"] == ["backdoor"]
    assert ev.data["bios_restored"] == {"SriovGlobalEnable": "Enabled"}
    assert "BMC accounts removed: backdoor" in (ev.reason or "")
    assert "BIOS settings restored: SriovGlobalEnable='Enabled'" in (ev.reason or "")
    assert m is not None and m.state == "maintenance"  # not held


async def test_firmware_changed_without_an_image_is_held_in_repair(
    env: Env, lab_redfish: LabRedfish
) -> None:
    e = env
    mid = await _prepare(e, lab_redfish, [{"id": "BIOS", "version": "2022.11"}])
    # The tenant flashed the NIC's ROM in band; the baseline has nothing to restore it from.
    state = lab_redfish.app[UPDATES]
    name, _ = state.versions["NIC.1"]
    state.versions["NIC.1"] = (name, "9.9.9-tenant")
    held = await e.fw.after_release([mid], "claim-2", "test")
    assert held == [mid]
    with e.store.session() as s:
        m = s.get(Machine, mid)
        [ev] = s.exec(select(Event).where(Event.kind == "release.restored")).all()
        [ev_held] = s.exec(select(Event).where(Event.kind == "release.held")).all()
        [rep] = s.exec(select(Repair).where(Repair.machine_id == mid)).all()
    assert m is not None and m.state == "broken"
    assert m.last_error is not None and "NIC.1" in m.last_error
    assert ev.data["firmware_changed"] == {"NIC.1": {"before": "1.21.1", "after": "9.9.9-tenant"}}
    assert ev.data["reflash"] == [] and "no component for it" in ev.data["unrestorable"][0]
    assert rep.source == "release" and rep.status == "open"
    assert rep.faults[0]["subject"] == "NIC.1"
    assert "1.21.1 -> 9.9.9-tenant" in rep.faults[0]["evidence"]
    assert ev_held.data["claim_id"] == "claim-2" and ev_held.data["repair_id"] == rep.id
    assert state.flashed == []


async def test_firmware_changed_is_reflashed_before_the_wipe(
    env: Env, lab_redfish: LabRedfish
) -> None:
    """The baseline has an image for what the tenant changed: flashed back (once) while the
    machine is releasing, the version read back, the claim's events say so, not held."""
    e = env
    url, sha = _image(e, "nic.bin", make_image("NIC.1", "1.21.1"))
    nic = {"id": "NIC.1", "version": "1.21.1", "url": url, "sha256": sha, "apply": "host-reset"}
    mid = await _prepare(e, lab_redfish, [nic])
    with e.store.session() as s:  # released, before its wipe (as the claim workflow calls it)
        m = s.get(Machine, mid)
        assert m is not None
        m.state = "releasing"
        s.add(m)
        s.commit()
    state = lab_redfish.app[UPDATES]
    name, _ = state.versions["NIC.1"]
    state.versions["NIC.1"] = (name, "9.9.9-tenant")
    held = await e.fw.after_release([mid], "claim-4", "test")
    assert held == []
    assert state.flashed == [("NIC.1", "1.21.1")]
    with e.store.session() as s:
        m = s.get(Machine, mid)
        [ev] = s.exec(select(Event).where(Event.kind == "release.restored")).all()
        [done] = s.exec(select(Event).where(Event.kind == "release.reflashed")).all()
        repairs = s.exec(select(Repair).where(Repair.machine_id == mid)).all()
    assert ev.data["reflash"] == ["NIC.1"] and ev.data["unrestorable"] == []
    assert "re-flashing to the baseline before the wipe: NIC.1" in (ev.reason or "")
    assert done.data["claim_id"] == "claim-4"
    assert done.data["restored"] == {"NIC.1": {"before": "9.9.9-tenant", "after": "1.21.1"}}
    assert m is not None and m.state == "releasing" and repairs == []
    assert (m.firmware_versions or {})["NIC.1"] == "1.21.1"


async def test_ipmi_machines_are_left_as_they_are(env: Env, store: Any) -> None:
    e = env
    from metald.store.models import Bmc

    with store.session() as s:
        s.add(
            Bmc(
                machine_id=e.tokens.machine_b,
                address="127.0.0.1",
                port=9,
                protocol="ipmi",
                username="u",
                password_enc=b"x",
            )
        )
        s.commit()
    assert await e.fw.after_release([e.tokens.machine_b, e.tokens.machine_a], None, "test") == []
    with store.session() as s:
        evs = s.exec(select(Event).where(Event.kind == "release.restored")).all()
    assert [ev.data["skipped"] for ev in evs] == [
        "its BMC speaks ipmi, which cannot restore BIOS or accounts"
    ]


async def test_a_bmc_without_bios_or_accounts_is_not_held(env: Env, sushy: Any) -> None:
    """sushy-emulator's fake driver has no BIOS and no firmware inventory: said in the event,
    and the machine is wiped as usual (only a BMC that fails, or changed firmware, holds it)."""
    e, t = env, env.tokens
    body = {"address": "http://127.0.0.1", "port": sushy.port, "protocol": "redfish",
            "username": "admin", "password": "unused-pass", "machine_id": t.machine_free}  # fmt: skip
    r = await e.client.post("/api/v1/bmcs", json=body, headers=t.header("technician"))
    assert r.status == 201, await r.text()
    with e.store.session() as s:
        m = s.get(Machine, t.machine_free)
        assert m is not None
        m.bios = {"desired": {"SriovGlobalEnable": "Enabled"}}
        s.add(m)
        s.commit()
    assert await e.fw.after_release([t.machine_free], "claim-3", "test") == []
    with e.store.session() as s:
        [ev] = s.exec(select(Event).where(Event.kind == "release.restored")).all()
    assert ev.data["errors"] == [] and ev.data["not_offered"], ev.data
