"""The tenancy routes through HTTP on both backends."""

from __future__ import annotations

from api.app import CTX_KEY
from metald.store.models import utcnow
from metald.tenants import keys
from tests.api_helpers import use_services
from tests.tenants.conftest import provisioned


async def test_hub_token_join_flow(api) -> None:  # type: ignore[no-untyped-def]
    client, tokens, store = api
    admin, orch = tokens.header("admin"), tokens.header("orchestrator")
    hub_url = f"/api/v1/tenants/{tokens.tenant_a}/hub"
    r = await client.get(hub_url, headers=admin)
    assert r.status == 404
    r = await client.post(hub_url, json={"endpoint_host": "10.99.0.1"}, headers=admin)
    assert r.status == 201, await r.text()
    hub = await r.json()
    assert "private" not in str(hub).lower()
    r = await client.post(hub_url, json={"endpoint_host": "10.99.0.1"}, headers=admin)
    assert r.status == 409
    r = await client.get(hub_url, headers=tokens.header("orchestrator_other"))
    assert r.status == 404
    provisioned(store, tokens.machine_a)
    url = f"/api/v1/machines/{tokens.machine_a}/join-token"
    r = await client.post(url, json={}, headers=tokens.header("orchestrator_other"))
    assert r.status == 404
    r = await client.post(url, json={"ttl_seconds": 600}, headers=orch)
    assert r.status == 201
    secret = (await r.json())["token"]
    assert secret.startswith("mjt_")

    r = await client.post("/api/v1/join", json={"token": secret, "public_key": "nope"})
    assert r.status == 422
    assert "public_key" in (await r.json())["detail"]
    calls: list[tuple[str, ...]] = []

    class RecordingHubs:
        def add_peer(self, tenant_id: str, public_key: str, address: str) -> None:
            calls.append(("add", tenant_id, public_key, address))

        def remove_peer(self, tenant_id: str, public_key: str) -> None:
            calls.append(("remove", tenant_id, public_key))

    use_services(client.app[CTX_KEY], tenant_hubs=RecordingHubs())
    pub = keys.public_key(keys.generate_private_key())
    r = await client.post("/api/v1/join", json={"token": secret, "public_key": pub})
    assert r.status == 200, await r.text()
    body = await r.json()
    address = body["overlay_address"].split("/")[0]
    assert calls == [("add", tokens.tenant_a, pub, address)]
    assert body["hub"]["public_key"] == hub["public_key"]
    assert body["overlay_address"].endswith("/24")
    assert body["cluster"]["kind"] == "slurm"
    r = await client.post("/api/v1/join", json={"token": secret, "public_key": pub})
    assert r.status == 409
    assert "already used" in (await r.json())["detail"]

    r = await client.get(hub_url, headers=orch)
    peers = (await r.json())["peers"]
    assert [(p["machine_id"], p["public_key"]) for p in peers] == [(tokens.machine_a, pub)]
    # The node is on its hub: nobody gets a token that would take its place...
    for role in ("orchestrator", "admin"):
        r = await client.post(url, json={}, headers=tokens.header(role))
        assert r.status == 409 and "active peer" in (await r.json())["detail"], role
    # ...until its tenant's orchestrator (or an admin) revokes the peer, on the record.
    peer_url = f"/api/v1/machines/{tokens.machine_a}/peer"
    for role, status in (("technician", 403), ("orchestrator_other", 404)):
        r = await client.delete(peer_url, headers=tokens.header(role))
        assert r.status == status, role
    calls.clear()
    r = await client.delete(peer_url, headers=orch)
    assert r.status == 200 and (await r.json())["public_key"] == pub
    assert calls == [("remove", tokens.tenant_a, pub)]
    r = await client.delete(peer_url, headers=orch)
    assert r.status == 404
    r = await client.post(url, json={}, headers=orch)
    assert r.status == 201
    pub2 = keys.public_key(keys.generate_private_key())
    r = await client.post(
        "/api/v1/join", json={"token": (await r.json())["token"], "public_key": pub2}
    )
    assert r.status == 200, await r.text()
    r = await client.get("/api/v1/openapi.json")
    assert "/api/v1/join" in (await r.json())["paths"]


