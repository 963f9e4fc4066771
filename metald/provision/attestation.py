"""Measured-boot attestation in the store: a machine's attestation key, the nonces metald
issues for its boots, the agent's quotes and metald's verdicts on them, golden values, and
what a verdict does to the machine (``docs/attestation.md``).

The decisions are ``metald.attestation.verify``'s; this module keeps their inputs and results
and applies the lifecycle: a failed attestation in a discovery boot holds the machine at once
(``attest-fail``); in a wipe boot, the wipe's end does (the wipe finishes first, so the disks
are clean whatever the verdict). A machine with an attestation key must pass in every wipe
boot: no attestation there is a hold too.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from sqlmodel import Session, col, select

from metald import machines
from metald.attestation.credential import CredentialError, make_credential
from metald.attestation.verify import (
    AttestationRefused,
    Golden,
    load_attestation_key,
    verify,
)
from metald.errors import Conflict, NotFound, Unprocessable
from metald.lifecycle import ATTESTED_BOOTS, DISCOVERY_BOOT, State, Trigger
from metald.store.models import (
    Attestation,
    AttestationGolden,
    AttestationKey,
    AttestationNonce,
    Machine,
    as_utc,
    utcnow,
)

#: Where an agent may enroll its machine's attestation key: the discovery boot only (never a
#: wipe or deploy boot, which run after a tenant had the machine).
ENROLL_STATES = DISCOVERY_BOOT
#: Where a failed attestation holds the machine at once (a discovery boot).
HOLD_NOW = DISCOVERY_BOOT
#: Where the agent may attest: discovery and wipe boots.
ATTEST_STATES = ATTESTED_BOOTS
PASSING = frozenset({"learned", "passed"})
NONCE_BYTES = 32
#: An activation challenge's row in attestation_nonces: its boot is marked so that a quote can
#: never spend it (``_take_nonce`` matches the boot exactly).
ACTIVATE = "activate:"


@dataclass(frozen=True)
class Challenge:
    """The credential the agent must activate in its TPM before metald accepts its AK."""

    #: tpm2-tools' credential file (tpm2_activatecredential -i).
    credential: bytes
    ak_name: str
    expires_at: datetime


def _subject(machine_id: str) -> str:
    return f"machine:{machine_id}"


def check_ek(ek_public_pem: str | None, ek_cert_der: bytes | None, roots_pem: bytes) -> str:
    """How far the EK certificate is checked: that it certifies the EK the agent sent, and
    (with ``attestation.ek_ca_file``) that it chains to one of those CAs. A certificate that
    fails either is refused (Unprocessable). The AK is bound to the EK by credential activation
    (``enroll_key``)."""
    if ek_cert_der is None:
        return "no EK certificate sent: not checked"
    try:
        cert = x509.load_der_x509_certificate(ek_cert_der)
    except ValueError as e:
        raise Unprocessable(f"ek_certificate is not a DER X.509 certificate: {e}") from None
    if ek_public_pem is not None:
        try:
            ek = serialization.load_pem_public_key(ek_public_pem.encode())
        except ValueError as e:
            raise Unprocessable(f"ek_public is not a PEM public key: {e}") from None
        if ek != cert.public_key():
            raise Unprocessable("the EK certificate certifies another key than ek_public")
    if not roots_pem:
        return "EK certificate matches the EK; chain not checked (attestation.ek_ca_file unset)"
    pool = x509.load_pem_x509_certificates(roots_pem)
    here = cert
    for _ in range(5):
        issuer = next((c for c in pool if c.subject == here.issuer and _issued_by(here, c)), None)
        if issuer is None:
            break
        if issuer.subject == issuer.issuer:
            return f"EK certificate chains to {issuer.subject.rfc4514_string()}"
        here = issuer
    raise Unprocessable(
        "the EK certificate does not chain to a CA in attestation.ek_ca_file: this TPM's "
        "maker is not trusted here; add its EK CA to that file if it should be"
    )


def _issued_by(cert: x509.Certificate, issuer: x509.Certificate) -> bool:
    try:
        cert.verify_directly_issued_by(issuer)
    except (ValueError, TypeError, Exception):  # InvalidSignature and unsupported algorithms
        return False
    return True


EkKey = rsa.RSAPublicKey | ec.EllipticCurvePublicKey


def _binding(secret: bytes, ak_name: bytes, ek: EkKey) -> str:
    """The challenge row's key: the secret bound to the AK's name and the EK it was wrapped
    for, so a secret recovered for one (AK, EK) pair enrolls no other."""
    spki = ek.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return hashlib.sha256(secret + ak_name + spki).hexdigest()


def _load_ek(ek_public_pem: str | None) -> EkKey:
    if ek_public_pem is None:
        raise Unprocessable(
            "send ek_public (tpm2_readpublic -f pem of the EK): metald binds the attestation "
            "key to the EK by credential activation"
        )
    try:
        ek = serialization.load_pem_public_key(ek_public_pem.encode())
    except ValueError as e:
        raise Unprocessable(f"ek_public is not a PEM public key: {e}") from None
    rsa_ok = isinstance(ek, rsa.RSAPublicKey) and ek.key_size >= 2048
    ecc_ok = isinstance(ek, ec.EllipticCurvePublicKey) and isinstance(ek.curve, ec.SECP256R1)
    if not (rsa_ok or ecc_ok):
        raise Unprocessable(
            "ek_public is neither an RSA key of 2048 bits or more nor a NIST P-256 key: "
            "metald activates credentials with the TCG default EKs (tpm2_createek -G rsa or "
            "-G ecc)"
        )
    assert isinstance(ek, rsa.RSAPublicKey | ec.EllipticCurvePublicKey)
    return ek


def enroll_key(
    s: Session,
    machine_id: str,
    *,
    ak_public: bytes,
    ek_public: str | None,
    ek_certificate: bytes | None,
    activation_secret: bytes | None,
    boot: str | None,
    roots_pem: bytes,
    ttl_s: float,
    actor: str,
    instance: str | None,
    now: datetime | None = None,
) -> AttestationKey | Challenge:
    """Enroll the machine's AK (trust on first use, in a discovery boot), in two calls: without
    ``activation_secret`` metald answers a Challenge (a secret wrapped to the EK for the AK's
    name: TPM2 MakeCredential); the agent's TPM recovers it (ActivateCredential) only if it
    holds that EK and an object with that name, and the second call sends it back. The AK is
    enrolled only when the secret matches. The same AK again is a no-op; another AK for an
    enrolled machine is refused (a TPM cleared by a tenant, or a machine swapped): a technician
    removes the old key first."""
    now = now or utcnow()
    m = machines.get_machine(s, machine_id)
    if State(m.state) not in ENROLL_STATES:
        raise Conflict(
            f"the machine is {m.state}; an attestation key is enrolled only in a discovery "
            "boot (inspecting or commissioning)"
        )
    try:
        key = load_attestation_key(ak_public)
    except AttestationRefused as e:
        raise Unprocessable(str(e)) from None
    row = s.get(AttestationKey, machine_id)
    if row is not None:
        if row.ak_public == ak_public.hex():
            return row
        raise Conflict(
            "this machine already has another attestation key; if its TPM was cleared or "
            "replaced, a technician removes the old key (DELETE "
            "/api/v1/machines/{id}/attestation-key) and the next discovery boot enrolls anew"
        )
    ek = _load_ek(ek_public)
    check = check_ek(ek_public, ek_certificate, roots_pem)
    marker = ACTIVATE + (boot or "")
    if activation_secret is None:
        secret = secrets.token_bytes(NONCE_BYTES)
        try:
            cred = make_credential(ek, key.name, secret)
        except CredentialError as e:
            raise Unprocessable(str(e)) from None
        for old in s.exec(
            select(AttestationNonce).where(AttestationNonce.machine_id == machine_id)
        ):
            if old.used_at is not None or as_utc(old.expires_at) <= now:
                s.delete(old)
        expires = now + timedelta(seconds=ttl_s)
        s.add(
            AttestationNonce(
                nonce=_binding(secret, key.name, ek),
                machine_id=machine_id,
                boot=marker,
                issued_at=now,
                expires_at=expires,
            )
        )
        return Challenge(cred.tpm2_tools_file(), key.name.hex(), expires)
    pending = s.get(AttestationNonce, _binding(activation_secret, key.name, ek))
    if (
        pending is None
        or pending.machine_id != machine_id
        or pending.boot != marker
        or pending.used_at is not None
        or as_utc(pending.expires_at) <= now
    ):
        raise Unprocessable(
            "the activated credential does not match: this attestation key is not in the TPM "
            "that holds this EK (or the challenge expired or was used); enroll again from the "
            "start"
        )
    s.delete(pending)
    cert_pem = (
        None
        if ek_certificate is None
        else x509.load_der_x509_certificate(ek_certificate)
        .public_bytes(serialization.Encoding.PEM)
        .decode()
    )
    check += "; AK bound to the EK by credential activation"
    row = AttestationKey(
        machine_id=machine_id,
        ak_public=ak_public.hex(),
        ak_name=key.name.hex(),
        ek_public=ek_public,
        ek_certificate=cert_pem,
        ek_check=check,
        enrolled_boot=boot,
    )
    s.add(row)
    machines.add_event(
        s,
        "attestation.key-enrolled",
        actor,
        machine_id=machine_id,
        reason=check,
        data={"ak_name": row.ak_name},
        instance=instance,
    )
    return row


def held_ak_name(s: Session, machine_id: str) -> str | None:
    """The name of the AK metald holds for this machine (hex), or None: the agent skips
    enrollment when its TPM's persistent AK has this name."""
    row = s.get(AttestationKey, machine_id)
    return None if row is None else row.ak_name


