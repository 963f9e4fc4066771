"""Firmware updates over the API through the lab Redfish BMC in front of a real QEMU (issue
27, item 2): the image verified before it is offered, SimpleUpdate from metald's image route
or a multipart push, progress from the BMC's task, the host power-cycled only after the flash
(power refused meanwhile), the version read back; a crash mid-flash resumed from the task
without a second flash; IPMI BMCs and bad checksums refused with a sentence."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from sqlmodel import select

from metald.bmc.service import BmcService
from metald.secrets import SecretBox
from metald.store import Store
from metald.store.models import Event, FirmwareUpdate, Machine
from tests.bmc.peers import LabRedfish
from tests.firmware.lab import Env, _image, _prepare, _service
from vmlab.redfish_update import UPDATES, make_image


async def _updates(e: Env, mid: str) -> list[dict[str, Any]]:
    r = await e.client.get(
        f"/api/v1/machines/{mid}/firmware/updates", headers=e.tokens.header("technician")
    )
    assert r.status == 200, await r.text()
    items: list[dict[str, Any]] = (await r.json())["items"]
    return items


async def _wait(e: Env, mid: str, pred: Any, limit_s: float = 30) -> list[dict[str, Any]]:
    end = time.monotonic() + limit_s
    while True:
        got = await _updates(e, mid)
        if pred(got):
            return got
        assert time.monotonic() < end, got
        await asyncio.sleep(0.05)


def _ended(items: list[dict[str, Any]]) -> bool:
    return bool(items) and all(i["phase"] in ("done", "failed") for i in items)


async def test_bios_update_end_to_end(env: Env, lab_redfish: LabRedfish) -> None:
    e, t = env, env.tokens
    state = lab_redfish.app[UPDATES]
    state.flash_s = 2.0
    url, sha = _image(e, "bios.bin", make_image("BIOS", "2023.05"))
    mid = await _prepare(
        e,
        lab_redfish,
        [{"id": "BIOS", "version": "2023.05", "url": url, "sha256": sha, "apply": "host-reset"}],
    )
    r = await e.client.get("/api/v1/firmware/compliance", headers=t.header("technician"))
    assert [i["machine_id"] for i in (await r.json())["items"]] == [mid]
    r = await e.client.post(
        f"/api/v1/machines/{mid}/firmware/update", json={}, headers=t.header("technician")
    )
    assert r.status == 202, await r.text()
    [u] = (await r.json())["items"]
    assert (u["item"], u["version_before"], u["version"], u["phase"]) == (
        "BIOS",
        "2022.11",
        "2023.05",
        "queued",
    )
    # A second request while one runs is refused.
    r = await e.client.post(
        f"/api/v1/machines/{mid}/firmware/update", json={}, headers=t.header("technician")
    )
    assert r.status == 409
    # The machine stays out of the pool while its update runs.
    r = await e.client.post(
        f"/api/v1/machines/{mid}/actions",
        json={"action": "maintenance-off"},
        headers=t.header("technician"),
    )
    assert r.status == 409 and "firmware update under way" in (await r.json())["detail"]
    # Nor can its BMC be removed mid-update.
    r = await e.client.delete(f"/api/v1/bmcs/{u['bmc_id']}", headers=t.header("admin"))
    assert r.status == 409 and "middle of a firmware update" in (await r.json())["detail"]
    # While the BMC flashes, no power command reaches the host.
    await _wait(e, mid, lambda items: items[0]["phase"] == "flashing")
    r = await e.client.post(
        f"/api/v1/machines/{mid}/power", json={"action": "off"}, headers=t.header("technician")
    )
    assert r.status == 409 and "flashing firmware" in (await r.json())["detail"], await r.text()
    [done] = await _wait(e, mid, _ended)
    assert done["phase"] == "done", done
    assert done["transfer"] == "simple-update" and done["percent"] == 100
    steps = [j["step"] for j in done["journal"]]
    assert steps[:3] == ["queued", "offering", "flashing"] and steps[-2:] == ["verifying", "done"]
    assert state.flashed == [("BIOS", "2023.05")]
    with e.store.session() as s:
        m = s.get(Machine, mid)
        assert m is not None and m.firmware_versions["BIOS"] == "2023.05"
        kinds = [ev.kind for ev in s.exec(select(Event).where(Event.machine_id == mid))]
        assert "firmware.update-requested" in kinds and kinds.count("firmware.updated") == 1
    # Powered on to apply it, and off again as it was.
    r = await e.client.get(f"/api/v1/machines/{mid}/power", headers=t.header("technician"))
    assert (await r.json())["power_state"] == "off"
    r = await e.client.get("/api/v1/firmware/compliance", headers=t.header("technician"))
    assert (await r.json())["items"] == []
    r = await e.client.post(
        f"/api/v1/machines/{mid}/firmware/update", json={}, headers=t.header("technician")
    )
    assert r.status == 409 and "nothing to update" in (await r.json())["detail"]


async def test_crash_mid_flash_resumes_from_the_task(env: Env, lab_redfish: LabRedfish) -> None:
    e, t = env, env.tokens
    state = lab_redfish.app[UPDATES]
    state.flash_s = 2.0
    url, sha = _image(e, "bmc.bin", make_image("BMC", "1.5.0"))
    mid = await _prepare(
        e,
        lab_redfish,
        [{"id": "BMC", "version": "1.5.0", "url": url, "sha256": sha, "apply": "bmc-reset"}],
    )
    e.fw.boot_url = None  # no boot listener: the image is pushed (multipart)
    r = await e.client.post(
        f"/api/v1/machines/{mid}/firmware/update",
        json={"components": ["BMC"]},
        headers=t.header("technician"),
    )
    assert r.status == 202
    await _wait(e, mid, lambda items: items[0]["phase"] == "flashing" and items[0]["task_uri"])
    await e.fw.stop()  # the owner dies mid-flash (its tasks cancelled, nothing more written)
    assert (await _updates(e, mid))[0]["phase"] == "flashing"
    # The survivor: a fresh service (and executor) over the same store resumes it.
    survivor_bmc = BmcService(
        e.store, SecretBox.from_file(e.cfg.secrets_key_path), e.cfg.bmc, "other"
    )
    survivor = _service(e.store, survivor_bmc, e.images, e.cfg, None)
    try:
        await survivor.start()
        assert mid in survivor.running
        end = time.monotonic() + 30
        while True:
            with e.store.session() as s:
                u = s.exec(select(FirmwareUpdate).where(FirmwareUpdate.machine_id == mid)).one()
            if u.phase in ("done", "failed"):
                break
            assert time.monotonic() < end
            await asyncio.sleep(0.05)
        assert u.phase == "done", u.error
        assert state.flashed == [("BMC", "1.5.0")]  # flashed once, by the first owner
        assert u.transfer == "multipart"
    finally:
        await survivor.stop()
        await survivor_bmc.stop()


async def test_refusals(env: Env, lab_redfish: LabRedfish, store: Store) -> None:
    e, t = env, env.tokens
    state = lab_redfish.app[UPDATES]
    url, _ = _image(e, "nic.bin", make_image("NIC.1", "1.22.0"))
    mid = await _prepare(
        e, lab_redfish, [{"id": "NIC.1", "version": "1.22.0", "url": url, "sha256": "0" * 64}]
    )
    # Orchestrators and agents cannot start updates.
    for role in ("orchestrator", "agent"):
        r = await e.client.post(
            f"/api/v1/machines/{mid}/firmware/update", json={}, headers=t.header(role)
        )
        assert r.status in (403, 404), role
    # A wrong checksum: refused before anything is offered to the BMC.
    r = await e.client.post(
        f"/api/v1/machines/{mid}/firmware/update", json={}, headers=t.header("technician")
    )
    assert r.status == 202
    [u] = await _wait(e, mid, _ended)
    assert u["phase"] == "failed" and "not the baseline's" in u["error"] and state.tasks == {}
    assert list(e.images.root.glob("*.bin")) == []  # nothing kept either
    # Not in maintenance: refused with what to do.
    r = await e.client.post(
        f"/api/v1/machines/{t.machine_a}/firmware/update", json={}, headers=t.header("technician")
    )
    assert r.status in (404, 409, 422)
    # An IPMI BMC: refused with a sentence.
    with store.session() as s:
        from metald.store.models import Bmc

        s.add(
            Bmc(
                machine_id=t.machine_b,
                address="127.0.0.1",
                port=9,
                protocol="ipmi",
                username="u",
                password_enc=b"x",
            )
        )
        s.commit()
    r = await e.client.post(
        f"/api/v1/machines/{t.machine_b}/firmware/update", json={}, headers=t.header("technician")
    )
    assert (
        r.status == 422
        and "IPMI has no standard way to update firmware" in (await r.json())["detail"]
    )


async def test_injected_bmc_reboot_and_stalled_flash_through_the_service(
    env: Env, lab_redfish: LabRedfish
) -> None:
    """The lab BMC's injected failures, through metald's updates (the driver's side is
    tests/firmware/test_redfish_update.py; the checksum failure through a rollout is
    tests/firmware/test_rollouts.py): a BMC that restarts mid-flash (503 for a while) is
    waited for and the update ends done with one flash; a flash that stalls is given up after
    ``flash_timeout_s`` with a sentence, and power commands are allowed again."""
    e, t = env, env.tokens
    state = lab_redfish.app[UPDATES]
    url, sha = _image(e, "nic.bin", make_image("NIC.1", "1.22.0"))
    nic = {"id": "NIC.1", "version": "1.22.0", "url": url, "sha256": sha, "apply": "host-reset"}
    mid = await _prepare(e, lab_redfish, [nic])
    state.faults.add("bmc-reboot")
    r = await e.client.post(
        f"/api/v1/machines/{mid}/firmware/update", json={}, headers=t.header("technician")
    )
    assert r.status == 202, await r.text()
    [done] = await _wait(e, mid, _ended, limit_s=60)
    assert done["phase"] == "done", done
    assert state.flashed == [("NIC.1", "1.22.0")] and "bmc-reboot" not in state.faults

    # A flash that stalls at 40 %: failed after flash_timeout_s, power allowed again.
    e.cfg.firmware.flash_timeout_s = 2
    url, sha = _image(e, "nic2.bin", make_image("NIC.1", "1.23.0"))
    r = await e.client.put(
        "/api/v1/firmware/baselines/h100-8x",
        json={"components": [{**nic, "version": "1.23.0", "url": url, "sha256": sha}]},
        headers=t.header("admin"),
    )
    assert r.status == 200, await r.text()
    state.faults.add("timeout")
    r = await e.client.post(
        f"/api/v1/machines/{mid}/firmware/update", json={}, headers=t.header("technician")
    )
    assert r.status == 202, await r.text()
    items = await _wait(e, mid, lambda its: its[0]["phase"] in ("done", "failed"), limit_s=60)
    failed = items[0]
    assert failed["phase"] == "failed" and failed["version"] == "1.23.0", failed
    assert failed["percent"] == 40 and failed["error"], failed
    assert state.flashed == [("NIC.1", "1.22.0"), ("NIC.1", "1.23.0")]  # never offered twice
    r = await e.client.post(
        f"/api/v1/machines/{mid}/power", json={"action": "off"}, headers=t.header("technician")
    )
    assert r.status != 409, await r.text()
    with e.store.session() as s:
        kinds = [ev.kind for ev in s.exec(select(Event).where(Event.machine_id == mid))]
    assert kinds.count("firmware.updated") == 1 and kinds.count("firmware.update-failed") == 1