async def test_a_technician_cannot_mint_a_join_token(api) -> None:  # type: ignore[no-untyped-def]
    """A join token yields the tenant's munge key and a place on its hub: a technician (fleet
    staff, not the tenant's) gets 403 and no token is recorded."""
    from sqlmodel import select

    from metald.store.models import JoinToken

    client, tokens, store = api
    r = await client.post(
        f"/api/v1/tenants/{tokens.tenant_a}/hub",
        json={"endpoint_host": "10.99.0.1"},
        headers=tokens.header("admin"),
    )
    assert r.status == 201
    provisioned(store, tokens.machine_a)
    url = f"/api/v1/machines/{tokens.machine_a}/join-token"
    r = await client.post(url, json={}, headers=tokens.header("technician"))
    assert r.status == 403
    body = await r.json()
    assert "admin, orchestrator" in body["detail"]
    with store.session() as s:
        assert s.exec(select(JoinToken)).all() == []
    r = await client.post(url, json={}, headers=tokens.header("admin"))
    assert r.status == 201


async def test_provision_instruction_carries_a_fresh_join_token(api) -> None:  # type: ignore[no-untyped-def]
    """The deploy agent (or a stateless node) of a tenant's machine gets the join URL and a
    one-time token; asking again revokes the unused older one; the token joins once."""
    import json

    from sqlmodel import select

    from metald.auth import issue_token
    from metald.claims.allocation import Selector, create_claim
    from metald.provision import netboot
    from metald.store.models import Machine
    from tests.claims.helpers import DEPLOY, add_image, add_ready

    client, tokens, store = api
    admin = tokens.header("admin")
    r = await client.post(
        f"/api/v1/tenants/{tokens.tenant_a}/hub", json={"endpoint_host": "10.99.0.1"}, headers=admin
    )
    assert r.status == 201
    add_ready(store, 1, gpu_model="NVIDIA B200", prefix="join")
    with store.session() as s:
        claim, _ = create_claim(
            s, tokens.tenant_a, 1, Selector(gpu_model="NVIDIA B200"), add_image(store), None,
            "t", deploy=DEPLOY,
        )  # fmt: skip
        mid = s.exec(select(Machine).where(Machine.claim_id == claim.id)).one().id
        assert netboot.start_provisioning(s, [mid], actor="t") == [mid]
        _row, agent_secret = issue_token(s, name="agent", role="agent", scope=[mid])
    agent = {"Authorization": f"Bearer {agent_secret}"}

    # Over HTTPS the join info carries the CA the node pins, in the seed too (disk nodes).
    from metald.claims.provisioning import next_step

    pin = "sha256:" + "ab" * 32
    with store.session() as s:
        step = next_step(
            s, s.get(Machine, mid), mid, actor="t", join_url="https://10.0.0.1:8443",
            join_token_ttl_s=600, join_ca=pin,
        )  # fmt: skip
        s.commit()
    assert step.join is not None and step.join["ca"] == pin
    assert step.nocloud is not None
    user = json.loads(step.nocloud["user-data"].split("\n", 1)[1])
    assert json.loads(user["write_files"][0]["content"])["ca"] == pin

    r = await client.get("/api/v1/agent/provision", headers=agent)
    first = (await r.json())["join"]
    host = f"{client.server.host}:{client.server.port}"
    assert first["url"] == f"http://{host}" and first["token"].startswith("mjt_")
    r = await client.get("/api/v1/agent/provision", headers=agent)
    todo = await r.json()
    second = todo["join"]
    assert second["token"] != first["token"]
    user = json.loads(todo["nocloud"]["user-data"].split("\n", 1)[1])
    (entry,) = user["write_files"]
    assert entry["path"] == "/etc/metald/join.json" and json.loads(entry["content"]) == second
    assert "ca" not in second  # asked over plain HTTP: no CA to pin

    pub = keys.public_key(keys.generate_private_key())
    r = await client.post("/api/v1/join", json={"token": first["token"], "public_key": pub})
    assert r.status == 401 and "revoked" in (await r.json())["detail"]
    r = await client.post("/api/v1/join", json={"token": second["token"], "public_key": pub})
    assert r.status == 200, await r.text()