def issue_nonce(
    s: Session, machine_id: str, *, boot: str | None, ttl_s: float, now: datetime | None = None
) -> AttestationNonce:
    """A fresh nonce for this machine's boot; the machine's spent and expired ones go."""
    now = now or utcnow()
    m = machines.get_machine(s, machine_id)
    if State(m.state) not in ATTEST_STATES:
        raise Conflict(f"the machine is {m.state}; it attests only in discovery and wipe boots")
    for old in s.exec(select(AttestationNonce).where(AttestationNonce.machine_id == machine_id)):
        if old.used_at is not None or as_utc(old.expires_at) <= now:
            s.delete(old)
    row = AttestationNonce(
        nonce=secrets.token_bytes(NONCE_BYTES).hex(),
        machine_id=machine_id,
        boot=boot,
        issued_at=now,
        expires_at=now + timedelta(seconds=ttl_s),
    )
    s.add(row)
    return row


def _take_nonce(
    s: Session, machine_id: str, nonce_hex: str, boot: str | None, now: datetime
) -> bytes:
    """The issued nonce, spent now; refused when it is not this machine's, not this boot's,
    already used or expired."""
    row = s.get(AttestationNonce, nonce_hex.lower())
    if row is None or row.machine_id != machine_id or (row.boot or None) != (boot or None):
        raise AttestationRefused(
            "stale-nonce", "metald did not issue this nonce for this machine's boot"
        )
    if row.used_at is not None:
        raise AttestationRefused("stale-nonce", "this nonce was used already (a replay)")
    row.used_at = now
    if as_utc(row.expires_at) <= now:
        raise AttestationRefused("stale-nonce", "this nonce expired; fetch a new one")
    return bytes.fromhex(row.nonce)


