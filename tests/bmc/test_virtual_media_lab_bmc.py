"""The lab's Redfish BMC implements VirtualMedia with QMP (issue 16 item 3), checked through
metald's own Redfish VirtualMedia client against a real, paused QEMU with the lab's CD drive:
InsertMedia fetches the image over HTTP and puts it in the drive (``blockdev-change-medium``),
``Inserted``/``Image`` are read back from QEMU, a ``Cd`` override moves the drive first in the
boot order, EjectMedia empties it. Nothing boots: the machine stays paused."""

from __future__ import annotations

import socket
import subprocess
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from metald.bmc.base import BmcEndpoint, BmcError
from metald.bmc.redfish import RedfishDriver
from tests.bmc.peers import PASSWORD, _stop, free_port, qmp_control

IMAGE = b"CD001" + bytes(4091)


async def _serve(app: web.Application) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port(socket.SOCK_STREAM)
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, port


@pytest.fixture
async def lab_cd(tmp_path: Path) -> AsyncIterator[tuple[RedfishDriver, Any, str]]:
    """(metald's driver for the lab BMC, the BMC's MachineControl, an image server's URL)."""
    from vmlab import qemu as lab_qemu
    from vmlab import redfish as lab_redfish

    qmp = tmp_path / "qmp.sock"
    argv = [
        "qemu-system-x86_64", "-accel", "tcg", "-S", "-nodefaults", "-display", "none",
        "-m", "64", "-qmp", f"unix:{qmp},server=on,wait=off",
        "-device", f"virtio-net-pci,id={lab_qemu.NIC_ID}",  # no backend: nothing leaves it
        "-drive", "if=none,id=d0,file=null-co://,format=raw",
        "-device", f"virtio-blk-pci,id={lab_qemu.DISK_ID},drive=d0",
        # the lab's CD drive, as vmlab.qemu.command_line makes it
        "-drive", "if=none,id=cddrive,media=cdrom,readonly=on",
        "-device", f"ide-cd,id={lab_qemu.CD_ID},drive=cddrive",
    ]  # fmt: skip
    proc = subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    fetched: list[str] = []

    async def image(request: web.Request) -> web.Response:
        fetched.append(request.path)
        if request.match_info["name"] == "missing.iso":
            raise web.HTTPNotFound()
        return web.Response(body=IMAGE)

    files = web.Application()
    files.router.add_get("/{name}", image)
    try:
        control = await qmp_control(qmp, proc)
        info = lab_redfish.SystemInfo(
            system_id="m0", uuid=str(uuid.uuid4()), mac="52:54:00:aa:bb:03", firmware="bios",
            memory_mb=64, cpus=1, serial_number="LAB-0003", username="admin", password=PASSWORD,
            media_dir=tmp_path,
        )  # fmt: skip
        bmc, bmc_port = await _serve(lab_redfish.make_app(control, info))
        srv, srv_port = await _serve(files)
        d = RedfishDriver(
            BmcEndpoint("127.0.0.1", bmc_port, "admin", PASSWORD),
            scheme="http",
            request_timeout_s=10.0,
        )
        try:
            yield d, control, f"http://127.0.0.1:{srv_port}"
        finally:
            await d.close()
            await srv.cleanup()
            await bmc.cleanup()
            await control.close()
    finally:
        _stop(proc)


async def _drive_file(control: Any) -> str | None:
    for dev in await control.qmp.execute("query-block"):
        if dev.get("qdev") == "cd0":
            return (dev.get("inserted") or {}).get("file")
    raise AssertionError("no cd0 in query-block")


async def _bootindex(control: Any, device: str) -> int:
    path = f"/machine/peripheral/{device}"
    return await control.qmp.execute("qom-get", {"path": path, "property": "bootindex"})


async def test_insert_boot_cd_once_and_eject_through_qmp(lab_cd) -> None:  # type: ignore[no-untyped-def]
    d, control, base = lab_cd
    path, cd = await d.find_virtual_cd()
    assert path.endswith("/VirtualMedia/Cd") and cd["Inserted"] is False and cd["Image"] is None
    assert await _bootindex(control, "cd0") == -1  # not in the boot order until asked

    # An image the BMC cannot fetch: refused, nothing inserted.
    with pytest.raises(BmcError):
        await d.insert_media(f"{base}/missing.iso")
    assert await _drive_file(control) is None

    url = f"{base}/boot.iso"
    await d.insert_media(url)  # metald checks Inserted and Image itself
    media = await _drive_file(control)
    assert media is not None and Path(media).read_bytes() == IMAGE  # QEMU holds the fetched file
    # Inserting again: metald ejects first (the lab BMC refuses an insert over a medium).
    await d.insert_media(f"{base}/other.iso")
    assert (await d.find_virtual_cd())[1]["Image"] == f"{base}/other.iso"

    await d.boot_cd_once()
    assert await _bootindex(control, "cd0") == 1  # the CD first for the next boot
    system = await d._system_resource(refresh=True)
    assert system["Boot"]["BootSourceOverrideTarget"] == "Cd"
    assert system["Boot"]["BootSourceOverrideEnabled"] == "Once"

    await d.eject_media()
    assert await _drive_file(control) is None
    cd = (await d.find_virtual_cd())[1]
    assert cd["Inserted"] is False and cd["Image"] is None
