"""Serial-over-LAN against OpenIPMI's ``ipmi_sim``, whose SOL is wired to a TCP socket this
test serves (standing in for the host's serial port; no QEMU): data both ways, break,
keepalive, taking over a stale activation, and the console manager's reconnect."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
import textwrap
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from metald.bmc.sol_link import SolLink
from tests.bmc.peers import EMU, PASSWORD, _wait_udp_bound, free_port, stop_peer

pytestmark = pytest.mark.skipif(
    shutil.which("ipmi_sim") is None, reason="ipmi_sim (Debian package openipmi) is not installed"
)


class SerialPort:
    """The host side of the serial line: ipmi_sim connects here (and reconnects by itself)."""

    def __init__(self) -> None:
        self.received = bytearray()
        self.changed = asyncio.Event()
        self.writer: asyncio.StreamWriter | None = None
        self.connected = asyncio.Event()
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        self.port: int = self.server.sockets[0].getsockname()[1]
        return self.port

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

    async def wait_for(self, needle: bytes, timeout: float = 10) -> None:
        async with asyncio.timeout(timeout):
            while needle not in self.received:
                self.changed.clear()
                await self.changed.wait()

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.server is not None:
            self.server.close()


class Screen:
    """What a console viewer sees."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.changed = asyncio.Event()

    def __call__(self, data: bytes) -> None:
        self.data += data
        self.changed.set()

    async def wait_for(self, needle: bytes, timeout: float = 10) -> None:
        async with asyncio.timeout(timeout):
            while needle not in self.data:
                self.changed.clear()
                await self.changed.wait()


@dataclass
class SolSim:
    port: int
    serial: SerialPort
    proc: subprocess.Popen