def sku_subject(product: str) -> str:
    return f"sku:{product}"


def golden_for(s: Session, m: Machine) -> AttestationGolden | None:
    """The golden values a machine is checked against. Its SKU's (given by an operator) beat
    what the machine taught on first use; a technician's accept on this very machine made
    after the SKU's values were set beats those (a later, narrower decision)."""
    own = s.get(AttestationGolden, _subject(m.id))
    sku = s.get(AttestationGolden, sku_subject(m.product)) if m.product else None
    if sku is None:
        return own
    if own is not None and own.source == "accepted" and as_utc(own.set_at) > as_utc(sku.set_at):
        return own
    return sku


def submit(
    s: Session,
    machine_id: str,
    *,
    nonce: str,
    quote: bytes,
    signature: bytes,
    event_log: bytes,
    boot: str | None,
    pcrs: tuple[int, ...],
    actor: str,
    instance: str | None,
    now: datetime | None = None,
) -> Attestation:
    """Verify one submission and record it with its verdict (see the module docstring)."""
    now = now or utcnow()
    m = machines.get_machine(s, machine_id)
    state = State(m.state)
    if state not in ATTEST_STATES:
        raise Conflict(f"the machine is {m.state}; it attests only in discovery and wipe boots")
    key = s.get(AttestationKey, machine_id)
    if key is None:
        raise Conflict(
            "this machine has no attestation key: enroll it first (POST "
            "/api/v1/agent/attestation/key, in a discovery boot)"
        )
    golden_row = golden_for(s, m)
    row = Attestation(
        machine_id=machine_id, at=now, boot=boot, machine_state=m.state, status="", summary=""
    )
    try:
        issued = _take_nonce(s, machine_id, nonce, boot, now)
        verdict = verify(
            attestation_key=bytes.fromhex(key.ak_public),
            quote=quote,
            signature=signature,
            event_log=event_log,
            nonce=issued,
            golden=None if golden_row is None else Golden.from_dict(golden_row.golden),
            pcrs=pcrs,
        )
    except AttestationRefused as e:
        row.status, row.reason, row.summary = "refused", e.reason, str(e)
        s.add(row)
        if m.attested_boot is not None:
            m.attested_boot = None
            s.add(m)
        machines.add_event(
            s, "attestation.refused", actor, machine_id=m.id, reason=str(e),
            data={"reason": e.reason}, instance=instance,
        )  # fmt: skip
        return row
    row.status, row.summary = verdict.status, verdict.summary()
    row.verdict, row.measured = verdict.as_dict(), verdict.golden.as_dict()
    s.add(row)
    s.flush()
    if verdict.status == "learned":
        s.add(
            AttestationGolden(
                subject=_subject(m.id),
                golden=verdict.golden.as_dict(),
                source="first-use",
                set_by=actor,
                reason="learned from the machine's first attestation (trust on first use)",
                set_at=now,
                attestation_id=row.id,
            )
        )
    machines.add_event(
        s,
        f"attestation.{verdict.status}",
        actor,
        machine_id=m.id,
        reason=row.summary[:1000],
        data={"attestation_id": row.id, "changes": verdict.as_dict()["changes"]},
        instance=instance,
    )
    if verdict.status in PASSING:
        m.attested_boot = boot
        s.add(m)
    else:
        m.attested_boot = None
        s.add(m)
        if state in HOLD_NOW:
            machines.transition(
                s, m.id, Trigger.ATTEST_FAIL, actor=actor, reason=row.summary[:1000],
                expected_version=m.version, instance=instance, machine=m, commit=False,
            )  # fmt: skip
    return row


