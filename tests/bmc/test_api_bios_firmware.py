"""Firmware inventory and BIOS settings over the API (issue 16, items 4 and 5), against the
lab's Redfish BMC in front of a real QEMU (sushy's fake driver offers neither)."""

from __future__ import annotations

from sqlmodel import select

from metald.claims.allocation import Selector
from metald.inventory.rules import EnrollmentRule, bios_profile
from metald.store import Store
from metald.store.models import Event, Machine
from tests.api_helpers import link_redfish
from tests.bmc.peers import LabRedfish
from vmlab.redfish_bios import BIOS


async def _link(client, tokens, peer: LabRedfish) -> str:  # type: ignore[no-untyped-def]
    """The lab Redfish BMC registered with its own credentials, linked to the free machine."""
    return await link_redfish(
        client, tokens, peer.port, username=peer.username, password=peer.password
    )


async def _events(store: Store, kind: str) -> list[Event]:
    return await store.run(lambda s: list(s.exec(select(Event).where(Event.kind == kind)).all()))


async def test_firmware_recorded_shown_and_selectable(bmc_api, store: Store, lab_redfish) -> None:  # type: ignore[no-untyped-def]
    client, tokens, _ = bmc_api
    tech = tokens.header("technician")
    mid = await _link(client, tokens, lab_redfish)
    r = await client.get(f"/api/v1/machines/{mid}/firmware", headers=tech)
    assert r.status == 200, await r.text()
    items = {i["id"]: i["version"] for i in (await r.json())["items"]}
    assert items == {"BMC": "1.4.0", "BIOS": "2022.11", "NIC.1": "1.21.1"}
    r = await client.get(f"/api/v1/machines/{mid}", headers=tech)
    assert (await r.json())["firmware_versions"] == items
    assert len(await _events(store, "bmc.firmware")) == 1
    # Reading again with nothing changed records no new event.
    await client.get(f"/api/v1/machines/{mid}/firmware", headers=tech)
    assert len(await _events(store, "bmc.firmware")) == 1

    m = await store.run(lambda s: s.get(Machine, mid))
    assert Selector(firmware={"BIOS": "2022.*"}).matches(m)
    assert Selector(firmware={"BIOS": "2022.11", "BMC": "1.4.0"}).matches(m)
    assert not Selector(firmware={"BIOS": "2023.*"}).matches(m)
    assert not Selector(firmware={"GPU.0": "*"}).matches(m)  # no such item: no match
    assert Selector.from_dict({"firmware": {"BIOS": "2022.*"}}).firmware == {"BIOS": "2022.*"}


async def test_bios_profile_staged_then_drift_reported(bmc_api, store: Store, lab_redfish) -> None:  # type: ignore[no-untyped-def]
    client, tokens, _ = bmc_api
    tech = tokens.header("technician")
    mid = await _link(client, tokens, lab_redfish)
    bios = lab_redfish.app[BIOS]

    want = {"SriovGlobalEnable": "Enabled", "LogicalProc": "Enabled"}
    r = await client.put(f"/api/v1/machines/{mid}/bios", json={"attributes": want}, headers=tech)
    assert r.status == 200, await r.text()
    out = await r.json()
    # Only what differs is staged; the BMC holds it pending until the next reboot.
    assert bios.pending == {"SriovGlobalEnable": "Enabled"}
    assert out["pending"] == {"SriovGlobalEnable": "Enabled"} and out["drift"] == {}
    (staged,) = await _events(store, "bmc.bios-staged")
    assert staged.data["attributes"] == {"SriovGlobalEnable": "Enabled"}

    r = await client.post(
        f"/api/v1/machines/{mid}/power", json={"action": "on"}, headers=tech
    )  # the reboot applies it
    assert r.status == 200, await r.text()
    r = await client.get(f"/api/v1/machines/{mid}/bios", headers=tech)
    out = await r.json()
    assert out["current"]["SriovGlobalEnable"] == "Enabled" and out["pending"] == {}
    assert out["drift"] == {} and not await _events(store, "bmc.bios-drift")

    # Someone turns SR-IOV off at the console: drift, in the record and as one event.
    bios.current["SriovGlobalEnable"] = "Disabled"
    for _ in range(2):
        r = await client.get(f"/api/v1/machines/{mid}/bios", headers=tech)
        assert (await r.json())["drift"] == {
            "SriovGlobalEnable": {"want": "Enabled", "have": "Disabled"}
        }
    (drift,) = await _events(store, "bmc.bios-drift")
    assert "SriovGlobalEnable='Disabled'" in drift.reason
    r = await client.get(f"/api/v1/machines/{mid}", headers=tech)
    assert (await r.json())["bios"]["drift"]["SriovGlobalEnable"]["want"] == "Enabled"

    # A value the BMC refuses: 422 with its reason, nothing staged.
    r = await client.put(
        f"/api/v1/machines/{mid}/bios", json={"attributes": {"SysProfile": "Turbo"}}, headers=tech
    )
    assert r.status == 422, await r.text()
    assert "not allowed" in (await r.json())["detail"]
    assert bios.pending == {}
    await client.post(f"/api/v1/machines/{mid}/power", json={"action": "off"}, headers=tech)