def _start_sim(
    tmp_path: Path, serial_port: int, port: int | None = None
) -> tuple[int, subprocess.Popen]:
    port = port or free_port()
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "lan.conf").write_text(
        textwrap.dedent(f"""\
        name "sol"
        set_working_mc 0x20
          startlan 1
            addr 127.0.0.1 {port}
            priv_limit admin
            allowed_auths_callback none md2 md5 straight
            allowed_auths_user none md2 md5 straight
            allowed_auths_operator none md2 md5 straight
            allowed_auths_admin none md2 md5 straight
            guid a123456789abcdef0123456789abcdef
          endlan
          sol "tcp:127.0.0.1:{serial_port}" 115200
          user 2 true  "admin" "{PASSWORD}" admin 10 none md2 md5 straight
        """)
    )
    (tmp_path / "bmc.emu").write_text(EMU)
    (tmp_path / "state").mkdir(exist_ok=True)
    proc = subprocess.Popen(
        ["ipmi_sim", "-n", "-c", str(tmp_path / "lan.conf"), "-f", str(tmp_path / "bmc.emu")]
        + ["-s", str(tmp_path / "state")],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return port, proc


@contextlib.asynccontextmanager
async def running_sol_sim(tmp_path: Path) -> AsyncIterator[SolSim]:
    """ipmi_sim with SOL on a serial port this test serves."""
    serial = SerialPort()
    sport = await serial.start()
    port, proc = _start_sim(tmp_path, sport)
    try:
        # ipmi_sim dials the serial device when it starts: it is up once it has connected.
        await asyncio.wait_for(serial.connected.wait(), 10)
        await asyncio.to_thread(_wait_udp_bound, port, proc)
        sim = SolSim(port, serial, proc)
        yield sim
    finally:
        # A test may restart the BMC (sim.proc): stop the original and the one running now,
        # even when the test failed.
        stop_peer(proc)
        if "sim" in locals() and sim.proc is not proc:
            stop_peer(sim.proc)
        await serial.close()


@pytest.fixture
async def sim(tmp_path: Path) -> AsyncIterator[SolSim]:
    async with running_sol_sim(tmp_path) as s:
        yield s


def _link(sim: SolSim, screen: Screen, **kw: float) -> SolLink:
    return SolLink("127.0.0.1", sim.port, "admin", PASSWORD, screen, **kw)


async def test_sol_carries_data_both_ways(sim: SolSim) -> None:
    screen = Screen()
    link = _link(sim, screen)
    await link.open()
    try:
        await sim.serial.send(b"login: ")
        await screen.wait_for(b"login: ")
        link.write(b"root\r")
        await sim.serial.wait_for(b"root\r")
        # More than one SOL packet's worth, both ways, arrives whole and in order.
        big = bytes(range(32, 127)) * 20
        await sim.serial.send(big)
        await screen.wait_for(big)
        link.write(big)
        await sim.serial.wait_for(big)
        assert screen.data.count(big) == 1
        assert link.core.counters.malformed == 0
    finally:
        await link.close()


async def test_break_reaches_the_serial_line(sim: SolSim) -> None:
    """ipmi_sim turns a SOL break into a break on its serial device; over TCP that is not
    visible, so the proof is that the break packet is acknowledged and data keeps flowing."""
    screen = Screen()
    link = _link(sim, screen)
    await link.open()
    try:
        link.send_break()
        link.write(b"after-break")
        await sim.serial.wait_for(b"after-break")
        assert not link.core.failed
    finally:
        await link.close()


async def test_keepalive_holds_an_idle_session(sim: SolSim) -> None:
    screen = Screen()
    link = _link(sim, screen, keepalive_s=0.2)
    await link.open()
    try:
        # Wait for several keepalives to have been answered (the session is still good).
        async with asyncio.timeout(10):
            while link.keepalives < 3:
                await asyncio.sleep(0.05)
        assert link.closed is not None and not link.closed.done()
        await sim.serial.send(b"still-here")
        await screen.wait_for(b"still-here")
    finally:
        await link.close()


async def test_a_stale_activation_is_taken_over(sim: SolSim) -> None:
    """A first link vanishes without deactivating (metald killed): the next one deactivates
    the stale SOL instance and carries the console."""
    first = _link(sim, Screen())
    await first.open()
    # Drop it on the floor: no deactivate, no close session.
    assert first._reader is not None
    first._reader.cancel()
    assert first.session.transport is not None
    first.session.transport.close()

    screen = Screen()
    second = _link(sim, screen)
    await second.open()
    try:
        assert second.took_over
        await sim.serial.send(b"second-link")
        await screen.wait_for(b"second-link")
        second.write(b"typed")
        await sim.serial.wait_for(b"typed")
    finally:
        await second.close()


async def test_the_bmc_going_away_closes_the_link_with_a_reason(sim: SolSim) -> None:
    screen = Screen()
    link = _link(sim, screen, keepalive_s=0.2, timeout_s=1.0)
    await link.open()
    stop_peer(sim.proc)
    assert link.closed is not None
    reason = await asyncio.wait_for(link.closed, 10)
    assert "keepalive" in reason or "acknowledg" in reason or "unreachable" in reason, reason
    await link.close()


async def test_the_console_reconnects_when_the_bmc_comes_back(tmp_path: Path) -> None:
    """The BMC restarts (its SOL state gone): the console service notices through keepalive,
    reconnects with backoff while its viewer stays, and the ring keeps what came before."""
    from metald.bmc.console import ConsoleService
    from metald.store import Store

    store = Store(f"sqlite:///{tmp_path / 'm.db'}")
    store.migrate()

    async with running_sol_sim(tmp_path / "bmc") as sim:

        async def links(machine_id: str, on_data: Any) -> SolLink:
            return SolLink(
                "127.0.0.1", sim.port, "admin", PASSWORD, on_data, keepalive_s=0.2, timeout_s=1.0
            )

        svc = ConsoleService(store, "test", links, backoff_s=(0.1,))
        viewer, _ = await svc.attach("m1", "technician:alice", "auto")
        states: list[str] = []

        async def until(pred: Any) -> Any:
            async with asyncio.timeout(20):
                while True:
                    item = await viewer.queue.get()
                    if isinstance(item, dict):
                        states.append(item["state"])
                    if pred(item):
                        return item

        await until(lambda i: isinstance(i, dict) and i["state"] == "connected")
        await sim.serial.send(b"before")
        await until(lambda i: isinstance(i, bytes) and b"before" in i)

        stop_peer(sim.proc)
        await until(lambda i: isinstance(i, dict) and i["state"] == "reconnecting")
        sim.serial.connected.clear()
        _port, sim.proc = _start_sim(tmp_path / "bmc", sim.serial.port, sim.port)
        await until(lambda i: isinstance(i, dict) and i["state"] == "connected")
        await asyncio.wait_for(sim.serial.connected.wait(), 10)
        await sim.serial.send(b"after")
        await until(lambda i: isinstance(i, bytes) and b"after" in i)
        assert svc.type("m1", viewer, b"typed-again")
        await sim.serial.wait_for(b"typed-again")
        assert b"before" in svc.consoles["m1"].ring.snapshot()
        await svc.detach("m1", viewer)
        await svc.stop()
    store.close()