def wipe_hold(s: Session, m: Machine, boot: str | None) -> str | None:
    """Pure read: why a wipe that just finished must hold the machine instead of returning it
    to ready (its boot's attestation failed, or a machine with a key did not pass), or None."""
    if s.get(AttestationKey, m.id) is None:
        return None
    last = s.exec(
        select(Attestation)
        .where(Attestation.machine_id == m.id, Attestation.boot == boot)
        .order_by(col(Attestation.at).desc())
        .limit(1)
    ).first()
    if last is None:
        return "the wipe boot sent no attestation, and this machine has an attestation key"
    if last.status in PASSING:
        return None
    return f"the wipe boot's attestation {last.status}: {last.summary}"


def accept_golden(
    s: Session,
    machine_id: str,
    *,
    reason: str,
    actor: str,
    instance: str | None,
    expected_version: int | None = None,
) -> Machine:
    """A technician accepts the held machine's last measured boot as its new golden values
    (e.g. after a firmware rollout), with a reason; the machine goes back to ready."""
    m = machines.get_machine(s, machine_id)
    last = _last_measured(s, m)
    data: dict[str, Any] = {}
    if State(m.state) is State.ATTESTATION_FAILED and last is not None:
        now = utcnow()
        golden = s.get(AttestationGolden, _subject(m.id))
        if golden is None:
            golden = AttestationGolden(subject=_subject(m.id), golden={}, source="", set_by="")
        golden.golden, golden.source, golden.set_by = dict(last.measured or {}), "accepted", actor
        golden.reason, golden.set_at, golden.attestation_id = reason, now, last.id
        s.add(golden)
        last.accepted_by, last.accepted_reason, last.accepted_at = actor, reason, now
        s.add(last)
        data = {"attestation_id": last.id, "changes": (last.verdict or {}).get("changes", [])}
    out = machines.transition(
        s,
        m.id,
        Trigger.ACCEPT_GOLDEN,
        actor=actor,
        reason=reason,
        data=data,
        expected_version=expected_version,
        instance=instance,
        machine=m,
        commit=False,
    )
    if last is not None and data:
        out.attested_boot = last.boot
        s.add(out)
    return out


