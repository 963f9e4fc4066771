"""Attestation through the API on both store backends, with the real swtpm/OVMF fixtures: a
machine enrolls its AK and learns its golden values in a discovery boot; after a tenancy the
wipe boot's attestation (BootOrder changed by the tenant) fails, and the finished wipe holds
the machine in attestation-failed naming PCR 1; a replay and another TPM's quote are refused;
a technician accepts the new measurements with a reason; claims may require attested."""

from __future__ import annotations

import base64
from typing import Any
from unittest.mock import patch

from sqlmodel import select

from metald.enrollment import mint_agent_token
from metald.lifecycle import State
from metald.machines import get_machine
from metald.provision import attestation as provision_att
from metald.store import Store
from metald.store.models import AttestationKey, AttestationNonce, Event, Machine
from tests.attestation.test_verify import read
from tests.claims.helpers import inventory, wipe_evidence


def _b64(name: str) -> str:
    return base64.b64encode(read(name)).decode()


def _machine(store: Store, state: State, boot: str, **cols: Any) -> tuple[str, str]:
    """A machine in ``state`` whose boot ``boot`` just fetched its script: (id, agent token)."""
    with store.session() as s:
        m = Machine(
            state=state.value,
            boot_armed=boot,
            inventory=inventory(),
            product="Standard PC (Q35 + ICH9, 2009)",
            **cols,
        )
        s.add(m)
        s.commit()
        token = mint_agent_token(s, get_machine(s, m.id), actor="test", ttl_s=600)
        assert token is not None
        return m.id, token


def _rearm(store: Store, mid: str, state: State, boot: str, **cols: Any) -> str:
    """The machine moved on (by the lifecycle tested elsewhere) to ``state``, booting anew."""
    with store.session() as s:
        m = get_machine(s, mid)
        m.state, m.boot_armed = state.value, boot
        for k, v in cols.items():
            setattr(m, k, v)
        s.add(m)
        s.commit()
        token = mint_agent_token(s, get_machine(s, mid), actor="test", ttl_s=600)
        assert token is not None
        return token


def _issued(store: Store, mid: str, fixture_boot: str, boot: str) -> str:
    """The nonce the fixture's quote was taken over, as metald issued it for ``boot`` (the
    fixtures' quotes were made over their own nonces, so the test stands in for issuing)."""
    from datetime import timedelta

    from metald.store.models import utcnow

    nonce = read(f"a-{fixture_boot}.nonce").decode()
    with store.session() as s:
        s.add(
            AttestationNonce(
                nonce=nonce,
                machine_id=mid,
                boot=boot,
                expires_at=utcnow() + timedelta(minutes=5),
            )
        )
        s.commit()
    return nonce


#: The secret metald wraps in the activation challenge, fixed for these tests: the fixtures'
#: TPMs are not running here, so the test answers the challenge in their stead. The real TPM
#: activating (and refusing) it is tests/attestation/test_agent_attest.py and test_credential.py.
SECRET = bytes(range(32))


async def _enroll(client: Any, headers: dict[str, str], machine: str = "a", **extra: str) -> Any:
    """Both calls of the enrollment: the challenge, then the secret back."""
    body = {
        "ak_public": _b64(f"{machine}-ak.tpmt"),
        "ek_public": read(f"{machine}-ek.pem").decode(),
    }
    body.update(extra)
    with patch.object(provision_att.secrets, "token_bytes", lambda n: SECRET[:n]):
        r = await client.post("/api/v1/agent/attestation/key", json=body, headers=headers)
    assert r.status == 200, await r.text()
    out = await r.json()
    assert out["status"] == "challenge" and base64.b64decode(out["credential"])[:4] == (
        b"\xba\xdc\xc0\xde"
    )
    r = await client.post(
        "/api/v1/agent/attestation/key",
        json={**body, "activation_secret": SECRET.hex()},
        headers=headers,
    )
    return r


def _quote(machine: str, boot: str, nonce: str) -> dict[str, str]:
    return {
        "nonce": nonce,
        "quote": _b64(f"{machine}-{boot}.quote.msg"),
        "signature": _b64(f"{machine}-{boot}.quote.sig"),
        "event_log": _b64(f"{machine}-{boot}.eventlog"),
    }


