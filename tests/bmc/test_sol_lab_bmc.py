"""The lab's virtual BMC (pyghmi's server with vm-lab's SOL bridge) against metald's SOL link,
no QEMU: the test serves the unix socket QEMU would offer as the machine's serial port."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from metald.bmc.sol_link import SolLink
from tests.bmc.peers import _wait_udp_bound, free_port, stop_peer
from tests.bmc.test_sol_ipmi_sim import Screen

PASSWORD = "lab-Pa55word"

#: The lab BMC's IPMI side with the SOL bridge, and no QMP behind it (no power commands here).
RUNNER = textwrap.dedent("""
    import asyncio, sys, threading, uuid
    from pathlib import Path
    from vmlab.vbmc import LabIpmiBmc
    from vmlab.vsol import SolBridge

    async def main():
        loop = asyncio.get_running_loop()
        bmc = LabIpmiBmc({"admin": sys.argv[3]}, "127.0.0.1", int(sys.argv[1]),
                         str(uuid.uuid4()), None, loop)
        bmc.sol = SolBridge(Path(sys.argv[2]), loop, int(sys.argv[1]))
        bmc.sol.start()
        threading.Thread(target=bmc.listen, daemon=True).start()
        await asyncio.Event().wait()

    asyncio.run(main())
""")


class UnixSerial:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.received = bytearray()
        self.changed = asyncio.Event()
        self.connected = asyncio.Event()
        self.writer: asyncio.StreamWriter | None = None

    async def start(self) -> None:
        self.server = await asyncio.start_unix_server(self._conn, str(self.path))

    async def _conn(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        self.writer = w
        self.connected.set()
        with contextlib.suppress(asyncio.CancelledError, ConnectionError):
            while data := await r.read(4096):
                self.received += data
                self.changed.set()

    async def send(self, data: bytes) -> None:
        await asyncio.wait_for(self.connected.wait(), 10)
        assert self.writer is not None
        self.writer.write(data)
        await self.writer.drain()

    async def wait_for(self, needle: bytes) -> None:
        async with asyncio.timeout(10):
            while needle not in self.received:
                self.changed.clear()
                await self.changed.wait()


@pytest.fixture
async def lab_bmc(tmp_path: Path) -> AsyncIterator[tuple[int, UnixSerial]]:
    serial = UnixSerial(tmp_path / "m0.serial.sock")
    await serial.start()
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", RUNNER, str(port), str(serial.path), PASSWORD],
        stdin=subprocess.DEVNULL,
    )
    try:
        await asyncio.to_thread(_wait_udp_bound, port, proc)
        await asyncio.wait_for(serial.connected.wait(), 10)
        yield port, serial
    finally:
        stop_peer(proc)
        serial.server.close()


async def test_lab_bmc_carries_sol_both_ways(lab_bmc: tuple[int, UnixSerial]) -> None:
    port, serial = lab_bmc
    screen = Screen()
    link = SolLink("127.0.0.1", port, "admin", PASSWORD, screen)
    await link.open()
    try:
        await serial.send(b"SeaBIOS (version 1.16)\r\n")
        await screen.wait_for(b"SeaBIOS")
        big = bytes(range(32, 127)) * 10
        await serial.send(big)
        await screen.wait_for(big)
        link.write(b"root\r")
        await serial.wait_for(b"root\r")
        link.send_break()
        link.write(b"after")
        await serial.wait_for(b"after")
        assert screen.data.count(big) == 1
    finally:
        await link.close()
    # Deactivated on close: a new link gets SOL without taking anything over.
    again = SolLink("127.0.0.1", port, "admin", PASSWORD, Screen())
    await again.open()
    try:
        assert not again.took_over
    finally:
        await again.close()
