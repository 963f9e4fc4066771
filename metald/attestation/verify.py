"""A measured-boot attestation, decided: a quote, its nonce and its UEFI event log checked
against the machine's attestation key, then compared with the machine's golden values.

Two kinds of answer:

- ``AttestationRefused``: the submission proves nothing (bad signature or another machine's
  key, a nonce metald did not issue for this boot, an event log that does not replay to the
  quoted PCRs). Nothing is learned from it and the machine's golden values stay as they are.
- a ``Verdict``: the quote is genuine and fresh and the log is the one the TPM measured; its
  ``status`` is ``learned`` (no golden values yet: trust on first use), ``passed`` or
  ``failed``, and ``changes`` say which PCR and which events differ from the golden values.

Pure: no clock, no store. ``metald.usecases.attestation`` supplies the nonce it issued.
"""

from __future__ import annotations

import difflib
import hmac
from dataclasses import dataclass, field
from typing import Any

from metald.attestation import eventlog, tpm

#: The PCRs compared with golden values by default (TCG PC Client profile): 0 firmware code,
#: 1 firmware configuration (boot order, boot options), 2 option ROM code, 3 option ROM
#: configuration, 5 GPT and boot manager configuration, 6 platform events, 7 Secure Boot
#: policy (PK, KEK, db, dbx and the authorities used). PCR 4 (boot applications: the iPXE and
#: kernel metald itself serves) is left out: it changes with every boot-asset update, and a
#: tenant cannot change what metald serves; an operator can add it (``[attestation] pcrs``).
DEFAULT_PCRS = (0, 1, 2, 3, 5, 6, 7)
ALG = "sha256"


