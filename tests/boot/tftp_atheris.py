"""Coverage-guided fuzzing of the TFTP core with atheris (libFuzzer), for a bounded time.

    .venv/bin/python tests/boot/tftp_atheris.py [CORPUS_DIR] -max_total_time=3

test_tftp_atheris.py runs it in every run of the suite. The first input byte picks a target:
the request parser followed by negotiation and a transfer driven by the rest of the input, or
the admission table. The invariants are those of tftp_invariants.py (shared with the
hypothesis tests); a broken one raises AssertionError, which atheris reports as a crash with
the input that caused it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import atheris

with atheris.instrument_imports(include=["metald.boot.tftp"]):
    import metald.boot.tftp.admission
    import metald.boot.tftp.packet
    import metald.boot.tftp.source
    import metald.boot.tftp.transfer  # noqa: F401

from metald.boot.tftp.packet import MalformedTftp, parse_request  # noqa: E402
from tests.boot.tftp_invariants import (  # noqa: E402
    AdmissionOp,
    Event,
    check_negotiation,
    drive_transfer,
    run_admission,
)

EVENT_KINDS = ["ack", "ack-near", "ack-near", "timeout", "rrq", "error", "garbage"]
OPS = ["admit", "admit", "confirm", "confirm", "remove", "tick"]


def one_input(data: bytes) -> None:
    """Layout: target byte; then for the admission table, (op, argument) byte pairs; for a
    transfer, a 2-byte request length, the request, a 2-byte file size, and (event, argument)
    byte pairs. Decoded by hand (not FuzzedDataProvider) so that seeds say what they mean."""
    if len(data) < 1:
        return
    if data[0] % 4 == 0:
        ops: list[AdmissionOp] = [
            (OPS[data[i] % len(OPS)], data[i + 1]) for i in range(1, len(data) - 1, 2)
        ]
        run_admission(ops)
        return
    n = int.from_bytes(data[1:3], "big") % 601
    raw, rest = data[3 : 3 + n], data[3 + n :]
    try:
        req = parse_request(raw)
    except MalformedTftp:
        return
    size = int.from_bytes(rest[:2], "big") % 4001
    check_negotiation(req.options, size)
    events: list[Event] = []
    i = 2
    while i + 1 < len(rest) and len(events) < 200:
        kind, arg = EVENT_KINDS[rest[i] % len(EVENT_KINDS)], rest[i + 1]
        i += 2
        if kind == "ack":
            a = int.from_bytes(rest[i : i + 2], "big")
            i += 2
            events.append((kind, a))
        elif kind == "ack-near":
            events.append((kind, arg - 3))
        elif kind == "garbage":
            events.append((kind, rest[i : i + arg % 9]))
            i += arg % 9
        else:
            events.append((kind, 0))
    drive_transfer(size, req.options, events)


def _seed(request: bytes, size: int, events: list[tuple[int, int]]) -> bytes:
    """Bytes that ``one_input`` decodes as this request, file size and events."""
    out = b"\x01" + len(request).to_bytes(2, "big") + request + size.to_bytes(2, "big")
    return out + b"".join(bytes([k, a]) for k, a in events)


def seeds() -> list[bytes]:
    """What real clients send, so the fuzzer starts from whole transfers: iPXE (lock-step,
    blksize 1432, tsize), EDK2 (windowsize 4, one ACK per window) and a windowed client that
    ACKs every block."""
    ack_near = EVENT_KINDS.index("ack-near")
    # An ack-near argument b means "ACK the acked block + b - 3": 3 ACKs what is acked (ACK 0
    # after an OACK), 4 one block more, 7 four more.
    return [
        _seed(
            b"\x00\x01ipxe.efi\x00octet\x00blksize\x001432\x00tsize\x000\x00",
            3000,
            [(ack_near, 3)] + [(ack_near, 4)] * 3,
        ),
        _seed(
            b"\x00\x01snponly.efi\x00octet\x00blksize\x00512\x00windowsize\x004\x00",
            4000,
            [(ack_near, 3)] + [(ack_near, 7)] * 2,
        ),
        _seed(
            b"\x00\x01f\x00octet\x00blksize\x0064\x00windowsize\x0016\x00",
            1600,
            [(ack_near, 3)] + [(ack_near, 4)] * 8,
        ),
    ]


def main() -> None:
    argv = list(sys.argv)
    corpus = next((a for a in argv[1:] if not a.startswith("-")), None)
    if corpus is not None:
        d = Path(corpus)
        d.mkdir(parents=True, exist_ok=True)
        for i, s in enumerate(seeds()):
            (d / f"seed-{i}").write_bytes(s)
    atheris.Setup(argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