async def test_a_rebooted_stateless_node_rejoins(api) -> None:  # type: ignore[no-untyped-def]
    """A stateless image lives in RAM: after a power cycle the node asks again and gets a fresh
    join token (action join, nothing to install); it joins with a new key that replaces the
    old one and the machine stays active. A disk-image node gets none (its seed is on disk)."""
    from sqlmodel import select

    from metald.auth import issue_token
    from metald.claims.allocation import Selector, create_claim
    from metald.provision import netboot
    from metald.store.models import Machine
    from metald.tenants import clusters
    from tests.claims.helpers import DEPLOY, add_image, add_ready

    client, tokens, store = api
    admin = tokens.header("admin")
    r = await client.post(
        f"/api/v1/tenants/{tokens.tenant_a}/hub", json={"endpoint_host": "10.99.0.1"}, headers=admin
    )
    assert r.status == 201
    add_ready(store, 2, gpu_model="NVIDIA GB200", prefix="rejoin")
    agents = {}
    for kind in ("stateless", "disk"):
        with store.session() as s:
            claim, _ = create_claim(
                s, tokens.tenant_a, 1, Selector(gpu_model="NVIDIA GB200"),
                add_image(store, f"img-{kind}", kind=kind), None, "t", deploy=DEPLOY,
            )  # fmt: skip
            mid = s.exec(select(Machine).where(Machine.claim_id == claim.id)).one().id
            assert netboot.start_provisioning(s, [mid], actor="t") == [mid]
            _row, secret = issue_token(s, name="agent", role="agent", scope=[mid])
        agents[kind] = (mid, {"Authorization": f"Bearer {secret}"})

    mid, agent = agents["stateless"]
    r = await client.get("/api/v1/agent/provision", headers=agent)
    first = (await r.json())["join"]
    r = await client.post(
        "/api/v1/agent/progress", json={"phase": "booted", "done": True}, headers=agent
    )
    assert (await r.json())["state"] == "provisioned"
    key1 = keys.public_key(keys.generate_private_key())
    r = await client.post("/api/v1/join", json={"token": first["token"], "public_key": key1})
    assert r.status == 200
    with store.session() as s:
        clusters.observe(s, mid, handshake_at=utcnow(), scheduler_reports_node=True)
        assert s.get(Machine, mid).state == "active"  # type: ignore[union-attr]

    # Power cycle: iPXE boots the image again; the node asks what to do.
    r = await client.get("/api/v1/agent/provision", headers=agent)
    again = await r.json()
    assert again["action"] == "join" and again["join"]["token"] != first["token"]
    key2 = keys.public_key(keys.generate_private_key())
    r = await client.post(
        "/api/v1/join", json={"token": again["join"]["token"], "public_key": key2}
    )
    assert r.status == 200, await r.text()
    r = await client.get(f"/api/v1/tenants/{tokens.tenant_a}/hub", headers=admin)
    peers = [p for p in (await r.json())["peers"] if p["machine_id"] == mid]
    assert [p["public_key"] for p in peers] == [key2]
    with store.session() as s:
        assert s.get(Machine, mid).state == "active"  # type: ignore[union-attr]

    dmid, dagent = agents["disk"]
    r = await client.post(
        "/api/v1/agent/progress", json={"phase": "verify", "done": True}, headers=dagent
    )
    assert (await r.json())["state"] == "provisioned"
    r = await client.get("/api/v1/agent/provision", headers=dagent)
    assert (await r.json())["action"] == "none"
