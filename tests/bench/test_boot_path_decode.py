"""bench/boot_path.py's pure parts: the frame decoder, transfer accounting and serial milestones
(in-process, milliseconds; the lab run itself is the bench, never a test)."""

from __future__ import annotations

import importlib.util
import socket
import struct
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("boot_path", ROOT / "bench" / "boot_path.py")
assert _spec and _spec.loader
bp = importlib.util.module_from_spec(_spec)
sys.modules["boot_path"] = bp
_spec.loader.exec_module(bp)

MAC = bytes.fromhex("5254006c0700")


def frame(proto: int, src: str, dst: str, l4: bytes) -> bytes:
    ip = struct.pack(
        "!BBHHHBBH4s4s", 0x45, 0, 20 + len(l4), 0, 0, 64, proto, 0,
        socket.inet_aton(src), socket.inet_aton(dst),
    )  # fmt: skip
    return b"\xff" * 6 + MAC + b"\x08\x00" + ip + l4


def udp(sport: int, dport: int, payload: bytes) -> bytes:
    return struct.pack("!HHHH", sport, dport, 8 + len(payload), 0) + payload


def tcp(sport: int, dport: int, payload: bytes, seq: int = 0, flags: int = 0x18) -> bytes:
    return struct.pack("!HHIIBBHHH", sport, dport, seq, 0, 5 << 4, flags, 512, 0, 0) + payload


def dhcp(msg_type: int) -> bytes:
    fixed = bytearray(236)
    fixed[0] = 1
    fixed[28:34] = MAC
    return bytes(fixed) + b"c\x82Sc" + bytes([0, 53, 1, msg_type, 255])


def test_dhcp_messages_are_named_with_the_client_mac() -> None:
    rec = bp.decode(1.0, frame(17, "0.0.0.0", "255.255.255.255", udp(68, 67, dhcp(1))))
    assert rec == {"t": 1.0, "k": "dhcp", "mac": "52:54:00:6c:07:00", "type": "DISCOVER"}
    ack = bp.decode(2.0, frame(17, "10.7.0.1", "255.255.255.255", udp(67, 68, dhcp(5))))
    assert ack["type"] == "ACK"


def test_non_ipv4_is_skipped_and_empty_tcp_segments_are_acks() -> None:
    arp = b"\xff" * 6 + MAC + b"\x08\x06" + b"\0" * 28
    assert bp.decode(0.0, arp) is None
    ack = bp.decode(0.0, frame(6, "10.7.0.100", "10.7.0.1", tcp(40000, 8080, b"", 7, 0x11)))
    assert ack is not None
    assert (ack["k"], ack["conn"], ack["seq"], ack["fl"]) == (
        "tcp-ack",
        "10.7.0.100:40000",
        7,
        0x11,
    )


def test_tftp_and_http_transfers_add_up_per_request() -> None:
    rrq = udp(2070, 69, b"\x00\x01undionly.kpxe\x00octet\x00")
    data = udp(50000, 2070, b"\x00\x03\x00\x01" + b"x" * 1428)
    get = tcp(40000, 8080, b"GET /boot/assets/discovery/vmlinuz HTTP/1.1\r\nHost: x\r\n\r\n")
    body = [tcp(8080, 40000, b"y" * 1000, seq=1000 * i) for i in range(3)]
    get2 = tcp(40000, 8080, b"GET /boot/assets/discovery/initrd.img?x=1 HTTP/1.1\r\n\r\n")
    frames = [
        (1.0, frame(17, "10.7.0.100", "10.7.0.1", rrq)),
        (1.1, frame(17, "10.7.0.1", "10.7.0.100", data)),
        (1.2, frame(17, "10.7.0.1", "10.7.0.100", data)),
        (2.0, frame(6, "10.7.0.100", "10.7.0.1", get)),
        (2.5, frame(6, "10.7.0.1", "10.7.0.100", body[0])),
        (3.0, frame(6, "10.7.0.1", "10.7.0.100", body[1])),
        (4.0, frame(6, "10.7.0.100", "10.7.0.1", get2)),  # same connection (keep-alive)
        (4.5, frame(6, "10.7.0.1", "10.7.0.100", body[2])),
    ]
    records = [r for t, f in frames if (r := bp.decode(t, f)) is not None]
    got = [(x.what, x.start, x.end, x.size) for x in bp.transfers(records)]
    assert got == [
        ("TFTP undionly.kpxe", 1.0, 1.2, 2 * 1428),
        ("HTTP GET /boot/assets/discovery/vmlinuz", 2.0, 3.0, 2000),
        ("HTTP GET /boot/assets/discovery/initrd.img", 4.0, 4.5, 1000),
    ]


def test_retransmitted_segments_neither_add_bytes_nor_move_the_end() -> None:
    """The UEFI lab boot: iPXE stops ACKing the initrd's tail while the kernel's EFI stub runs,
    so the server sends the same segment again for seconds; the download itself ended at the
    last new byte, and the client's FIN marks when iPXE shut down (ExitBootServices)."""
    get = tcp(40000, 8080, b"GET /boot/assets/discovery/initrd.img HTTP/1.1\r\n\r\n")
    seg = [tcp(8080, 40000, b"y" * 1000, seq=1000 * i) for i in range(3)]
    frames = [
        (1.0, frame(6, "10.7.0.100", "10.7.0.1", get)),
        (1.1, frame(6, "10.7.0.1", "10.7.0.100", seg[0])),
        (1.2, frame(6, "10.7.0.1", "10.7.0.100", seg[1])),
        (1.3, frame(6, "10.7.0.1", "10.7.0.100", seg[2])),
        (1.5, frame(6, "10.7.0.1", "10.7.0.100", seg[1])),  # RTO: sent again
        (2.0, frame(6, "10.7.0.1", "10.7.0.100", seg[1])),
        (6.0, frame(6, "10.7.0.100", "10.7.0.1", tcp(40000, 8080, b"", 99, 0x11))),  # FIN
    ]
    records = [r for t, f in frames if (r := bp.decode(t, f)) is not None]
    (tr,) = bp.transfers(records)
    assert (tr.start, tr.end, tr.size, tr.retx, tr.last_retx) == (1.0, 1.3, 3000, 2, 2.0)
    assert bp.client_fins(records) == [(6.0, "10.7.0.100:40000")]


def test_serial_marks_take_the_first_matching_line_of_each_step() -> None:
    lines = [
        (10.0, "SeaBIOS (version 1.16.2)"),
        (12.0, "metald-agent: [3.62] discovery image up, kernel 6.1.0"),
        (13.0, "metald-agent: [4.0] discovery image up, kernel 6.1.0"),
        (14.0, "metald-agent: [5.8] inventory posted (1884 bytes, sequence 1)"),
    ]
    marks = {label: t for t, label, _ in bp.serial_marks(lines)}
    assert marks["firmware starts (SeaBIOS/OVMF)"] == 10.0
    assert marks["/init: discovery image up"] == 12.0
    assert marks["agent: inventory posted"] == 14.0
    assert marks["kernel clock starts (/init's uptime back)"] == 12.0 - 3.62
    assert "kernel: Run /init" not in marks
