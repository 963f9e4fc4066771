"""The claims API end to end on both backends: images, claims, scoping, progress, release,
wipe, retry, and the BMC steps (with a fake BMC service)."""

from __future__ import annotations

import json

from sqlmodel import select

from api.app import CTX_KEY
from metald.auth import issue_token
from metald.store.models import ApiToken, Machine
from tests.api_helpers import drain_steps, use_services
from tests.claims.fakes import FakeBmc
from tests.claims.helpers import DISK_SPEC, add_ready, boot_token, wipe_evidence

KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGJ0ZXN0a2V5 ops@example"


def _agent(store, machine_id: str) -> dict[str, str]:  # type: ignore[no-untyped-def]
    with store.session() as s:
        _row, secret = issue_token(s, name="agent", role="agent", scope=[machine_id])
    return {"Authorization": f"Bearer {secret}"}


def _machine(store, machine_id: str) -> Machine:  # type: ignore[no-untyped-def]
    with store.session() as s:
        m = s.get(Machine, machine_id)
        assert m is not None
        return m


async def _image(client, tokens) -> str:  # type: ignore[no-untyped-def]
    r = await client.post(
        "/api/v1/images",
        json={"name": "node", "kind": "disk", **DISK_SPEC},
        headers=tokens.header("technician"),
    )
    assert r.status == 201, await r.text()
    return (await r.json())["id"]


async def test_images_catalog(api) -> None:  # type: ignore[no-untyped-def]
    client, tokens, _ = api
    image_id = await _image(client, tokens)
    r = await client.post(
        "/api/v1/images",
        json={"name": "node", "kind": "disk", **DISK_SPEC},
        headers=tokens.header("admin"),
    )
    assert r.status == 409 and "already exists" in (await r.json())["detail"]
    r = await client.post(
        "/api/v1/images",
        json={"name": "bad", "kind": "disk", "url": "http://x/y", "sha256": "nothex"},
        headers=tokens.header("admin"),
    )
    assert r.status == 422 and "64 hexadecimal" in (await r.json())["detail"]
    r = await client.post(
        "/api/v1/images",
        json={"name": "ram", "kind": "stateless", "kernel": "n/vmlinuz", "rootfs": "n/root.sq"},
        headers=tokens.header("admin"),
    )
    assert r.status == 201
    assert (await r.json())["spec"] == {
        "kernel": "n/vmlinuz",
        "rootfs": "n/root.sq",
        "kernel_args": {},
        "arch": "amd64",
    }
    r = await client.get("/api/v1/images", headers=tokens.header("orchestrator"))
    assert [i["name"] for i in (await r.json())["items"]] == ["node", "ram"]
    r = await client.get(f"/api/v1/images/{image_id}", headers=tokens.header("orchestrator"))
    assert (await r.json())["spec"]["sha256"] == DISK_SPEC["sha256"]


