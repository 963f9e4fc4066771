"""Zero-touch enrollment through the API: boot hooks mint agent tokens, the agent's inventory
makes a machine ready, and bad posts (malformed, another machine's, replayed) change nothing."""

from __future__ import annotations

import copy
import json
import uuid

from sqlmodel import select

from api.app import CTX_KEY
from metald import machines
from metald.boot.hooks import BootAction
from metald.config import EnrollConfig
from metald.enrollment import enrollment_boot_hooks
from metald.inventory.rules import EnrollmentRule
from metald.store.models import Event, Machine, Nic
from vmlab import inventory
from vmlab.inventory import NVIDIA

MAC = "52:54:00:12:00:01"


def payload(machine_id: str | None, *, boot_id: str, sequence: int = 1, gpus: int = 8) -> dict:
    """A Dell XE9680 with ``gpus`` H100s and an NVSwitch, its PXE NIC ``MAC``."""
    nvswitch = {
        "address": "0000:05:00.0",
        "vendor": NVIDIA,
        "device": "0x22a3",
        "class": "0x068000",
    }
    return inventory.payload(
        agent_version="test",
        machine_id=machine_id,
        boot_id=boot_id,
        sequence=sequence,
        system={
            "vendor": "Dell Inc.",
            "product": "PowerEdge XE9680",
            "serial": "ABC1234",
            "uuid": "4c4c4544-0042-4310-8033-b4c04f303934",
        },
        memory={"meminfo_total_kb": 2113464000},
        disks=[
            {
                "name": "nvme0n1",
                "size_bytes": 3840755982336,
                "model": "Dell Ent NVMe",
                "rotational": False,
            }
        ],
        nics=[{"name": "eno1", "mac": MAC, "driver": "bnxt_en", "link": True, "speed_mbps": 25000}],
        pci=[*inventory.nvidia_gpus(range(0x18, 0x18 + gpus)), nvswitch],
    )


async def enrolled_via_hooks(store, instance="t"):  # type: ignore[no-untyped-def]
    hooks = enrollment_boot_hooks(store, instance, EnrollConfig())
    await hooks.client_seen(
        MAC,
        arch="bios",
        network="rack1",
        relay_agent={"remote_id": "leaf-r12", "circuit_id": "Eth1/7"},
    )
    target = await hooks.boot_target(MAC)
    return hooks, target


async def test_boot_hooks_enroll_and_mint_token(api) -> None:  # type: ignore[no-untyped-def]
    client, tokens, store = api
    _hooks, target = await enrolled_via_hooks(store)
    assert target.action is BootAction.DISCOVERY
    token = target.kernel_args["metald.token"]
    with store.session() as s:
        m = s.get(Machine, target.machine_id)
        assert (m.state, m.rack_position) == ("inspecting", "leaf-r12/Eth1/7")  # type: ignore[union-attr]
    agent = {"Authorization": f"Bearer {token}"}
    r = await client.get("/api/v1/agent/next", headers=agent)
    assert (await r.json())["action"] == "inspect"
    # An agent token reaches only its own machine.
    r = await client.get(f"/api/v1/machines/{tokens.machine_free}", headers=agent)
    assert r.status == 404


async def test_inventory_makes_machine_ready_with_rules(api) -> None:  # type: ignore[no-untyped-def]
    client, tokens, store = api
    ctx = client.server.app[CTX_KEY]
    ctx.cfg.enroll = EnrollConfig(
        rules=[
            EnrollmentRule(
                match={"gpu_model": "*H100*", "rack_position": "leaf-r12/*"},
                labels={"pool": "train"},
                rack="r12",
            )
        ]
    )
    _hooks, target = await enrolled_via_hooks(store)
    agent = {"Authorization": f"Bearer {target.kernel_args['metald.token']}"}
    boot = str(uuid.uuid4())
    r = await client.post(
        "/api/v1/agent/inventory", json=payload(target.machine_id, boot_id=boot), headers=agent
    )
    assert r.status == 200, await r.text()
    body = await r.json()
    assert body["state"] == "ready" and body["gpu_count"] == 8 and "H100" in body["gpu_model"]
    assert body["next"]["action"] == "poweroff"
    r = await client.get(
        f"/api/v1/machines/{target.machine_id}", headers=tokens.header("technician")
    )
    m = await r.json()
    assert (m["vendor"], m["serial"], m["cpu_count"], m["rack"], m["labels"]) == (
        "Dell Inc.",
        "ABC1234",
        224,
        "r12",
        {"pool": "train"},
    )
    r = await client.get(
        "/api/v1/machines?gpu_count=8&min_gpu_count=8&label=pool=train",
        headers=tokens.header("technician"),
    )
    assert [x["id"] for x in (await r.json())["items"]] == [target.machine_id]

    # Re-inspection with a GPU missing: inventory updated, and a diff event.
    r = await client.post(
        f"/api/v1/machines/{target.machine_id}/actions",
        json={"action": "inspect"},
        headers=tokens.header("technician"),
    )
    assert (await r.json())["state"] == "inspecting"
    target2 = await _hooks.boot_target(MAC)
    agent2 = {"Authorization": f"Bearer {target2.kernel_args['metald.token']}"}
    r = await client.post(
        "/api/v1/agent/inventory",
        json=payload(target.machine_id, boot_id=str(uuid.uuid4()), gpus=7),
        headers=agent2,
    )
    assert r.status == 200 and (await r.json())["gpu_count"] == 7
    with store.session() as s:
        ev = s.exec(
            select(Event).where(
                Event.kind == "inventory.changed", Event.machine_id == target.machine_id
            )
        ).one()
        assert "gpu_count: 8 -> 7" in ev.reason  # type: ignore[operator]
    # The first token was revoked when the second was minted.
    r = await client.get("/api/v1/agent/next", headers=agent)
    assert r.status == 401


