"""The attestation core against real bytes: swtpm quotes and OVMF measured-boot event logs made
by tests/attestation/make_fixtures.sh (machine a: first commissioning, then a boot after its
"tenant" added a boot option and put it first in BootOrder; machine b: another TPM)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from metald.attestation import eventlog, tpm
from metald.attestation.verify import AttestationRefused, Golden, verify

FIX = Path(__file__).parent / "fixtures"


def read(name: str) -> bytes:
    return (FIX / name).read_bytes()


def boot(machine: str, name: str) -> dict[str, bytes]:
    return {
        "quote": read(f"{machine}-{name}.quote.msg"),
        "signature": read(f"{machine}-{name}.quote.sig"),
        "event_log": read(f"{machine}-{name}.eventlog"),
        "nonce": bytes.fromhex(read(f"{machine}-{name}.nonce").decode()),
    }


def test_parses_the_tpm_structures() -> None:
    ak = tpm.parse_public(read("a-ak.tpmt"))
    assert ak.is_attestation_key
    assert ak.name == read("a-ak.name")  # the name tpm2_createak printed
    q = tpm.parse_quote(read("a-boot1.quote.msg"))
    assert q.extra_data.hex() == read("a-boot1.nonce").decode()
    assert [(s.hash_alg, s.pcrs) for s in q.selections] == [(tpm.ALG_SHA256, tuple(range(8)))]
    # tpm2_quote -o: the PCR values the TPM read, in selection order.
    values = read("a-boot1.quote.pcrs")
    assert (
        tpm.pcr_composite_digest(tpm.ALG_SHA256, [values[i : i + 32] for i in range(0, 256, 32)])
        == q.pcr_digest
    )


def test_event_log_replays_to_the_quoted_pcrs() -> None:
    log = eventlog.parse(read("a-boot1.eventlog"))
    replayed = log.replay("sha256")
    values = read("a-boot1.quote.pcrs")
    for pcr in range(8):
        assert replayed[pcr] == values[pcr * 32 : pcr * 32 + 32], pcr
    labels = {e.label for e in log.events}
    assert {"SecureBoot", "PK", "KEK", "db", "dbx", "BootOrder", "Boot0000"} <= labels


def test_first_boot_learns_then_the_same_measurements_pass() -> None:
    first = verify(attestation_key=read("a-ak.tpmt"), golden=None, **boot("a", "boot1"))
    assert first.status == "learned"
    again = verify(attestation_key=read("a-ak.tpmt"), golden=first.golden, **boot("a", "boot1"))
    assert again.status == "passed" and again.changes == ()
    # Golden values survive their JSON form (the store keeps them so).
    assert Golden.from_dict(first.golden.as_dict()) == first.golden


def test_a_changed_boot_order_fails_naming_pcr_1_and_the_events() -> None:
    golden = verify(attestation_key=read("a-ak.tpmt"), golden=None, **boot("a", "boot1")).golden
    v = verify(attestation_key=read("a-ak.tpmt"), golden=golden, **boot("a", "boot2"))
    assert v.status == "failed"
    assert [c.pcr for c in v.changes] == [1]
    events = {(e.change, e.label) for e in v.changes[0].events}
    assert ("changed", "BootOrder") in events
    assert ("added", "Boot0001") in events
    assert "PCR 1" in v.summary() and "BootOrder" in v.summary()


def test_a_replayed_quote_is_refused() -> None:
    old = boot("a", "boot1")
    old["nonce"] = boot("a", "boot2")["nonce"]  # metald issued a new nonce for this boot
    with pytest.raises(AttestationRefused) as e:
        verify(attestation_key=read("a-ak.tpmt"), golden=None, **old)
    assert e.value.reason == "stale-nonce"


def test_a_quote_from_another_machines_tpm_is_refused() -> None:
    with pytest.raises(AttestationRefused) as e:
        verify(attestation_key=read("a-ak.tpmt"), golden=None, **boot("b", "boot1"))
    assert e.value.reason == "bad-signature"


def test_an_event_log_of_another_boot_is_refused() -> None:
    # The tenant's boot quoted honestly, but the log handed over is the golden boot's.
    sub = boot("a", "boot2")
    sub["event_log"] = boot("a", "boot1")["event_log"]
    with pytest.raises(AttestationRefused) as e:
        verify(attestation_key=read("a-ak.tpmt"), golden=None, **sub)
    assert e.value.reason == "forged-event-log"


def _patch_event(
    log: bytes, index: int, data: bytes | None = None, digest: bytes | None = None
) -> bytes:
    """The log with one event's data or SHA-256 digest replaced (offsets from the parser)."""
    parsed = eventlog.parse(log)
    ev = parsed.events[index]
    out = bytearray(log)
    if digest is not None:
        at = out.find(ev.digests["sha256"])
        out[at : at + 32] = digest
    if data is not None:
        assert len(data) == len(ev.data)
        at = out.find(ev.data)
        out[at : at + len(data)] = data
    return bytes(out)


def test_an_event_log_edited_to_hide_the_change_is_refused() -> None:
    golden_log = eventlog.parse(read("a-boot1.eventlog"))
    now = boot("a", "boot2")
    log = eventlog.parse(now["event_log"])
    order = next(e for e in log.events if e.label == "BootOrder")
    was = next(e for e in golden_log.events if e.label == "BootOrder")
    now["event_log"] = _patch_event(now["event_log"], order.index, digest=was.digests["sha256"])
    with pytest.raises(AttestationRefused) as e:
        verify(attestation_key=read("a-ak.tpmt"), golden=None, **now)
    assert e.value.reason == "forged-event-log"


def test_an_event_whose_data_lies_about_its_digest_is_refused() -> None:
    # SecureBoot's value shown as 1 while the digest (and so the PCR) measured the real one.
    sub = boot("a", "boot1")
    log = eventlog.parse(sub["event_log"])
    sb = next(e for e in log.events if e.label == "SecureBoot")
    assert hashlib.sha256(sb.data).digest() == sb.digests["sha256"]
    sub["event_log"] = _patch_event(sub["event_log"], sb.index, data=sb.data[:-1] + b"\x01")
    with pytest.raises(AttestationRefused) as e:
        verify(attestation_key=read("a-ak.tpmt"), golden=None, **sub)
    assert e.value.reason == "forged-event-log"


def test_a_key_that_is_not_an_attestation_key_is_refused() -> None:
    raw = bytearray(read("a-ak.tpmt"))
    raw[4:8] = (int.from_bytes(raw[4:8], "big") & ~tpm.RESTRICTED).to_bytes(4, "big")
    with pytest.raises(AttestationRefused) as e:
        verify(attestation_key=bytes(raw), golden=None, **boot("a", "boot1"))
    assert e.value.reason == "bad-key"


def test_truncated_or_garbage_input_is_refused_not_crashed() -> None:
    sub = boot("a", "boot1")
    for field, value in (
        ("quote", sub["quote"][:40]),
        ("signature", b"\x00\x18"),
        ("event_log", sub["event_log"][:100]),
        ("event_log", b"\xff" * 64),
    ):
        bad = dict(sub, **{field: value})
        with pytest.raises(AttestationRefused):
            verify(attestation_key=read("a-ak.tpmt"), golden=None, **bad)