async def test_claim_progress_release_wipe(api) -> None:  # type: ignore[no-untyped-def]
    client, tokens, store = api
    bmc = FakeBmc(power_state="off")
    use_services(client.server.app[CTX_KEY], bmc=bmc)
    image_id = await _image(client, tokens)
    add_ready(store, 3, labels={"pool": "train"})
    body = {
        "tenant_id": tokens.tenant_a,
        "count": 2,
        "selector": {"gpu_model": "NVIDIA H100*", "min_gpu_count": 8, "labels": {"pool": "train"}},
        "image_id": image_id,
        "idempotency_key": "job-1",
        "ssh_authorized_keys": [KEY],
    }
    orch = tokens.header("orchestrator")
    r = await client.post("/api/v1/claims", json=body, headers=orch)
    assert r.status == 201, await r.text()
    claim = await r.json()
    assert claim["state"] == "allocated" and not claim["replayed"]
    assert [m["state"] for m in claim["machines"]] == ["provisioning"] * 2
    ids = [m["id"] for m in claim["machines"]]
    await drain_steps(client)
    # One-time PXE boot, then power on (the machines were off), per machine.
    assert sorted(bmc.calls) == sorted(
        [(i, "boot", "pxe") for i in ids]
        + [(i, "power", "status") for i in ids]
        + [(i, "power", "on") for i in ids]
    )

    r = await client.post("/api/v1/claims", json=body, headers=orch)
    again = await r.json()
    assert again["id"] == claim["id"] and again["replayed"]
    header_key = {k: v for k, v in body.items() if k != "idempotency_key"}
    r = await client.post(
        "/api/v1/claims", json=header_key, headers={**orch, "Idempotency-Key": "job-1"}
    )
    assert (await r.json())["id"] == claim["id"]
    r = await client.post("/api/v1/claims", json={**body, "count": 1}, headers=orch)
    assert r.status == 409 and "different request" in (await r.json())["detail"]
    r = await client.post(
        "/api/v1/claims", json={**body, "idempotency_key": "x", "count": 5}, headers=orch
    )
    problem = await r.json()
    assert r.status == 422 and problem["matched"] == 3 and problem["available"] == 1
    r = await client.post(
        "/api/v1/claims",
        json={**body, "idempotency_key": "y", "ssh_authorized_keys": ["rm -rf /"]},
        headers=orch,
    )
    assert r.status == 422 and "ssh_authorized_keys" in (await r.json())["detail"]

    # The deploy agent asks what to write, and the first-boot metadata.
    agent = _agent(store, ids[0])
    r = await client.get("/api/v1/agent/provision", headers=agent)
    todo = await r.json()
    assert todo["action"] == "provision" and todo["image"]["sha256"] == DISK_SPEC["sha256"]
    user_data = todo["nocloud"]["user-data"]
    assert user_data.startswith("#cloud-config\n")
    assert json.loads(user_data.split("\n", 1)[1])["ssh_authorized_keys"] == [KEY]
    assert json.loads(todo["nocloud"]["meta-data"])["instance-id"] == ids[0]

    # Progress, then done: provisioned, booting from disk from now on.
    r = await client.post(
        "/api/v1/agent/progress",
        json={"phase": "write", "percent": 42.5, "bytes": 1 << 30, "rate_bps": 5e8},
        headers=agent,
    )
    assert r.status == 200 and (await r.json())["state"] == "provisioning"
    r = await client.get(f"/api/v1/claims/{claim['id']}", headers=orch)
    shown = {m["id"]: m for m in (await r.json())["machines"]}
    assert shown[ids[0]]["progress"]["percent"] == 42.5
    assert shown[ids[0]]["progress"]["bytes"] == 1 << 30
    assert shown[ids[1]]["progress"] is None
    r = await client.post(
        "/api/v1/agent/progress", json={"phase": "verify", "done": True}, headers=agent
    )
    assert (await r.json())["state"] == "provisioned"
    assert _machine(store, ids[0]).boot_intent == {"action": "local"}
    r = await client.get("/api/v1/agent/provision", headers=agent)
    assert (await r.json())["action"] == "none"
    r = await client.post("/api/v1/agent/progress", json={"phase": "write"}, headers=agent)
    assert r.status == 409 and "only while it is provisioning" in (await r.json())["detail"]

    # Release: tokens revoked first, then wiping with the wipe intent; through the BMC the
    # machine is powered off (confirmed) before its wipe boot is armed, then PXE and on.
    bmc.calls.clear()
    bmc.power_state = "on"
    r = await client.post(f"/api/v1/claims/{claim['id']}/release", headers=orch)
    released = await r.json()
    assert r.status == 200 and released["state"] == "released"
    assert {m["state"] for m in released["machines"]} == {"wiping"}
    r = await client.get("/api/v1/whoami", headers=agent)
    assert r.status == 401
    with store.session() as s:
        live = [
            t
            for t in s.exec(select(ApiToken).where(ApiToken.role == "agent"))
            if t.revoked_at is None
        ]
        assert not [t for t in live if set(t.scope) & set(ids)]
    await drain_steps(client)
    for i in ids:
        mine = [c[1:] for c in bmc.calls if c[0] == i]
        assert mine == [
            ("power", "status"),
            ("power", "off"),
            ("power", "status"),
            ("boot", "pxe"),
            ("power", "on"),
        ]
    assert _machine(store, ids[0]).boot_intent["action"] == "wipe"  # type: ignore[index]
    assert _machine(store, ids[0]).tenant_id is None  # detached at release

    # Wipe done, from the wipe boot's agent, with evidence for every recorded disk: ready, no
    # tenant, no claim. Wipe error: wipe-failed, never ready.
    wipe0 = {"Authorization": f"Bearer {boot_token(store, ids[0])}"}
    r = await client.post(
        "/api/v1/agent/progress",
        json={"phase": "wipe", "done": True, "disks": wipe_evidence()},
        headers=wipe0,
    )
    assert (await r.json())["state"] == "ready", await r.text()
    m = _machine(store, ids[0])
    assert (m.tenant_id, m.claim_id, m.boot_intent, m.wipe_required) == (None, None, None, False)
    r = await client.post(
        "/api/v1/agent/progress",
        json={"phase": "wipe", "error": "nvme1n1: format failed"},
        headers={"Authorization": f"Bearer {boot_token(store, ids[1])}"},
    )
    assert (await r.json())["state"] == "wipe-failed"
    assert _machine(store, ids[1]).last_error == "nvme1n1: format failed"

    # Retry (technician): wiping again, and taken and rebooted into the wipe image.
    bmc.calls.clear()
    r = await client.post(
        f"/api/v1/machines/{ids[1]}/retry", json={}, headers=tokens.header("technician")
    )
    assert r.status == 200 and (await r.json())["state"] == "wiping"
    await drain_steps(client)
    assert (ids[1], "power", "on") in bmc.calls
    r = await client.post(
        f"/api/v1/machines/{ids[1]}/retry", json={}, headers=tokens.header("technician")
    )
    assert r.status == 409 and "only to a failed state" in (await r.json())["detail"]
    r = await client.post(
        "/api/v1/agent/progress",
        json={"phase": "wipe", "done": True, "disks": wipe_evidence()},
        headers={"Authorization": f"Bearer {boot_token(store, ids[1])}"},
    )
    assert (await r.json())["state"] == "ready"
    r = await client.post(f"/api/v1/claims/{claim['id']}/release", headers=orch)
    assert (await r.json())["machines"] == []