def test_enroll_rules_give_the_bios_profile() -> None:
    from metald.inventory.normalize import NormalizedInventory

    inv = NormalizedInventory.model_construct(gpu_count=8, gpu_model="NVIDIA H100 80GB HBM3")
    rules = [
        EnrollmentRule(bios={"SriovGlobalEnable": "Enabled", "LogicalProc": "Enabled"}),
        EnrollmentRule(match={"gpu_model": "NVIDIA H100*"}, bios={"LogicalProc": "Disabled"}),
        EnrollmentRule(match={"gpu_model": "AMD*"}, bios={"SysProfile": "Custom"}),
    ]
    assert bios_profile(rules, inv, None) == {
        "SriovGlobalEnable": "Enabled",
        "LogicalProc": "Disabled",
    }


async def test_inspection_records_firmware_and_stages_the_rules_profile(
    bmc_api, store: Store, lab_redfish
) -> None:  # type: ignore[no-untyped-def]
    """The whole path: an enroll rule's BIOS profile, an agent's inventory, then (in the
    background) the firmware versions recorded and the profile staged on the BMC."""
    import asyncio
    import uuid

    from api.app import CTX_KEY
    from metald.config import EnrollConfig
    from tests.test_enrollment import enrolled_via_hooks, payload

    client, tokens, _ = bmc_api
    client.server.app[CTX_KEY].cfg.enroll = EnrollConfig(
        rules=[EnrollmentRule(match={"gpu_model": "*H100*"}, bios={"SriovGlobalEnable": "Enabled"})]
    )
    _hooks, target = await enrolled_via_hooks(store)
    mid = target.machine_id
    body = {
        "address": "http://127.0.0.1",
        "port": lab_redfish.port,
        "protocol": "redfish",
        "username": lab_redfish.username,
        "password": lab_redfish.password,
        "machine_id": mid,
    }
    r = await client.post("/api/v1/bmcs", json=body, headers=tokens.header("technician"))
    assert r.status == 201, await r.text()
    agent = {"Authorization": f"Bearer {target.kernel_args['metald.token']}"}
    r = await client.post(
        "/api/v1/agent/inventory", json=payload(mid, boot_id=str(uuid.uuid4())), headers=agent
    )
    assert r.status == 200, await r.text()
    bios = lab_redfish.app[BIOS]
    async with asyncio.timeout(30):
        while True:
            m = await store.run(lambda s: s.get(Machine, mid))
            if m.firmware_versions and (m.bios or {}).get("pending") and m.secure_boot:
                break
            await asyncio.sleep(0.05)
    assert m.firmware_versions["BIOS"] == "2022.11"
    assert m.bios["desired"] == {"SriovGlobalEnable": "Enabled"}
    assert bios.pending == {"SriovGlobalEnable": "Enabled"}
    assert m.bios["drift"] == {}  # staged: applied at the next reboot, not drift
    # ... and its Secure Boot state read (the lab's UEFI BMC: off, vendor PK enrolled).
    assert (m.secure_boot["enabled"], m.secure_boot["mode"]) == (False, "UserMode")