async def test_enroll_learn_then_a_changed_boot_order_holds_the_wiped_machine(api: Any) -> None:
    client, tokens, store = api
    mid, token = _machine(store, State.INSPECTING, "boot-1")
    agent = {"Authorization": f"Bearer {token}"}

    # First discovery boot: the AK enrolls, with its EK and EK certificate (swtpm's).
    r = await _enroll(client, agent, ek_certificate=_b64("a-ek-cert.der"))
    assert r.status == 200, await r.text()
    out = await r.json()
    assert (out["status"], out["ak_name"]) == ("enrolled", read("a-ak.name").hex())
    assert out["ek_check"].endswith("AK bound to the EK by credential activation")

    # A nonce from metald: fresh, 32 bytes, with the PCRs to quote.
    r = await client.post("/api/v1/agent/attestation/nonce", headers=agent)
    assert r.status == 200, await r.text()
    body = await r.json()
    assert len(body["nonce"]) == 64 and body["pcrs"] == [0, 1, 2, 3, 5, 6, 7]
    assert body["ak_name"] == read("a-ak.name").hex()  # the agent skips enrolling next boot

    # The first attestation teaches the golden values (trust on first use).
    nonce = _issued(store, mid, "boot1", "boot-1")
    r = await client.post(
        "/api/v1/agent/attestation", json=_quote("a", "boot1", nonce), headers=agent
    )
    assert r.status == 200, await r.text()
    assert (await r.json())["status"] == "learned"

    # The same quote again: its nonce is spent (a replay).
    r = await client.post(
        "/api/v1/agent/attestation", json=_quote("a", "boot1", nonce), headers=agent
    )
    out = await r.json()
    assert (out["status"], out["reason"]) == ("refused", "stale-nonce"), out

    # After a tenancy, the wipe boot: the tenant changed the BootOrder.
    token = _rearm(store, mid, State.WIPING, "boot-2", wipe_required=True)
    wipe = {"Authorization": f"Bearer {token}"}
    # Another machine's TPM quoting over this boot's nonce: refused, nothing learned.
    other = _issued(store, mid, "boot2", "boot-2")
    sub = _quote("b", "boot1", other)
    r = await client.post("/api/v1/agent/attestation", json=sub, headers=wipe)
    out = await r.json()
    assert (out["status"], out["reason"]) == ("refused", "bad-signature"), out
    # An AK enrollment from a wipe boot is refused (only discovery boots enroll).
    r = await client.post(
        "/api/v1/agent/attestation/key", json={"ak_public": _b64("b-ak.tpmt")}, headers=wipe
    )
    assert r.status == 409, await r.text()

    with store.session() as s:  # the spent nonce row is gone on the next issue; issue anew
        s.delete(s.get(AttestationNonce, other))
        s.commit()
    nonce = _issued(store, mid, "boot2", "boot-2")
    r = await client.post(
        "/api/v1/agent/attestation", json=_quote("a", "boot2", nonce), headers=wipe
    )
    out = await r.json()
    assert out["status"] == "failed", out
    assert out["state"] == "wiping"  # the wipe finishes first
    assert [c["pcr"] for c in out["changes"]] == [1]
    assert {(e["change"], e["label"]) for e in out["changes"][0]["events"]} >= {
        ("changed", "BootOrder"),
        ("added", "Boot0001"),
    }

    # The wipe ends: disks clean, but the machine is held, not ready.
    r = await client.post(
        "/api/v1/agent/progress",
        json={"phase": "wipe", "done": True, "disks": wipe_evidence()},
        headers=wipe,
    )
    assert r.status == 200, await r.text()
    assert (await r.json())["state"] == "attestation-failed"
    with store.session() as s:
        m = get_machine(s, mid)
        assert m.wipe_required is False and m.tenant_id is None
        assert m.last_error is not None and "PCR 1" in m.last_error and "BootOrder" in m.last_error

    # Staff see it: the key, golden values and the failed attestation's changes.
    r = await client.get(f"/api/v1/machines/{mid}/attestation", headers=tokens.header("technician"))
    view = await r.json()
    assert view["attested"] is False
    assert view["key"]["ek_check"].startswith("EK certificate matches the EK")
    assert view["golden"]["source"] == "first-use"
    assert [a["status"] for a in view["attestations"]] == [
        "failed",
        "refused",
        "refused",
        "learned",
    ]

    # Accepting needs a reason; then the new measurements are the golden values, and ready.
    r = await client.post(
        f"/api/v1/machines/{mid}/attestation/accept", json={}, headers=tokens.header("technician")
    )
    assert r.status == 422
    r = await client.post(
        f"/api/v1/machines/{mid}/attestation/accept",
        json={"reason": "boot option added by the firmware team, ticket 42"},
        headers=tokens.header("technician"),
    )
    assert r.status == 200, await r.text()
    assert (await r.json())["state"] == "ready"
    r = await client.get(f"/api/v1/machines/{mid}/attestation", headers=tokens.header("admin"))
    view = await r.json()
    assert view["golden"]["source"] == "accepted"
    assert view["golden"]["reason"] == "boot option added by the firmware team, ticket 42"
    assert view["attested"] is True  # its current boot's measurements are the golden ones
    with store.session() as s:
        kinds = [
            e.kind for e in s.exec(select(Event).where(Event.machine_id == mid).order_by(Event.id))
        ]
    assert "attestation.failed" in kinds and "attestation.key-enrolled" in kinds


