"""The Redfish driver's firmware updates against the lab Redfish BMC (vm-lab/vmlab/
redfish_update.py) in front of a real QEMU: SimpleUpdate (the BMC pulls the image), multipart
push, task progress, injected failures, and a version that changes only at the reset."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from metald.bmc.base import BmcEndpoint, BmcProtocolError, BmcUnsupported, PowerAction, UpdateTask
from metald.bmc.redfish import RedfishDriver
from tests.bmc.peers import LabRedfish, Sushy
from vmlab.redfish_update import UPDATES, make_image


def _driver(peer: LabRedfish) -> RedfishDriver:
    ep = BmcEndpoint("127.0.0.1", peer.port, peer.username, peer.password)
    return RedfishDriver(ep, scheme="http", request_timeout_s=5.0)


@pytest.fixture
async def images() -> AsyncIterator[tuple[str, dict[str, bytes]]]:
    """A loopback HTTP server the lab BMC fetches images from (metald's boot listener's part)."""
    files: dict[str, bytes] = {}

    async def get(request: web.Request) -> web.Response:
        data = files.get(request.match_info["name"])
        return web.Response(body=data) if data is not None else web.Response(status=404)

    app = web.Application()
    app.router.add_get("/fw/{name}", get)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}/fw", files
    finally:
        await runner.cleanup()


async def _until_done(d: RedfishDriver, task: UpdateTask, limit_s: float = 20) -> list[UpdateTask]:
    seen = [task]
    end = time.monotonic() + limit_s
    while not task.done:
        assert time.monotonic() < end, f"task still {task.state} at {task.percent}%"
        await asyncio.sleep(0.1)
        try:
            task = await d.update_task(task.uri)
        except BmcProtocolError:
            continue  # the BMC restarting answers 503 meanwhile
        seen.append(task)
    return seen


async def _versions(d: RedfishDriver) -> dict[str, str | None]:
    return {i.id: i.version for i in await d.firmware_inventory()}


async def test_simple_update_then_applied_at_the_reset(
    lab_redfish: LabRedfish, images: Any
) -> None:
    base, files = images
    files["bios.bin"] = make_image("BIOS", "2023.05")
    d = _driver(lab_redfish)
    try:
        assert await d.update_methods() == {"simple-update", "multipart"}
        task = await d.simple_update(f"{base}/bios.bin", "BIOS")
        seen = await _until_done(d, task)
        assert seen[-1].ok and seen[-1].percent == 100, seen[-1]
        assert any(t.percent is not None and 0 < t.percent < 100 for t in seen)
        assert "system's next reset" in seen[-1].messages[-1]
        assert (await _versions(d))["BIOS"] == "2022.11"  # written, not yet running
        await d.set_power(PowerAction.ON)
        assert (await _versions(d))["BIOS"] == "2023.05"
        await d.set_power(PowerAction.OFF)
        # The task is found again by what its request carried (how a survivor resumes).
        again = await d.find_update_task(f"{base}/bios.bin")
        assert again is not None and again.uri == task.uri and again.ok
        assert await d.find_update_task("no-such-marker") is None
    finally:
        await d.close()


async def test_multipart_push_and_bmc_reset(lab_redfish: LabRedfish) -> None:
    d = _driver(lab_redfish)
    try:
        task = await d.push_update(make_image("BMC", "1.5.0"), "BMC", "upd-42")
        assert (await _until_done(d, task))[-1].ok
        assert (await d.find_update_task("upd-42")) is not None
        assert (await _versions(d))["BMC"] == "1.4.0"
        await d.reset_bmc()
        end = time.monotonic() + 10
        while True:  # the BMC restarts: 503 until it is back
            try:
                assert (await _versions(d))["BMC"] == "1.5.0"
                break
            except BmcProtocolError:
                assert time.monotonic() < end
                await asyncio.sleep(0.1)
    finally:
        await d.close()


async def test_injected_failures(lab_redfish: LabRedfish, images: Any) -> None:
    base, files = images
    state = lab_redfish.app[UPDATES]
    files["nic.bin"] = make_image("NIC.1", "1.22.0")
    files["bad.bin"] = make_image("NIC.1", "1.22.0", corrupt=True)
    d = _driver(lab_redfish)
    try:
        # A corrupt image: the BMC's own check fails the task, nothing is written.
        t = (await _until_done(d, await d.simple_update(f"{base}/bad.bin", "NIC.1")))[-1]
        assert t.state == "Exception" and "integrity" in t.messages[-1]
        # The checksum fault (a good image the BMC finds corrupt in transit).
        state.faults.add("checksum")
        t = (await _until_done(d, await d.simple_update(f"{base}/nic.bin", "NIC.1")))[-1]
        assert t.state == "Exception"
        # An image for another item than the target is refused.
        t = (await _until_done(d, await d.simple_update(f"{base}/nic.bin", "BIOS")))[-1]
        assert t.state == "Exception" and "for NIC.1, not BIOS" in t.messages[-1]
        assert state.pending == {}
        # The BMC restarts mid-flash: the task is there afterwards and completes.
        state.faults.add("bmc-reboot")
        t = (await _until_done(d, await d.simple_update(f"{base}/nic.bin", "NIC.1")))[-1]
        assert t.ok and state.pending == {"NIC.1": "1.22.0"}
        # A stalled flash stays Running: the caller's deadline is what ends it.
        state.faults.add("timeout")
        t = await d.simple_update(f"{base}/nic.bin", "NIC.1")
        with pytest.raises(AssertionError, match="still Running at 40%"):
            await _until_done(d, t, limit_s=2 * state.flash_s + 1)
        with pytest.raises(BmcUnsupported, match="no firmware inventory item"):
            await d.simple_update(f"{base}/nic.bin", "GPU0")
    finally:
        await d.close()


async def test_sushy_update_service_is_a_stub(sushy: Sushy) -> None:
    """Why the lab BMC proves updates: sushy-emulator advertises SimpleUpdate, but targets
    Systems rather than firmware inventory items (it serves no FirmwareInventory), never
    fetches the image, and its one task (42) is always Completed."""
    d = RedfishDriver(BmcEndpoint("127.0.0.1", sushy.port, "admin", "x"), scheme="http")
    try:
        assert await d.update_methods() == {"simple-update"}
        with pytest.raises(BmcUnsupported, match="FirmwareInventory|does not exist"):
            await d.simple_update("http://127.0.0.1:9/never.bin", "BIOS")
    finally:
        await d.close()