async def test_bad_inventory_posts_are_refused_with_event(api) -> None:  # type: ignore[no-untyped-def]
    client, tokens, store = api
    _hooks, target = await enrolled_via_hooks(store)
    mid = target.machine_id
    agent = {"Authorization": f"Bearer {target.kernel_args['metald.token']}"}
    boot = str(uuid.uuid4())
    good = payload(mid, boot_id=boot)
    assert (await client.post("/api/v1/agent/inventory", json=good, headers=agent)).status == 200
    # Put it back to inspecting so only the checks under test can refuse.
    await client.post(
        f"/api/v1/machines/{mid}/actions",
        json={"action": "inspect"},
        headers=tokens.header("admin"),
    )
    target = await _hooks.boot_target(MAC)
    agent = {"Authorization": f"Bearer {target.kernel_args['metald.token']}"}
    with store.session() as s:
        stored = json.dumps(s.get(Machine, mid).inventory, sort_keys=True)  # type: ignore[union-attr]

    bad_type = copy.deepcopy(good) | {"sequence": 2}
    bad_type["cpu"]["logical"] = "many"
    unknown = copy.deepcopy(good) | {"sequence": 2, "extra": 1}
    cases = [
        (bad_type, 422, "cpu.logical"),
        (unknown, 422, "extra: unknown field"),
        (copy.deepcopy(good) | {"schema_version": 9}, 422, "schema_version"),
        (payload(tokens.machine_free, boot_id=boot, sequence=5), 403, "belongs to machine"),
        (good, 409, "replay"),  # same boot id and sequence as the accepted post
    ]
    for body, status, phrase in cases:
        r = await client.post("/api/v1/agent/inventory", json=body, headers=agent)
        assert r.status == status, (phrase, await r.text())
        assert phrase in (await r.json(content_type=None))["detail"]
    # Another machine's agent token cannot post for this machine either (that one is a
    # claimed machine's: its provision-phase token posts no inventory at all).
    r = await client.post(
        "/api/v1/agent/inventory",
        json=payload(mid, boot_id=str(uuid.uuid4())),
        headers=tokens.header("agent"),
    )
    assert r.status == 409 and "minted for the provision phase" in (await r.json())["detail"]
    with store.session() as s:
        m = s.get(Machine, mid)
        assert m.state == "inspecting" and json.dumps(m.inventory, sort_keys=True) == stored  # type: ignore[union-attr]
        refused = s.exec(
            select(Event).where(Event.kind == "inventory.refused", Event.machine_id == mid)
        ).all()
        assert len(refused) == 5
    # Non-agent roles cannot post inventory at all.
    r = await client.post("/api/v1/agent/inventory", json=good, headers=tokens.header("technician"))
    assert r.status == 403


async def test_dhcp_records_the_boot_firmware(store) -> None:  # type: ignore[no-untyped-def]
    """The firmware DHCP saw (option 93) is kept on the machine; a change is an event, an
    unknown architecture changes nothing."""

    hooks = enrollment_boot_hooks(store, "t", EnrollConfig())
    await hooks.client_seen(MAC, arch="bios", network="rack1", relay_agent=None)

    def read(s):  # type: ignore[no-untyped-def]
        m = machines.find_by_mac(s, MAC)
        kinds = [e.kind for e in s.exec(select(Event).where(Event.machine_id == m.id))]
        return m.firmware, kinds

    assert await store.run(read) == ("bios", ["machine.created"])
    await hooks.client_seen(MAC, arch="unknown", network="rack1", relay_agent=None)
    assert await store.run(read) == ("bios", ["machine.created"])
    await hooks.client_seen(MAC, arch="uefi-x64", network="rack1", relay_agent=None)
    assert await store.run(read) == ("uefi-x64", ["machine.created", "machine.firmware"])


async def test_inventory_syncs_the_machines_nics(api) -> None:  # type: ignore[no-untyped-def]
    """The PXE NIC gets its name, driver, speed and link; a NIC seen for the first time is
    added (not PXE); a MAC that belongs to another machine is left to that machine."""
    client, tokens, store = api
    _hooks, target = await enrolled_via_hooks(store)
    other = "52:54:00:00:00:03"  # seed()'s free machine's NIC
    body = payload(target.machine_id, boot_id=str(uuid.uuid4()))
    body["nics"] = [
        {"name": "eno1", "mac": MAC, "driver": "bnxt_en", "link": True, "speed_mbps": 25000},
        {"name": "ens2f0", "mac": "52:54:00:12:00:02", "driver": "mlx5_core", "link": False},
        {"name": "ens3", "mac": other, "driver": "igb", "link": True, "speed_mbps": 1000},
    ]
    r = await client.post(
        "/api/v1/agent/inventory",
        json=body,
        headers={"Authorization": f"Bearer {target.kernel_args['metald.token']}"},
    )
    assert r.status == 200, await r.text()
    with store.session() as s:
        rows = {n.mac: n for n in s.exec(select(Nic))}
    mine = rows[MAC]
    assert (mine.machine_id, mine.name, mine.driver, mine.speed_mbps, mine.link, mine.pxe) == (
        target.machine_id,
        "eno1",
        "bnxt_en",
        25000,
        True,
        True,
    )
    new = rows["52:54:00:12:00:02"]
    assert (new.machine_id, new.name, new.driver, new.speed_mbps, new.link, new.pxe) == (
        target.machine_id,
        "ens2f0",
        "mlx5_core",
        None,
        False,
        False,
    )
    theirs = rows[other]
    assert theirs.machine_id == tokens.machine_free and theirs.driver is None