async def test_a_failed_discovery_attestation_holds_the_machine_at_once(api: Any) -> None:
    client, _tokens, store = api
    mid, token = _machine(store, State.INSPECTING, "boot-1")
    agent = {"Authorization": f"Bearer {token}"}
    r = await _enroll(client, agent)
    assert r.status == 200, await r.text()
    nonce = _issued(store, mid, "boot1", "boot-1")
    r = await client.post(
        "/api/v1/agent/attestation", json=_quote("a", "boot1", nonce), headers=agent
    )
    assert (await r.json())["status"] == "learned"
    token = _rearm(store, mid, State.INSPECTING, "boot-2")
    agent = {"Authorization": f"Bearer {token}"}
    nonce = _issued(store, mid, "boot2", "boot-2")
    r = await client.post(
        "/api/v1/agent/attestation", json=_quote("a", "boot2", nonce), headers=agent
    )
    out = await r.json()
    assert (out["status"], out["state"]) == ("failed", "attestation-failed"), out
    # Out of service: the phase changed, so the boot's agent token is revoked.
    r = await client.post("/api/v1/agent/attestation/nonce", headers=agent)
    assert r.status == 401


async def test_a_wipe_without_attestation_holds_a_machine_with_a_key(api: Any) -> None:
    client, _tokens, store = api
    mid, token = _machine(store, State.INSPECTING, "boot-1")
    r = await _enroll(client, {"Authorization": f"Bearer {token}"})
    assert r.status == 200
    token = _rearm(store, mid, State.WIPING, "boot-2", wipe_required=True)
    r = await client.post(
        "/api/v1/agent/progress",
        json={"phase": "wipe", "done": True, "disks": wipe_evidence()},
        headers={"Authorization": f"Bearer {token}"},
    )
    assert (await r.json())["state"] == "attestation-failed"


async def test_an_ek_certificate_for_another_key_is_refused(api: Any) -> None:
    client, _tokens, store = api
    _mid, token = _machine(store, State.INSPECTING, "boot-1")
    r = await client.post(
        "/api/v1/agent/attestation/key",
        json={
            "ak_public": _b64("a-ak.tpmt"),
            "ek_public": read("a-ek.pem").decode(),
            "ek_certificate": _b64("b-ek-cert.der"),
        },
        headers={"Authorization": f"Bearer {token}"},
    )
    assert r.status == 422, await r.text()


async def test_an_activation_secret_that_does_not_match_is_refused(api: Any) -> None:
    """Credential activation: a wrong secret (the AK is not in the EK's TPM), or the right one
    sent for another AK, enrolls nothing. Fails on the old code (no challenge at all)."""
    client, _tokens, store = api
    mid, token = _machine(store, State.INSPECTING, "boot-1")
    agent = {"Authorization": f"Bearer {token}"}
    body = {"ak_public": _b64("a-ak.tpmt"), "ek_public": read("a-ek.pem").decode()}
    with patch.object(provision_att.secrets, "token_bytes", lambda n: SECRET[:n]):
        r = await client.post("/api/v1/agent/attestation/key", json=body, headers=agent)
    assert (await r.json())["status"] == "challenge"
    r = await client.post(
        "/api/v1/agent/attestation/key",
        json={**body, "activation_secret": "00" * 32},
        headers=agent,
    )
    assert r.status == 422, await r.text()
    other = {"ak_public": _b64("b-ak.tpmt"), "ek_public": read("a-ek.pem").decode()}
    r = await client.post(
        "/api/v1/agent/attestation/key",
        json={**other, "activation_secret": SECRET.hex()},
        headers=agent,
    )
    assert r.status == 422, await r.text()
    # Without an EK metald cannot challenge: refused.
    r = await client.post(
        "/api/v1/agent/attestation/key", json={"ak_public": _b64("a-ak.tpmt")}, headers=agent
    )
    assert r.status == 422, await r.text()
    with store.session() as s:
        assert s.get(AttestationKey, mid) is None