def _golden_view(g: AttestationGolden) -> dict[str, Any]:
    return {
        "subject": g.subject,
        "source": g.source,
        "set_by": g.set_by,
        "reason": g.reason,
        "set_at": g.set_at,
        "attestation_id": g.attestation_id,
        "pcrs": g.golden.get("pcrs", {}),
    }


def sku_view(g: AttestationGolden) -> dict[str, Any]:
    return {"product": g.subject.removeprefix("sku:"), **_golden_view(g)}


def list_skus(s: Session) -> list[dict[str, Any]]:
    rows = s.exec(
        select(AttestationGolden)
        .where(col(AttestationGolden.subject).startswith("sku:"))
        .order_by(col(AttestationGolden.subject))
    ).all()
    return [sku_view(g) for g in rows]


def get_sku(s: Session, product: str) -> AttestationGolden:
    row = s.get(AttestationGolden, sku_subject(product))
    if row is None:
        raise NotFound(f"no golden values for the SKU {product!r}")
    return row


def _last_measured(s: Session, m: Machine) -> Attestation | None:
    """The machine's last attestation that measured a boot (learned, passed or failed)."""
    return s.exec(
        select(Attestation)
        .where(Attestation.machine_id == m.id, col(Attestation.measured).is_not(None))
        .order_by(col(Attestation.at).desc())
        .limit(1)
    ).first()


def _measured_of(s: Session, m: Machine) -> Attestation:
    """The machine's last measured attestation, or a 422 saying it has none yet."""
    last = _last_measured(s, m)
    if last is None:
        raise Unprocessable(
            f"machine {m.id} has no measured boot yet: it attests in its next discovery boot"
        )
    return last


def _same(measured: dict[str, Any] | None, golden: dict[str, Any]) -> bool:
    """Whether a boot's measurements equal golden values on every PCR the golden values name."""
    got, want = (measured or {}).get("pcrs", {}), golden.get("pcrs", {})
    return bool(want) and all(got.get(k) == v for k, v in want.items())