async def test_orchestrators_see_only_their_tenants_claims(api) -> None:  # type: ignore[no-untyped-def]
    client, tokens, store = api
    image_id = await _image(client, tokens)
    add_ready(store, 2)
    r = await client.post(
        "/api/v1/claims",
        json={"tenant_id": tokens.tenant_b, "count": 1, "image_id": image_id},
        headers=tokens.header("orchestrator"),
    )
    assert r.status == 404 and "scope" in (await r.json())["detail"]
    r = await client.post(
        "/api/v1/claims",
        json={"tenant_id": tokens.tenant_b, "count": 1, "image_id": image_id},
        headers=tokens.header("orchestrator_other"),
    )
    assert r.status == 201
    globex_claim = await r.json()
    mine = tokens.header("orchestrator")
    r = await client.get(f"/api/v1/claims/{globex_claim['id']}", headers=mine)
    assert r.status == 404
    r = await client.post(f"/api/v1/claims/{globex_claim['id']}/release", headers=mine)
    assert r.status == 404
    r = await client.get("/api/v1/claims", headers=mine)
    assert (await r.json())["items"] == []
    r = await client.get("/api/v1/claims", headers=tokens.header("technician"))
    assert [c["id"] for c in (await r.json())["items"]] == [globex_claim["id"]]
    machine = globex_claim["machines"][0]["id"]
    r = await client.get(f"/api/v1/machines/{machine}", headers=mine)
    assert r.status == 404
    assert _machine(store, machine).state == "provisioning"  # the other release changed nothing
