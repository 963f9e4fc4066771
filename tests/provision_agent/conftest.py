"""Loop-device disks and a busybox-only PATH for running the deploy agent on the host."""

from __future__ import annotations

import asyncio
import os
import shutil
import struct
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

ROOT = Path(__file__).resolve().parents[2]
AGENT = ROOT / "bootassets" / "agent" / "metald-agent"
BUSYBOX = shutil.which("busybox")
MIB = 1 << 20

needs_root_and_busybox = [
    pytest.mark.skipif(BUSYBOX is None, reason="busybox is not installed"),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root for loop devices"),
    pytest.mark.skipif(shutil.which("losetup") is None, reason="losetup is not installed"),
]


@pytest.fixture
def busybox_bin(tmp_path: Path) -> Path:
    """Every busybox applet and nothing else, as in the image (where /init installs them all)."""
    assert BUSYBOX
    d = tmp_path / "bin"
    d.mkdir()
    applets = subprocess.run([BUSYBOX, "--list"], capture_output=True, text=True, check=True)
    for applet in applets.stdout.split():
        (d / applet).symlink_to(BUSYBOX)
    return d


class Loops:
    """Loop devices attached during a test, detached in finally by the fixture."""

    def __init__(self) -> None:
        self.devices: list[str] = []

    def attach(self, path: Path, *args: str) -> str:
        out = subprocess.run(
            ["losetup", "-f", "--show", *args, str(path)],
            capture_output=True,
            text=True,
            check=True,
        )
        dev = out.stdout.strip()
        self.devices.append(dev)
        return dev

    def detach_all(self) -> None:
        while self.devices:
            subprocess.run(["losetup", "-d", self.devices.pop()], capture_output=True)


@pytest.fixture
def loops() -> Iterator[Loops]:
    lp = Loops()
    try:
        yield lp
    finally:
        lp.detach_all()


def mbr(start_sector: int, sectors: int, kind: int = 0x83) -> bytes:
    """A DOS partition table with one partition (no boot code)."""
    sector = bytearray(512)
    sector[446:462] = struct.pack("<B3sB3sII", 0, b"\0\0\0", kind, b"\0\0\0", start_sector, sectors)
    sector[510:512] = b"\x55\xaa"
    return bytes(sector)


def cloud_image(tmp_path: Path) -> bytes:
    """6 MiB like a cloud image: MBR, an ext4 root at 1-5 MiB holding /etc/cloud, then random
    bytes (so a wrong offset or a short write shows)."""
    tree = tmp_path / "tree"
    (tree / "etc" / "cloud").mkdir(parents=True)
    (tree / "etc" / "cloud" / "cloud.cfg").write_text("datasource_list: [NoCloud]\n")
    part = tmp_path / "root.ext4"
    subprocess.run(
        ["mkfs.ext4", "-q", "-F", "-d", str(tree), str(part), "4M"],
        check=True,
        capture_output=True,
    )
    return mbr(2048, 8192) + bytes(MIB - 512) + part.read_bytes() + os.urandom(MIB)


def debugfs_cat(image: Path, offset: int, size: int, path: str) -> bytes:
    """A file's bytes from the ext4 file system at offset in image, without mounting."""
    fs = image.with_suffix(".part")
    with image.open("rb") as f:
        f.seek(offset)
        fs.write_bytes(f.read(size))
    out = subprocess.run(["debugfs", "-R", f"cat {path}", str(fs)], capture_output=True, check=True)
    return out.stdout


async def run_agent(
    tmp_path: Path, bin_dir: Path, port: int, mode: str, **env: str
) -> tuple[int, str]:
    sysroot = tmp_path / "sysroot"
    (sysroot / "proc").mkdir(parents=True, exist_ok=True)
    (sysroot / "proc" / "cmdline").write_text("console=ttyS0 quiet\n")
    state = tmp_path / "state"
    state.mkdir(exist_ok=True)
    full = {
        "PATH": str(bin_dir),
        "METALD_URL": f"http://127.0.0.1:{port}",
        "METALD_TOKEN": "agent-token",
        "METALD_MACHINE": "m1",
        "METALD_MODE": mode,
        "METALD_SYSROOT": str(sysroot),
        "METALD_STATE_DIR": str(state),
        "METALD_DRY_RUN": "1",
        "METALD_MAX_TRIES": "2",
        "METALD_RETRY_MAX": "1",
        **env,
    }
    assert BUSYBOX
    log = tmp_path / "agent.log"
    with log.open("wb") as f:
        proc = await asyncio.create_subprocess_exec(
            BUSYBOX, "sh", str(AGENT), env=full, stdout=f, stderr=asyncio.subprocess.STDOUT
        )
        try:
            await asyncio.wait_for(proc.wait(), timeout=90)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise AssertionError(
                "the agent did not finish:\n" + log.read_text(errors="replace")
            ) from None
    assert proc.returncode is not None
    return proc.returncode, log.read_text(errors="replace")


class Instance:
    """One stand-in metald on 127.0.0.1 whose listener can be closed at once, as a killed
    process's is: new connections are refused from then on."""

    def __init__(self, app: web.Application, api: Any = None) -> None:
        self.api = api
        self.runner = web.AppRunner(app)
        self.server: asyncio.Server | None = None
        self.url = ""

    async def start(self) -> None:
        await self.runner.setup()
        assert self.runner.server is not None
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(self.runner.server, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    def kill(self) -> None:
        assert self.server is not None
        self.server.close()  # synchronous: the listening socket is gone now


@pytest.fixture
async def instances() -> AsyncIterator[Callable[[Any], Awaitable[Instance]]]:
    started: list[Instance] = []

    async def make(api: Any) -> Instance:
        inst = Instance(api if isinstance(api, web.Application) else api.app(), api)
        await inst.start()
        started.append(inst)
        return inst

    yield make
    for inst in started:
        inst.kill()
        await inst.runner.cleanup()
