"""TFTP under attack (issue 11, items 6 and 7): spoofed requests that are never acknowledged,
a client holding many transfers, memory per transfer, and window amplification.

"Spoofed" sources are real sockets bound to other 127/8 addresses: to the server they are
distinct client addresses, exactly as forged source addresses would be. Nothing leaves
loopback. Real clients are atftp processes.
"""

from __future__ import annotations

import asyncio
import filecmp
import os
import resource
import struct
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import pytest

from metald.boot import metrics
from metald.boot.tftp.admission import TransferTable
from metald.boot.tftp.packet import MAX_TIMEOUT, MAX_WINDOW_BYTES, negotiate
from metald.boot.tftp.server import FD_RESERVE, TftpServer
from metald.boot.tftp.source import FileCache
from metald.boot.tftp.transfer import ReadTransfer, Result


def rrq(name: str, mode: str = "octet", **options: object) -> bytes:
    body = name.encode() + b"\0" + mode.encode() + b"\0"
    for k, v in options.items():
        body += k.encode() + b"\0" + str(v).encode() + b"\0"
    return b"\0\1" + body


def ack(n: int) -> bytes:
    return struct.pack("!HH", 4, n & 0xFFFF)


def oack_options(pkt: bytes) -> dict[str, str]:
    fields = pkt[2:-1].split(b"\0")
    return {fields[i].decode(): fields[i + 1].decode() for i in range(0, len(fields) - 1, 2)}


class Peer(asyncio.DatagramProtocol):
    """A client socket that records what it receives and wakes whoever waits on ``net``."""

    def __init__(self, net: Net) -> None:
        self.net = net
        self.got: list[tuple[bytes, tuple[str, int]]] = []
        self.transport: asyncio.DatagramTransport

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        self.got.append((data, addr))
        self.net.changed.set()

    def send(self, data: bytes, addr: tuple[str, int]) -> None:
        self.transport.sendto(data, addr)

    def of_kind(self, op: int) -> list[tuple[bytes, tuple[str, int]]]:
        return [(d, a) for d, a in self.got if d[:2] == struct.pack("!H", op)]


class Net:
    def __init__(self) -> None:
        self.changed = asyncio.Event()
        self.peers: list[Peer] = []

    async def peer(self, host: str) -> Peer:
        loop = asyncio.get_running_loop()
        _, p = await loop.create_datagram_endpoint(lambda: Peer(self), local_addr=(host, 0))
        self.peers.append(p)
        return p

    async def until(self, cond: Callable[[], bool], timeout: float = 30) -> None:
        """Wait until ``cond()`` holds, re-checking on every datagram received."""

        async def wait() -> None:
            while not cond():
                self.changed.clear()
                await self.changed.wait()

        await asyncio.wait_for(wait(), timeout)

    def close(self) -> None:
        for p in self.peers:
            p.transport.close()


@pytest.fixture
async def net():  # type: ignore[no-untyped-def]
    n = Net()
    yield n
    n.close()