def set_sku_golden(
    s: Session,
    product: str,
    *,
    reason: str,
    actor: str,
    instance: str | None,
    pcrs: tuple[int, ...],
    golden: dict[str, Any] | None = None,
    from_machine: str | None = None,
    releasable: Callable[[str], bool] = lambda _mid: True,
) -> tuple[AttestationGolden, list[str]]:
    """An operator gives the golden values of every machine of ``product`` (the SMBIOS
    product: a SKU), either as PCR values (and optionally their events) or as a reference
    machine's last measured boot (for example one booted after a firmware rollout). Machines
    of that SKU are checked against them instead of trust on first use. Machines of the SKU
    held in attestation-failed whose last measured boot equals the new values go back to
    ready (the rollout accepted once for all of them); their ids are returned."""
    attestation_id = None
    if (golden is None) == (from_machine is None):
        raise Unprocessable("give either golden (PCR values) or machine_id (a reference machine)")
    if from_machine is not None:
        ref = machines.get_machine(s, from_machine)
        if ref.product != product:
            raise Unprocessable(
                f"machine {ref.id} is a {ref.product!r}, not a {product!r}: its boot is "
                "not this SKU's"
            )
        last = _measured_of(s, ref)
        golden, attestation_id = dict(last.measured or {}), last.id
    assert golden is not None
    missing = sorted(set(pcrs) - {int(k) for k in golden.get("pcrs", {})})
    if missing:
        raise Unprocessable(
            f"the golden values lack PCR {', '.join(map(str, missing))}: "
            "attestation.pcrs compares them all"
        )
    now = utcnow()
    row = s.get(AttestationGolden, sku_subject(product))
    previous = None if row is None else row.golden.get("pcrs", {})
    if row is None:
        row = AttestationGolden(subject=sku_subject(product), golden={}, source="", set_by="")
    row.golden, row.source, row.set_by, row.reason = golden, "operator", actor, reason
    row.set_at, row.attestation_id = now, attestation_id
    s.add(row)
    machines.add_event(
        s, "attestation.sku-golden-set", actor, reason=reason, instance=instance,
        data={"product": product, "pcrs": golden.get("pcrs", {}), "previous": previous,
              "from_machine": from_machine, "attestation_id": attestation_id},
    )  # fmt: skip
    released = []
    held = s.exec(
        select(Machine).where(
            Machine.product == product, Machine.state == State.ATTESTATION_FAILED.value
        )
    ).all()
    for m in held:
        last = _measured_of(s, m)
        if not _same(last.measured, golden) or not releasable(m.id):
            continue
        last.accepted_by, last.accepted_reason, last.accepted_at = actor, reason, now
        s.add(last)
        out = machines.transition(
            s, m.id, Trigger.ACCEPT_GOLDEN, actor=actor,
            reason=f"its SKU's new golden values: {reason}",
            data={"attestation_id": last.id, "product": product},
            instance=instance, machine=m, commit=False,
        )  # fmt: skip
        out.attested_boot = last.boot
        s.add(out)
        released.append(m.id)
    return row, released


def remove_sku_golden(
    s: Session, product: str, *, reason: str, actor: str, instance: str | None
) -> None:
    """Forget a SKU's golden values: its machines go back to their own (learned or accepted)."""
    row = get_sku(s, product)
    s.delete(row)
    machines.add_event(
        s, "attestation.sku-golden-removed", actor, reason=reason, instance=instance,
        data={"product": product, "pcrs": row.golden.get("pcrs", {})},
    )  # fmt: skip


def remove_key(
    s: Session, machine_id: str, *, reason: str, actor: str, instance: str | None
) -> None:
    """Forget the machine's AK (its TPM was cleared or replaced): the next discovery boot
    enrolls a new one; golden values stay (the firmware did not change with the TPM)."""
    machines.get_machine(s, machine_id)
    row = s.get(AttestationKey, machine_id)
    if row is None:
        raise NotFound("this machine has no attestation key")
    s.delete(row)
    machines.add_event(
        s, "attestation.key-removed", actor, machine_id=machine_id, reason=reason,
        data={"ak_name": row.ak_name}, instance=instance,
    )  # fmt: skip


def view(s: Session, m: Machine, *, limit: int = 10) -> dict[str, Any]:
    """The machine's attestation: its key, golden values and last attestations."""
    key = s.get(AttestationKey, m.id)
    golden = golden_for(s, m)
    rows = s.exec(
        select(Attestation)
        .where(Attestation.machine_id == m.id)
        .order_by(col(Attestation.at).desc())
        .limit(limit)
    ).all()
    return {
        "machine_id": m.id,
        "attested": m.attested_boot is not None and m.attested_boot == m.boot_current,
        "key": None
        if key is None
        else {
            "ak_name": key.ak_name,
            "ek_check": key.ek_check,
            "enrolled_at": key.enrolled_at,
            "ek_certificate": key.ek_certificate is not None,
        },
        "golden": None if golden is None else _golden_view(golden),
        "attestations": [
            {
                "id": r.id,
                "at": r.at,
                "boot": r.boot,
                "machine_state": r.machine_state,
                "status": r.status,
                "reason": r.reason,
                "summary": r.summary,
                "changes": (r.verdict or {}).get("changes", []),
                "accepted_by": r.accepted_by,
                "accepted_reason": r.accepted_reason,
            }
            for r in rows
        ],
    }