class AttestationRefused(Exception):
    """The submission proves nothing; ``reason`` is a code, ``str()`` a sentence."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


@dataclass(frozen=True)
class EventChange:
    change: str  # "changed", "added" or "removed"
    type: str
    label: str
    golden_digest: str | None
    digest: str | None
    index: int | None  # position in this boot's event log

    def as_dict(self) -> dict[str, Any]:
        return {
            "change": self.change,
            "type": self.type,
            "label": self.label,
            "golden_digest": self.golden_digest,
            "digest": self.digest,
            "index": self.index,
        }


@dataclass(frozen=True)
class PcrChange:
    pcr: int
    golden: str
    quoted: str
    events: tuple[EventChange, ...]

    def as_dict(self) -> dict[str, Any]:
        return {
            "pcr": self.pcr,
            "golden": self.golden,
            "quoted": self.quoted,
            "events": [e.as_dict() for e in self.events],
        }

    def summary(self) -> str:
        what = ", ".join(
            f"{e.change} {e.type}" + (f" {e.label}" if e.label else "") for e in self.events
        )
        return f"PCR {self.pcr}" + (f" ({what})" if what else "")


@dataclass(frozen=True)
class Golden:
    """A machine's (or SKU's) golden values: the PCRs and the events that made them."""

    pcrs: dict[int, str]  # hex
    events: dict[int, list[dict[str, str]]]  # pcr -> [{type, label, digest}]

    def as_dict(self) -> dict[str, Any]:
        return {
            "alg": ALG,
            "pcrs": {str(k): v for k, v in sorted(self.pcrs.items())},
            "events": {str(k): v for k, v in sorted(self.events.items())},
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Golden:
        return cls(
            {int(k): str(v) for k, v in d.get("pcrs", {}).items()},
            {int(k): list(v) for k, v in d.get("events", {}).items()},
        )


@dataclass(frozen=True)
class Verdict:
    status: str  # "learned", "passed" or "failed"
    pcrs: dict[int, str]  # the quoted (and replayed) values of the compared PCRs, hex
    golden: Golden  # what this boot measured: the golden values if accepted
    changes: tuple[PcrChange, ...] = field(default=())
    quote: dict[str, int] = field(default_factory=dict)

    def summary(self) -> str:
        if self.status == "failed":
            return "boot measurements differ from the golden values: " + "; ".join(
                c.summary() for c in self.changes
            )
        if self.status == "learned":
            return "golden values learned from this boot (trust on first use)"
        return "boot measurements match the golden values"

    def as_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "summary": self.summary(),
            "pcrs": {str(k): v for k, v in sorted(self.pcrs.items())},
            "changes": [c.as_dict() for c in self.changes],
            "quote": self.quote,
        }


def load_attestation_key(public: bytes) -> tpm.PublicKey:
    """The machine's AK from its TPMT_PUBLIC; refuses a key that is not a restricted signing
    key made inside a TPM (such a key could sign a forged quote)."""
    try:
        key = tpm.parse_public(public)
    except tpm.TpmFormatError as e:
        raise AttestationRefused(
            "bad-key", f"the attestation key is not a TPMT_PUBLIC: {e}"
        ) from None
    if not key.is_attestation_key:
        raise AttestationRefused(
            "bad-key",
            "the key is not a TPM-resident restricted signing key (fixedTPM, fixedParent, "
            "sensitiveDataOrigin, restricted, sign); create it with tpm2_createak",
        )
    return key


def check_quote(
    key: tpm.PublicKey, message: bytes, signature: bytes, nonce: bytes, pcrs: tuple[int, ...]
) -> tpm.Quote:
    """The quote, if ``key`` signed it over ``nonce`` and it covers ``pcrs`` in SHA-256."""
    if not tpm.verify_signature(key, message, signature):
        raise AttestationRefused(
            "bad-signature",
            "the quote's signature does not verify against this machine's attestation key "
            "(a quote from another TPM, or altered bytes)",
        )
    try:
        quote = tpm.parse_quote(message)
    except tpm.TpmFormatError as e:
        raise AttestationRefused(
            "bad-quote", f"the signed bytes are not a TPM quote: {e}"
        ) from None
    if not hmac.compare_digest(quote.extra_data, nonce):
        raise AttestationRefused(
            "stale-nonce",
            "the quote is not over the nonce metald issued for this boot (a replayed or "
            "precomputed quote); fetch a new nonce and quote again",
        )
    selected = {p for s in quote.selections if s.hash_alg == tpm.ALG_SHA256 for p in s.pcrs}
    missing = sorted(set(pcrs) - selected)
    if missing:
        raise AttestationRefused(
            "pcrs-missing",
            f"the quote does not cover SHA-256 PCRs {missing}; quote with -l sha256:0-7",
        )
    return quote


def replay(quote: tpm.Quote, log_bytes: bytes) -> tuple[eventlog.EventLog, dict[int, bytes]]:
    """The parsed log and the PCR values it replays to, if they are the ones the quote signed."""
    try:
        log = eventlog.parse(log_bytes)
        replayed = log.replay(ALG)
    except eventlog.EventLogError as e:
        raise AttestationRefused("bad-event-log", f"the event log cannot be read: {e}") from None
    lying = [e for e in log.events if e.data_mismatch(ALG)]
    if lying:
        ev = lying[0]
        raise AttestationRefused(
            "forged-event-log",
            f"event {ev.index} ({ev.type_name}, PCR {ev.pcr}) shows data that is not what its "
            "digest measured: the event log was altered",
        )
    values: list[bytes] = []
    zero = bytes(32)
    sig_alg = tpm.ALG_SHA256
    for sel in quote.selections:
        if sel.hash_alg != tpm.ALG_SHA256:
            raise AttestationRefused("pcrs-missing", "quote SHA-256 PCRs only (-l sha256:...)")
        values += [replayed.get(p, zero) for p in sel.pcrs]
    if tpm.pcr_composite_digest(sig_alg, values) != quote.pcr_digest:
        raise AttestationRefused(
            "forged-event-log",
            "the event log does not replay to the PCR values the TPM quoted: it was altered, "
            "truncated, or belongs to another boot",
        )
    return log, replayed


def measured(log: eventlog.EventLog, replayed: dict[int, bytes], pcrs: tuple[int, ...]) -> Golden:
    """What this boot measured into ``pcrs``: golden values, should they be accepted."""
    return Golden(
        {p: replayed.get(p, bytes(32)).hex() for p in pcrs},
        {
            p: [
                {"type": e.type_name, "label": e.label, "digest": e.digests[ALG].hex()}
                for e in log.measured(p)
            ]
            for p in pcrs
        },
    )


def _event_changes(
    golden: list[dict[str, str]], now: list[eventlog.Event]
) -> tuple[EventChange, ...]:
    key_g = [(g["type"], g["label"], g["digest"]) for g in golden]
    key_n = [(e.type_name, e.label, e.digests[ALG].hex()) for e in now]
    out: list[EventChange] = []
    sm = difflib.SequenceMatcher(a=key_g, b=key_n, autojunk=False)
    for op, a0, a1, b0, b1 in sm.get_opcodes():
        if op == "equal":
            continue
        olds, news = golden[a0:a1], now[b0:b1]
        for i in range(max(len(olds), len(news))):
            g = olds[i] if i < len(olds) else None
            n = news[i] if i < len(news) else None
            if (
                g is not None
                and n is not None
                and (g["type"], g["label"])
                == (
                    n.type_name,
                    n.label,
                )
            ):
                out.append(
                    EventChange(
                        "changed", n.type_name, n.label, g["digest"], key_n[b0 + i][2], n.index
                    )
                )
                continue
            if g is not None:
                out.append(EventChange("removed", g["type"], g["label"], g["digest"], None, None))
            if n is not None:
                out.append(
                    EventChange("added", n.type_name, n.label, None, key_n[b0 + i][2], n.index)
                )
    return tuple(out)


def compare(golden: Golden, log: eventlog.EventLog, now: Golden) -> tuple[PcrChange, ...]:
    changes = []
    for pcr, value in sorted(now.pcrs.items()):
        want = golden.pcrs.get(pcr)
        if want is None or hmac.compare_digest(want, value):
            continue
        events = _event_changes(golden.events.get(pcr, []), log.measured(pcr))
        changes.append(PcrChange(pcr, want, value, events))
    return tuple(changes)


def verify(
    *,
    attestation_key: bytes,
    quote: bytes,
    signature: bytes,
    event_log: bytes,
    nonce: bytes,
    golden: Golden | None,
    pcrs: tuple[int, ...] = DEFAULT_PCRS,
) -> Verdict:
    """Decide one attestation (see the module docstring); raises ``AttestationRefused``."""
    key = load_attestation_key(attestation_key)
    q = check_quote(key, quote, signature, nonce, pcrs)
    log, replayed = replay(q, event_log)
    now = measured(log, replayed, pcrs)
    info = {
        "reset_count": q.reset_count,
        "restart_count": q.restart_count,
        "clock": q.clock,
        "firmware_version": q.firmware_version,
    }
    if golden is None:
        return Verdict("learned", now.pcrs, now, (), info)
    changes = compare(golden, log, now)
    return Verdict("failed" if changes else "passed", now.pcrs, now, changes, info)