async def atftp(server: TftpServer, name: str, out: Path, *options: str) -> tuple[int, str]:
    args = ["atftp", "-g", "-r", name, "-l", str(out)]
    for o in options:
        args += ["--option", o]
    p = await asyncio.create_subprocess_exec(
        *args,
        "127.0.0.1",
        str(server.bound_port),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out_b, _ = await asyncio.wait_for(p.communicate(), 60)
    return p.returncode or 0, out_b.decode()


def _count(counter, label: str) -> float:  # type: ignore[no-untyped-def]
    return counter.labels(label)._value.get()


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# --- item 6: spoofed, never-acknowledged requests ---------------------------------------------


async def test_spoofed_never_acked_requests_do_not_lock_out_real_clients(
    net: Net, assets: Path, tmp_path: Path
) -> None:
    """The audit's attack: 2,048 never-ACKed RRQs with timeout=255 from forged sources. Before
    the fix every later client got "server busy" for ~25 minutes and each request held a socket.
    Now the server holds at most ``max_transfers`` sockets, pushes out the oldest unconfirmed
    transfers, ignores the 255 s timeout, and a real client is served at once."""
    server = TftpServer(assets, host="127.0.0.1", port=0)  # default limits
    await server.start()
    try:
        spoofers = [await net.peer(f"127.0.{1 + i // 250}.{2 + i % 250}") for i in range(256)]
        fds0 = _fds()
        evicted0 = _count(metrics.tftp_transfers, "evicted-unconfirmed")
        dest = ("127.0.0.1", server.bound_port)
        for j in range(8):
            for p in spoofers:
                p.send(rrq("ipxe.efi", timeout=255, blksize=512 + j), dest)

        def answered() -> set[tuple[int, str]]:
            return {
                (i, oack_options(d).get("blksize", ""))
                for i, p in enumerate(spoofers)
                for d, _ in p.of_kind(6)
            }

        await net.until(lambda: len(answered()) >= 256 * 8)
        held = _fds() - fds0
        assert held <= 512, f"{held} descriptors held for 2,048 unacknowledged requests"
        assert _count(metrics.tftp_transfers, "evicted-unconfirmed") - evicted0 >= 2048 - 512
        # timeout=255 was not accepted (RFC 2349 lets a server ignore it, not lower it).
        assert all("timeout" not in oack_options(d) for p in spoofers for d, _ in p.of_kind(6))

        out = tmp_path / "real"
        rc, text = await atftp(server, "ipxe.efi", out, "blksize 1428", "tsize 0", "timeout 2")
        assert rc == 0, text
        assert filecmp.cmp(out, assets / "ipxe.efi", shallow=False)
    finally:
        await server.stop()


async def test_forged_requests_in_a_clients_name_do_not_refuse_it(
    net: Net, assets: Path, tmp_path: Path
) -> None:
    """Forging the victim's own address: 50 unacknowledged requests "from" 127.0.0.1 fill its
    per-client cap with unconfirmed transfers, which its real request pushes out."""
    server = TftpServer(assets, host="127.0.0.1", port=0)
    await server.start()
    try:
        forged = [await net.peer("127.0.0.1") for _ in range(50)]
        for p in forged:
            p.send(rrq("undionly.kpxe"), ("127.0.0.1", server.bound_port))
        await net.until(lambda: all(p.of_kind(3) for p in forged))
        rc, text = await atftp(server, "undionly.kpxe", tmp_path / "o", "blksize 1428")
        assert rc == 0, text
        assert filecmp.cmp(tmp_path / "o", assets / "undionly.kpxe", shallow=False)
        assert server.transfers <= server.max_per_client
    finally:
        await server.stop()


async def test_one_address_holding_confirmed_transfers_is_capped(
    net: Net, assets: Path, tmp_path: Path
) -> None:
    """A real (non-spoofed) client that acknowledges the start of many transfers and then
    stalls them: the 9th from its address is refused with an error that says why; other
    addresses are still served."""
    server = TftpServer(assets, host="127.0.0.1", port=0, max_per_client=8)
    await server.start()
    try:
        refused0 = _count(metrics.tftp_transfers, "refused-per-client")
        holders = [await net.peer("127.0.0.3") for _ in range(9)]
        dest = ("127.0.0.1", server.bound_port)
        for p in holders[:8]:
            p.send(rrq("ipxe.efi", blksize=1428), dest)
        await net.until(lambda: all(p.of_kind(6) for p in holders[:8]))
        for p in holders[:8]:
            _, tid = p.of_kind(6)[0]
            p.send(ack(0), tid)  # confirmed: it received the OACK at its address
        await net.until(lambda: all(p.of_kind(3) for p in holders[:8]))
        holders[8].send(rrq("ipxe.efi", blksize=1428), dest)
        await net.until(lambda: bool(holders[8].got))
        (err, _), *_ = holders[8].got
        assert err[:4] == b"\0\5\0\0" and b"too many transfers from 127.0.0.3" in err, err
        assert _count(metrics.tftp_transfers, "refused-per-client") - refused0 == 1
        rc, text = await atftp(server, "snponly.efi", tmp_path / "o", "windowsize 4")
        assert rc == 0, text
    finally:
        await server.stop()


def test_unconfirmed_transfer_life_is_bounded_whatever_the_client_asks() -> None:
    """The life of a transfer nobody acknowledges: timeouts until it is given up, times the
    timeout. It was 6 x 255 s = 25.5 min (and 6 packets to the forged address); now at most
    3 x MAX_TIMEOUT, with one packet sent and none on the server's own timer."""
    for timeout in ("1", "5", "6", "255"):
        t = ReadTransfer(b"x" * 5000, negotiate({"timeout": timeout, "tsize": "0"}, 5000))
        sent = len(t.start())
        rounds = 0
        while not t.done:
            rounds += 1
            sent += len(t.on_timeout())
            assert rounds < 100
        assert t.result is Result.TIMEOUT and sent == 1
        assert rounds * t.neg.timeout <= 3 * MAX_TIMEOUT, (timeout, rounds, t.neg.timeout)
    # A confirmed transfer keeps the client's timeout when it is within the cap.
    assert negotiate({"timeout": "5"}, 1).timeout == 5.0
    assert negotiate({"timeout": "6"}, 1).oack is None


async def test_big_files_are_not_read_whole_per_transfer(
    net: Net, assets: Path, tmp_path: Path
) -> None:
    """A file over the old 64 MB cache limit was read whole into memory by every transfer;
    now it is pread block by block from one shared descriptor."""
    big = assets / "big.img"
    with big.open("wb") as f:
        f.truncate((64 << 20) + 1)  # sparse: costs no disk
        f.seek(1 << 20)
        f.write(b"marker")
    server = TftpServer(assets, host="127.0.0.1", port=0, max_per_client=64)
    await server.start()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        peers = [await net.peer("127.0.0.1") for _ in range(3)]
        for p in peers:
            p.send(rrq("big.img", blksize=1024), ("127.0.0.1", server.bound_port))
        await net.until(lambda: all(p.of_kind(6) for p in peers))
        grown = tracemalloc.get_traced_memory()[0] - base
        assert grown < 4 << 20, f"{grown} bytes allocated for 3 transfers of a 64 MB file"
        # And the content is right: block 1025 holds the marker at its start.
        p = peers[0]
        _, tid = p.of_kind(6)[0]
        for n in range(1025):
            p.send(ack(n), tid)
            want = struct.pack("!H", n + 1)
            await net.until(lambda want=want: any(d[2:4] == want for d, _ in p.got))
        block = next(d for d, _ in p.got if d[2:4] == struct.pack("!H", 1025))
        assert block[4:10] == b"marker"
    finally:
        tracemalloc.stop()
        await server.stop()


async def test_netascii_is_converted_once_and_refused_for_big_files(
    net: Net, assets: Path, tmp_path: Path
) -> None:
    """netascii made a converted copy of the file per transfer; now one cached copy serves
    all, and files over 1 MiB are refused in netascii with an error naming octet mode."""
    (assets / "big.bin").write_bytes(os.urandom(2 << 20))
    server = TftpServer(assets, host="127.0.0.1", port=0, max_per_client=64)
    await server.start()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        peers = [await net.peer("127.0.0.1") for _ in range(16)]
        for p in peers:
            p.send(rrq("ipxe.efi", "netascii"), ("127.0.0.1", server.bound_port))
        await net.until(lambda: all(p.of_kind(3) for p in peers))
        grown = tracemalloc.get_traced_memory()[0] - base
        size = (assets / "ipxe.efi").stat().st_size
        assert grown < 2 * size, f"{grown} bytes for 16 netascii transfers of {size} bytes"

        p = await net.peer("127.0.0.1")
        p.send(rrq("big.bin", "netascii"), ("127.0.0.1", server.bound_port))
        await net.until(lambda: bool(p.got))
        err = p.got[0][0]
        assert err[:2] == b"\0\5" and b"use octet mode" in err, err
    finally:
        tracemalloc.stop()
        await server.stop()


# --- item 7: window amplification -------------------------------------------------------------


def test_partial_acks_do_not_resend_the_window() -> None:
    """ACKing one block at a time made the server resend the whole window per ACK
    (windowsize x the file: 1,496 DATA packets for this 101-block file). A partial ACK now
    restarts the window only once until an ACK passes the end of the last restart, so ACKs
    alone cannot make the server send the file more than twice; every resend is also paid
    from the transfer's budget, and once it is spent an ACK sends only blocks never sent."""
    data = os.urandom(512 * 100 + 7)
    t = ReadTransfer(data, negotiate({"blksize": "512", "windowsize": "16"}, len(data)))
    bound = 2 * t.nblocks + t.neg.windowsize
    t.start()
    sent = t.on_packet(ack(0))
    for n in range(1, t.nblocks + 1):
        sent += t.on_packet(ack(n))
    assert t.result is Result.OK
    assert len(sent) <= bound, f"{len(sent)} DATA packets for {t.nblocks} blocks"
    # The file arrived in order for a client that ACKs as it goes.
    got, want = bytearray(), 1
    for p in sent:
        if struct.unpack("!H", p[2:4])[0] == want:
            got += p[4:]
            want += 1
    assert bytes(got) == data
    # A spent budget: ACKs keep the transfer going with new blocks only.
    t = ReadTransfer(data, negotiate({"blksize": "512", "windowsize": "16"}, len(data)))
    t.start()
    t.on_packet(ack(0))
    t.budget = 0
    assert [struct.unpack("!H", p[2:4])[0] for p in t.on_packet(ack(1))] == [17]


def test_window_bytes_are_capped() -> None:
    n = negotiate({"blksize": "65464", "windowsize": "64"}, 1 << 30)
    assert n.blksize * n.windowsize <= MAX_WINDOW_BYTES
    assert n.oack is not None and n.oack["windowsize"] == str(n.windowsize)
    # EDK2's request is untouched.
    n = negotiate({"blksize": "1468", "windowsize": "4"}, 1 << 20)
    assert (n.blksize, n.windowsize) == (1468, 4)


# --- admission: what the caps push out -------------------------------------------------------


def test_caps_push_out_unconfirmed_first_then_stale_never_fresh_confirmed() -> None:
    """The admission rules the server applies (pure): an unconfirmed transfer makes room
    first; a confirmed one only once it has run ``stale_after`` seconds (a client keeping
    transfers alive by ACKing slowly); fresh confirmed transfers are never pushed out."""
    table: TransferTable[str] = TransferTable(max_total=3, max_per_client=2, stale_after=30)
    assert table.admit("a1", "10.0.0.1", now=0).admitted
    table.confirm("a1")
    assert table.admit("a2", "10.0.0.1", now=1).admitted  # unconfirmed
    # Per client: a2 (unconfirmed) goes, a1 (confirmed, fresh) stays.
    adm = table.admit("a3", "10.0.0.1", now=2)
    assert adm.admitted and adm.evicted == [("a2", "evicted-unconfirmed")]
    table.confirm("a3")
    adm = table.admit("a4", "10.0.0.1", now=3)
    assert not adm.admitted and adm.reason == "refused-per-client"
    # Globally: full of fresh confirmed transfers, a newcomer is refused ...
    assert table.admit("b1", "10.0.0.2", now=4).admitted
    table.confirm("b1")
    assert table.admit("c1", "10.0.0.3", now=5).reason == "busy"
    # ... until the oldest has run 30 s: then it makes room.
    adm = table.admit("c1", "10.0.0.3", now=30)
    assert adm.admitted and adm.evicted == [("a1", "evicted-stale")]
    assert len(table) == 3 and table.count("10.0.0.1") == 1


async def test_transfer_cap_fits_under_the_descriptor_limit(assets: Path) -> None:
    """Each transfer holds a socket: under a 1,024-descriptor limit the default cap (512)
    would leave the API and database too few, so the server lowers it to half of what is
    left after a reserve, and says so."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
    try:
        server = TftpServer(assets, host="127.0.0.1", port=0)
        await server.start()
        try:
            assert server.max_transfers == (1024 - FD_RESERVE) // 2 == server.table.max_total
        finally:
            await server.stop()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_file_shrinking_under_a_pread_transfer_ends_it_with_an_error(tmp_path: Path) -> None:
    path = tmp_path / "img"
    path.write_bytes(b"x" * 10_000)
    cache = FileCache(file_max=1000)
    source = cache.open(path)
    assert cache.open_fds == 1 and cache.cached_bytes == 0
    t = ReadTransfer(source, negotiate({"blksize": "1000"}, source.size))
    t.start()
    assert len(t.on_packet(ack(0))[0]) == 1004
    os.truncate(path, 1500)
    out = t.on_packet(ack(1))
    assert t.result is Result.FILE_CHANGED and out[0][:2] == b"\0\5"
    t.close()
    assert cache.open_fds == 0
