"""TFTP: the pure transfer machine, option negotiation, path safety, fuzzing, and the server
against third-party clients (atftp, tftp-hpa) on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import filecmp
import os
import struct
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metald.boot import metrics
from metald.boot.paths import PathRefused, safe_path
from metald.boot.tftp.packet import MalformedTftp, negotiate, parse_request
from metald.boot.tftp.server import TftpServer
from metald.boot.tftp.transfer import ReadTransfer, Result


def ack(n: int) -> bytes:
    return struct.pack("!HH", 4, n & 0xFFFF)


def blocks(pkts: list[bytes]) -> list[int]:
    return [struct.unpack("!H", p[2:4])[0] for p in pkts]


def test_negotiation_clamps_and_ignores() -> None:
    n = negotiate({"blksize": "1432", "tsize": "0", "windowsize": "4", "foo": "1"}, 12345)
    assert (n.blksize, n.windowsize) == (1432, 4)
    assert n.oack == {"blksize": "1432", "tsize": "12345", "windowsize": "4"}
    n = negotiate({"blksize": "99999", "timeout": "0", "windowsize": "1000"}, 1)
    # blksize x windowsize is capped (64 KiB in flight): a 64 KB block means a window of 1.
    assert n.blksize == 65464 and n.windowsize == 1 and "timeout" not in n.oack
    n = negotiate({"blksize": "512", "windowsize": "1000"}, 1)
    assert n.windowsize == 64 and n.oack == {"blksize": "512", "windowsize": "64"}
    assert negotiate({"blksize": "abc", "timeout": "300"}, 1).oack is None


def test_plain_transfer_and_exact_multiple_ends_with_empty_block() -> None:
    t = ReadTransfer(b"x" * 1024, negotiate({}, 1024))
    assert blocks(t.start()) == [1]
    assert blocks(t.on_packet(ack(1))) == [2]
    last = t.on_packet(ack(2))
    assert blocks(last) == [3] and len(last[0]) == 4  # empty final block
    assert t.on_packet(ack(3)) == [] and t.result is Result.OK


def test_oack_then_windows_and_partial_ack() -> None:
    data = os.urandom(100 * 10 + 5)
    t = ReadTransfer(data, negotiate({"blksize": "100", "windowsize": "4"}, len(data)))
    assert t.start()[0][:2] == b"\x00\x06"
    assert blocks(t.on_packet(ack(0))) == [1, 2, 3, 4]
    assert t.on_packet(ack(0)) == []  # duplicate: no resend storm
    assert blocks(t.on_packet(ack(2))) == [3, 4, 5, 6]  # partial ack restarts the window
    assert blocks(t.on_timeout()) == [3, 4, 5, 6]  # a timeout resends the window
    assert blocks(t.on_packet(ack(6))) == [7, 8, 9, 10]
    assert blocks(t.on_packet(ack(10))) == [11]
    t.on_packet(ack(11))
    assert t.result is Result.OK


def test_block_number_rollover() -> None:
    data = bytes(range(256)) * (8 * 70000 // 256)
    t = ReadTransfer(data, negotiate({"blksize": "8"}, len(data)))
    t.start()
    out = t.on_packet(ack(0))
    got = bytearray()
    n = 0
    while out:
        n += 1
        assert blocks(out) == [n & 0xFFFF]
        got += out[0][4:]
        # The client acks the 16-bit block number it saw.
        out = t.on_packet(ack(n))
    assert t.result is Result.OK and n == len(data) // 8 + 1 > 65536 and bytes(got) == data


def test_timeouts_give_up_and_client_error_aborts() -> None:
    # Unconfirmed (no ACK yet): nothing is resent on a timer (a forged request gets one packet
    # back); a repeated request gets the first packet again, twice at most; after 12 s of
    # timeouts the slot is freed.
    t = ReadTransfer(b"abc", negotiate({}, 3))
    assert blocks(t.start()) == [1]
    assert t.on_timeout() == [] and not t.done
    assert blocks(t.on_repeated_request()) == [1]
    assert blocks(t.on_repeated_request()) == [1]
    assert t.on_repeated_request() == [] and not t.done
    for _ in range(10):
        assert t.on_timeout() == [] and not t.done
    assert t.on_timeout() == [] and t.result is Result.TIMEOUT
    # Confirmed: five silent timeouts in a row, counted again after each ACK of progress.
    t = ReadTransfer(b"a" * 2000, negotiate({}, 2000))
    t.start()
    t.on_packet(ack(1))
    for _ in range(5):
        assert t.on_timeout()
    assert t.on_timeout() == [] and t.result is Result.TIMEOUT
    t2 = ReadTransfer(b"abc", negotiate({"tsize": "0"}, 3))
    t2.start()
    t2.on_packet(b"\x00\x05\x00\x08tsize only\x00")
    assert t2.result is Result.CLIENT_ERROR


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"\x00\x01", "truncated"),
        (b"\x00\x03\x00\x01data", "not-a-request"),
        (b"\x00\x01file\x00octet", "unterminated"),
        (b"\x00\x01file\x00octet\x00blksize\x00", "bad-fields"),
        (b"\x00\x01\x00octet\x00", "empty-filename"),
        (b"\x00\x01f\x00mail\x00", "bad-mode"),
        (b"\x00\x01f\xff\x00octet\x00", "not-ascii"),
        (b"\x00\x01f\x00octet\x00a\x001\x00a\x002\x00", "bad-option"),
        (b"\x00\x01" + b"a" * 2000 + b"\x00octet\x00", "oversized"),
    ],
)
def test_malformed_requests(raw: bytes, reason: str) -> None:
    with pytest.raises(MalformedTftp) as e:
        parse_request(raw)
    assert e.value.reason == reason


@settings(max_examples=3000, deadline=None)
@given(st.binary(max_size=600))
def test_fuzz_request_parser(data: bytes) -> None:
    with contextlib.suppress(MalformedTftp):
        parse_request(data)


@settings(max_examples=1000, deadline=None)
@given(st.lists(st.binary(max_size=8), max_size=30))
def test_fuzz_transfer_never_raises_other_errors(pkts: list[bytes]) -> None:
    t = ReadTransfer(b"z" * 3000, negotiate({"blksize": "512", "windowsize": "3"}, 3000))
    t.start()
    for p in pkts:
        with contextlib.suppress(MalformedTftp):
            t.on_packet(p)


def test_path_safety(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    (root / "ok.bin").write_bytes(b"1")
    (root / "sub" / "f").write_bytes(b"2")
    (tmp_path / "secret").write_text("no")
    (root / "out").symlink_to(tmp_path / "secret")
    (root / "in").symlink_to(root / "ok.bin")
    (root / "loop").symlink_to(root / "loop")
    # A sibling whose name starts with the root's: outside, though its path string starts
    # with the root's (a prefix check without the separator would serve it).
    (tmp_path / "rootx").mkdir()
    (tmp_path / "rootx" / "secret").write_text("no")
    (root / "sibling").symlink_to(tmp_path / "rootx" / "secret")
    os.mkfifo(root / "fifo")
    r = root.resolve()
    assert safe_path(r, "ok.bin") == r / "ok.bin"
    assert safe_path(r, "sub/f") == r / "sub" / "f"
    assert safe_path(r, "in") == r / "ok.bin"  # a link that stays inside is fine
    for name, reason in [
        ("../secret", "dot-dot"),
        ("sub/../../secret", "dot-dot"),
        ("sub\\..\\..\\secret", "dot-dot"),
        ("/etc/passwd", "absolute-path"),
        ("\\etc\\passwd", "absolute-path"),
        ("out", "outside-root"),
        ("sibling", "outside-root"),
        ("sub", "not-a-file"),
        ("sub/", "not-a-file"),
        ("fifo", "not-a-file"),
        ("ok.bin/x", "not-found"),
        ("nope", "not-found"),
        ("loop", "unreadable"),
        ("a\x00b", "bad-name"),
    ]:
        with pytest.raises(PathRefused) as e:
            safe_path(r, name)
        assert e.value.reason == reason, name


@pytest.fixture
async def server(assets: Path):  # type: ignore[no-untyped-def]
    s = TftpServer(assets, host="127.0.0.1", port=0)
    await s.start()
    yield s
    await s.stop()


async def run(*cmd: str) -> tuple[int, str]:
    p = await asyncio.create_subprocess_exec(
        *cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    out, _ = await asyncio.wait_for(p.communicate(), 60)
    return p.returncode or 0, out.decode()


def _count(counter, label: str) -> float:  # type: ignore[no-untyped-def]
    return counter.labels(label)._value.get()


async def test_atftp_and_tftp_hpa_fetch_with_options(
    server: TftpServer, assets: Path, tmp_path: Path
) -> None:
    port = str(server.bound_port)
    o1, o2, o3 = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    rc, out = await run(
        "atftp",
        "-g",
        "-r",
        "ipxe.efi",
        "-l",
        str(o1),
        "--option",
        "blksize 1428",
        "--option",
        "tsize 0",
        "--option",
        "timeout 2",
        "127.0.0.1",
        port,
    )
    assert rc == 0, out
    rc, out = await run(
        "atftp",
        "-g",
        "-r",
        "snponly.efi",
        "-l",
        str(o2),
        "--option",
        "windowsize 4",
        "127.0.0.1",
        port,
    )
    assert rc == 0, out
    rc, out = await run(
        "tftp", "-m", "binary", "127.0.0.1", port, "-c", "get", "undionly.kpxe", str(o3)
    )
    assert rc == 0, out
    assert filecmp.cmp(o1, assets / "ipxe.efi", shallow=False)
    assert filecmp.cmp(o2, assets / "snponly.efi", shallow=False)
    assert filecmp.cmp(o3, assets / "undionly.kpxe", shallow=False)


async def test_refusals_and_read_only(server: TftpServer, assets: Path, tmp_path: Path) -> None:
    port = str(server.bound_port)
    (tmp_path / "secret").write_text("x")
    (assets / "link").symlink_to(tmp_path / "secret")
    for name in ("../secret", "/etc/passwd", "link"):
        rc, out = await run(
            "tftp", "-m", "binary", "127.0.0.1", port, "-c", "get", name, str(tmp_path / "o")
        )
        assert "Error code 2" in out, (name, out)
    rc, out = await run(
        "tftp", "-m", "binary", "127.0.0.1", port, "-c", "get", "missing", str(tmp_path / "o")
    )
    assert "Error code 1" in out
    (tmp_path / "up").write_text("x")
    rc, out = await run(
        "tftp", "-m", "binary", "127.0.0.1", port, "-c", "put", str(tmp_path / "up"), "up"
    )
    assert "Error code 2" in out and not (assets / "up").exists()


async def test_garbage_is_dropped_and_counted_and_server_keeps_serving(
    server: TftpServer, assets: Path, tmp_path: Path
) -> None:
    before = _count(metrics.tftp_dropped, "unterminated")
    loop = asyncio.get_running_loop()
    tr, _ = await loop.create_datagram_endpoint(
        asyncio.DatagramProtocol, remote_addr=("127.0.0.1", server.bound_port)
    )
    for _ in range(50):
        tr.sendto(b"\x00\x01file\x00octet")
        tr.sendto(os.urandom(40))
    tr.close()
    await asyncio.sleep(0.2)
    assert _count(metrics.tftp_dropped, "unterminated") - before == 50
    rc, out = await run(
        "atftp",
        "-g",
        "-r",
        "ipxe.efi",
        "-l",
        str(tmp_path / "x"),
        "127.0.0.1",
        str(server.bound_port),
    )
    assert rc == 0 and filecmp.cmp(tmp_path / "x", assets / "ipxe.efi", shallow=False)


async def test_many_concurrent_fetches(assets: Path, tmp_path: Path) -> None:
    # Every client here is 127.0.0.1: lift the per-client cap (8 by default) for them.
    server = TftpServer(assets, host="127.0.0.1", port=0, max_per_client=40)
    await server.start()
    try:
        await _many_concurrent_fetches(server, assets, tmp_path)
    finally:
        await server.stop()


async def _many_concurrent_fetches(server: TftpServer, assets: Path, tmp_path: Path) -> None:
    port = str(server.bound_port)
    ok0 = _count(metrics.tftp_transfers, "ok")
    results = await asyncio.gather(
        *[
            run(
                "atftp",
                "-g",
                "-r",
                "undionly.kpxe",
                "-l",
                str(tmp_path / f"o{i}"),
                "--option",
                "blksize 1428",
                "127.0.0.1",
                port,
            )
            for i in range(40)
        ]
    )
    assert all(rc == 0 for rc, _ in results)
    assert all(
        filecmp.cmp(tmp_path / f"o{i}", assets / "undionly.kpxe", shallow=False) for i in range(40)
    )
    assert _count(metrics.tftp_transfers, "ok") - ok0 == 40
