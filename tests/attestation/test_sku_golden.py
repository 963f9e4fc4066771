"""Per-SKU golden values given by an operator (``/api/v1/attestation/skus/{id}``), on both
store backends, with the real swtpm/OVMF fixtures: a new machine of the SKU is checked against
them instead of trust on first use (its first boot passes, learns nothing; a boot that differs
holds it at once); a firmware rollout is accepted once for the SKU, from a reference machine's
boot, with a reason, and the held machines measuring it go back to ready."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

from sqlmodel import select

from metald.attestation.verify import verify
from metald.lifecycle import State
from metald.machines import get_machine
from metald.store.models import AttestationGolden, AttestationNonce, Event
from tests.attestation.test_api_attestation import _enroll, _issued, _machine, _quote, _rearm
from tests.attestation.test_verify import boot, read

PRODUCT = "Standard PC (Q35 + ICH9, 2009)"  # what _machine gives its machines
PATH = f"/api/v1/attestation/skus/{quote(PRODUCT)}"


def _golden_of(fixture: str) -> dict[str, Any]:
    """The fixture boot's measurements as an operator would hand them in (PCRs and events)."""
    v = verify(attestation_key=read("a-ak.tpmt"), golden=None, **boot("a", fixture))
    return {k: v for k, v in v.golden.as_dict().items() if k in ("pcrs", "events")}


async def _attest(client: Any, store: Any, mid: str, token: str, fixture: str, b: str) -> Any:
    nonce = _issued(store, mid, fixture, b)
    r = await client.post(
        "/api/v1/agent/attestation",
        json=_quote("a", fixture, nonce),
        headers={"Authorization": f"Bearer {token}"},
    )
    assert r.status == 200, await r.text()
    return await r.json()


async def test_a_skus_golden_values_replace_trust_on_first_use(api: Any) -> None:
    client, tokens, store = api
    admin, tech = tokens.header("admin"), tokens.header("technician")
    golden = _golden_of("boot1")

    # Only admins set them, with a reason, and covering every PCR attestation compares.
    body = {"reason": "vendor's values for BIOS 1.0", "golden": golden}
    r = await client.put(PATH, json=body, headers=tech)
    assert r.status == 403, await r.text()
    r = await client.put(PATH, json={"golden": golden}, headers=admin)
    assert r.status == 422, await r.text()
    short = {"pcrs": {k: v for k, v in golden["pcrs"].items() if k != "7"}}
    r = await client.put(PATH, json={**body, "golden": short}, headers=admin)
    assert r.status == 422 and "PCR 7" in await r.text()
    r = await client.put(PATH, json={**body, "golden": {"pcrs": {"1": "zz"}}}, headers=admin)
    assert r.status == 422, await r.text()
    r = await client.put(PATH, json=body, headers=admin)
    assert r.status == 200, await r.text()
    out = await r.json()
    assert (out["product"], out["source"], out["released"]) == (PRODUCT, "operator", [])
    assert out["pcrs"] == golden["pcrs"]

    # A new machine of that SKU: its first attestation passes against the SKU's values and
    # teaches nothing (no trust on first use).
    mid, token = _machine(store, State.INSPECTING, "boot-1")
    r = await _enroll(client, {"Authorization": f"Bearer {token}"})
    assert r.status == 200, await r.text()
    first = await _attest(client, store, mid, token, "boot1", "boot-1")
    assert first["status"] == "passed", first
    with store.session() as s:
        assert s.get(AttestationGolden, f"machine:{mid}") is None
    r = await client.get(f"/api/v1/machines/{mid}/attestation", headers=tech)
    assert (await r.json())["golden"]["source"] == "operator"

    # Its next discovery boot measures a changed BootOrder: held at once, the SKU's events
    # name the change.
    token = _rearm(store, mid, State.INSPECTING, "boot-2")
    second = await _attest(client, store, mid, token, "boot2", "boot-2")
    assert (second["status"], second["state"]) == ("failed", "attestation-failed"), second
    assert ("changed", "BootOrder") in {
        (e["change"], e["label"]) for e in second["changes"][0]["events"]
    }

    # A reference machine must be of the SKU.
    other, _ = _machine(store, State.READY, "boot-x")
    with store.session() as s:
        m = get_machine(s, other)
        m.product = "another board"
        s.add(m)
        s.commit()
    rollout = {"reason": "BIOS 1.1 rolled out, change 77", "machine_id": other}
    r = await client.put(PATH, json=rollout, headers=admin)
    assert r.status == 422 and "another board" in await r.text()
    r = await client.put(PATH, json={**rollout, "golden": golden}, headers=admin)
    assert r.status == 422, await r.text()

    # The rollout accepted once for the SKU, from the held machine's own measured boot: it
    # and every held machine measuring the same go back to ready.
    r = await client.put(PATH, json={**rollout, "machine_id": mid}, headers=admin)
    assert r.status == 200, await r.text()
    out = await r.json()
    assert out["released"] == [mid] and out["attestation_id"]
    assert out["pcrs"] != golden["pcrs"]
    with store.session() as s:
        m = get_machine(s, mid)
        assert m.state == State.READY.value and m.attested_boot == "boot-2"
        kinds = [e.kind for e in s.exec(select(Event).order_by(Event.id))]
    assert kinds.count("attestation.sku-golden-set") == 2

    r = await client.get("/api/v1/attestation/skus", headers=tech)
    assert [x["product"] for x in (await r.json())["items"]] == [PRODUCT]
    r = await client.request("DELETE", PATH, json={"reason": "retired SKU"}, headers=admin)
    assert r.status == 204, await r.text()
    r = await client.get(PATH, headers=tech)
    assert r.status == 404


async def test_a_technicians_later_accept_on_one_machine_beats_the_skus_values(api: Any) -> None:
    client, tokens, store = api
    admin, tech = tokens.header("admin"), tokens.header("technician")
    r = await client.put(
        PATH, json={"reason": "vendor", "golden": _golden_of("boot1")}, headers=admin
    )
    assert r.status == 200
    mid, token = _machine(store, State.INSPECTING, "boot-1")
    assert (await _enroll(client, {"Authorization": f"Bearer {token}"})).status == 200
    assert (await _attest(client, store, mid, token, "boot2", "boot-1"))["status"] == "failed"
    r = await client.post(
        f"/api/v1/machines/{mid}/attestation/accept",
        json={"reason": "this one's boot order is intended"},
        headers=tech,
    )
    assert r.status == 200 and (await r.json())["state"] == "ready"
    token = _rearm(store, mid, State.INSPECTING, "boot-2")
    with store.session() as s:  # the fixture's quote again: its spent nonce issued anew
        s.delete(s.get(AttestationNonce, read("a-boot2.nonce").decode()))
        s.commit()
    assert (await _attest(client, store, mid, token, "boot2", "boot-2"))["status"] == "passed"
