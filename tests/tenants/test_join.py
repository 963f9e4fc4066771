"""Join tokens and joins over the store, on SQLite and PostgreSQL."""

from __future__ import annotations

import base64
import json
import threading
from datetime import timedelta

import pytest
from sqlalchemy import text
from sqlmodel import select

from metald.errors import Conflict, Unauthorized, Unprocessable
from metald.lifecycle import State
from metald.store.models import JoinToken, Machine, Tenant, WgHub, WgPeer, utcnow
from metald.tenants import clusters, keys
from tests.tenants.conftest import Env, provisioned


def _pub() -> str:
    return keys.public_key(keys.generate_private_key())


def _token(env: Env, machine_id: str, **kw) -> str:  # type: ignore[no-untyped-def]
    with env.store.session() as s:
        secret, _exp = clusters.issue_join_token(s, machine_id, actor="test", **kw)
    return secret


def _join(env: Env, secret: str, pub: str) -> clusters.JoinResult:
    with env.store.session() as s:
        return clusters.join(s, env.box, secret, pub)


def test_hubs_get_disjoint_prefixes_and_first_host(env: Env) -> None:
    with env.store.session() as s:
        hubs = {h.tenant_id: h for h in s.exec(select(WgHub))}
        tenants = {t.id: t for t in s.exec(select(Tenant))}
    a, b = env.tokens.tenant_a, env.tokens.tenant_b
    assert tenants[a].overlay_prefix != tenants[b].overlay_prefix
    assert hubs[a].address == tenants[a].overlay_prefix.split("/")[0][:-1] + "1"  # type: ignore[union-attr]
    assert hubs[a].ifname != hubs[b].ifname and len(hubs[a].ifname) <= 15
    assert hubs[a].endpoint == "10.99.0.1:51820"


def test_join_returns_material_and_burns_token(env: Env) -> None:
    m = env.tokens.machine_a
    secret = _token(env, m)
    pub = _pub()
    res = _join(env, secret, pub).response()
    with env.store.session() as s:
        hub = s.exec(select(WgHub).where(WgHub.tenant_id == env.tokens.tenant_a)).one()
        tenant = s.get(Tenant, env.tokens.tenant_a)
        munge = json.loads(env.box.decrypt(tenant.secrets_enc))["munge_key"]  # type: ignore[union-attr,arg-type]
        peer = s.exec(select(WgPeer).where(WgPeer.machine_id == m)).one()
        machine = s.get(Machine, m)
        tok = s.exec(select(JoinToken).where(JoinToken.machine_id == m)).one()
    assert res["overlay_address"] == f"{peer.address}/24" and peer.public_key == pub
    assert res["hub"] == {
        "endpoint": hub.endpoint,
        "public_key": hub.public_key,
        "address": hub.address,
    }
    assert res["allowed_ips"] == [tenant.overlay_prefix]  # type: ignore[union-attr]
    assert res["persistent_keepalive"] == 25
    c = res["cluster"]
    assert c["kind"] == "slurm" and c["munge_key"] == munge
    assert len(base64.b64decode(c["munge_key"])) == 1024
    assert c["conf_server"] == f"{hub.address}:6817"
    args = c["slurmd_args"]
    assert args[:5] == ["-Z", "-N", "node0", "--conf-server", f"{hub.address}:6817"]
    assert args[5] == "--conf" and args[6].startswith("Gres=gpu:8 Feature=nvidia_h100_80gb_hbm3")
    assert machine.state == State.JOINING  # type: ignore[union-attr]
    assert tok.used_at is not None
    with pytest.raises(Conflict, match="already used"):
        _join(env, secret, _pub())


def test_kubernetes_tenant_gets_kubeadm_material(env: Env) -> None:
    m = env.tokens.machine_b
    provisioned(env.store, m)
    c = _join(env, _token(env, m), _pub()).material
    assert c["kind"] == "kubernetes"
    assert c["api_server_endpoint"] == "k8s.globex.example:6443"
    assert c["ca_cert_hash"].startswith("sha256:") and len(c["ca_cert_hash"]) == 71
    assert f'token: "{c["bootstrap_token"]}"' in c["join_configuration"]


def test_token_is_one_time_under_concurrency(env: Env) -> None:
    secret = _token(env, env.tokens.machine_a)
    results: list[object] = []
    barrier = threading.Barrier(6)

    def go() -> None:
        barrier.wait()
        try:
            results.append(_join(env, secret, _pub()))
        except Exception as e:  # noqa: BLE001 - recorded and checked below
            results.append(e)

    threads = [threading.Thread(target=go) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wins = [r for r in results if isinstance(r, clusters.JoinResult)]
    assert len(wins) == 1, results
    assert all(isinstance(r, Conflict) for r in results if r not in wins), results
    with env.store.session() as s:
        assert len(s.exec(select(WgPeer)).all()) == 1


def test_refusals(env: Env) -> None:
    m = env.tokens.machine_a
    with pytest.raises(Unauthorized, match="unknown"):
        _join(env, "mjt_forged", _pub())
    secret = _token(env, m)
    with pytest.raises(Unprocessable, match="public_key"):
        _join(env, secret, "not-a-key")
    # A refused join leaves the token usable.
    _join(env, secret, _pub())
    provisioned(env.store, env.tokens.machine_b)
    expired = _token(env, env.tokens.machine_b, ttl=timedelta(seconds=60))
    with env.store.session() as s, pytest.raises(Unauthorized, match="expired"):
        clusters.join(s, env.box, expired, _pub(), now=utcnow() + timedelta(seconds=61))
    with env.store.session() as s, pytest.raises(Conflict, match="no tenant"):
        clusters.issue_join_token(s, env.tokens.machine_free, actor="test")


def test_public_key_of_another_node_refused(env: Env) -> None:
    pub = _pub()
    _join(env, _token(env, env.tokens.machine_a), pub)
    provisioned(env.store, env.tokens.machine_b)
    with pytest.raises(Conflict, match="another node"):
        _join(env, _token(env, env.tokens.machine_b), pub)


def test_release_removes_peer_and_frees_address(env: Env) -> None:
    m = env.tokens.machine_a
    leftover = _token(env, m)
    first = _join(env, _token(env, m), _pub())
    with env.store.session() as s:
        removed = clusters.remove_peer(s, m, actor="test")
        s.commit()
        assert removed is not None and removed.public_key == first.peer.public_key
        assert s.exec(select(WgPeer)).all() == []
    # Unused tokens were revoked with the release.
    with pytest.raises(Unauthorized):
        _join(env, leftover, _pub())


def test_a_join_never_replaces_an_active_peer(env: Env) -> None:
    """Whoever holds a valid token for a machine already on its hub (a technician's, say) must
    not take the node's place: no token is minted, and a join with one minted any other way is
    refused; the node's peer stays."""
    from metald.tenants import tokens

    m = env.tokens.machine_a
    first = _join(env, _token(env, m), _pub())
    with pytest.raises(Conflict, match="already on its tenant's hub"):
        _token(env, m)
    with env.store.session() as s:
        _row, stray = tokens.issue(s, machine_id=m, tenant_id=env.tokens.tenant_a)
        s.commit()
    with pytest.raises(Conflict, match="never replaces an active peer"):
        _join(env, stray, _pub())
    with env.store.session() as s:
        assert [p.public_key for p in s.exec(select(WgPeer))] == [first.peer.public_key]
        # The refusal rolled back: the stray token was not burned.
        row = s.exec(select(JoinToken).where(JoinToken.token_hash == tokens.hash_secret(stray)))
        assert row.one().used_at is None


def test_metald_supersedes_the_peer_of_a_node_it_reboots(env: Env) -> None:
    """A RAM-booted node that boots again through metald lost its key: the token metald mints
    for that boot removes the old peer (with an event), and the node joins with a new key."""
    from metald.store.models import Event

    m = env.tokens.machine_a
    first = _join(env, _token(env, m), _pub())
    second = _join(env, _token(env, m, supersede_peer=True), _pub())
    with env.store.session() as s:
        assert [p.public_key for p in s.exec(select(WgPeer))] == [second.peer.public_key]
        removed = s.exec(select(Event).where(Event.kind == "tenant.peer.removed")).one()
        assert removed.data["public_key"] == first.peer.public_key
        assert removed.data["reason"] == "rebooted"


def test_active_needs_handshake_and_scheduler(env: Env) -> None:
    m = env.tokens.machine_a
    _join(env, _token(env, m), _pub())
    with env.store.session() as s:
        got = clusters.observe(s, m, handshake_at=utcnow(), scheduler_reports_node=False)
        assert got.state == State.JOINING
        got = clusters.observe(s, m, handshake_at=None, scheduler_reports_node=True)
        assert got.state == State.JOINING
        got = clusters.observe(s, m, handshake_at=utcnow(), scheduler_reports_node=True)
        assert got.state == State.ACTIVE


def test_secrets_encrypted_at_rest(env: Env) -> None:
    with env.store.session() as s:
        tenant = s.get(Tenant, env.tokens.tenant_a)
        hub = s.exec(select(WgHub).where(WgHub.tenant_id == env.tokens.tenant_a)).one()
        stored = json.loads(env.box.decrypt(tenant.secrets_enc))  # type: ignore[union-attr,arg-type]
        k8s = json.loads(env.box.decrypt(s.get(Tenant, env.tokens.tenant_b).secrets_enc))  # type: ignore[union-attr,arg-type]
        hub_priv = clusters.hub_private_key(env.box, hub)
        raw = b"".join(
            bytes(v) if isinstance(v, bytes | memoryview) else str(v).encode()
            for row in s.execute(text("SELECT * FROM tenants")).all()
            + s.execute(text("SELECT * FROM wg_hubs")).all()
            for v in row
            if v is not None
        )
    munge = base64.b64decode(stored["munge_key"])
    assert keys.public_key(hub_priv) == hub.public_key
    for secret in (
        munge,
        stored["munge_key"].encode(),
        hub_priv.encode(),
        base64.b64decode(hub_priv),
        k8s["ca_key"].encode(),
        k8s["ca_key"].splitlines()[1].encode(),
    ):
        assert secret not in raw


def test_elastic_pool_machine_joins_under_its_node_name(env: Env) -> None:
    """A machine claimed for elastic node e2 joins as the CLOUD node e2 slurmctld resumed:
    ``slurmd -N e2``, no -Z (a dynamic node would be a second, unknown node)."""
    from metald.store.models import Claim

    m = env.tokens.machine_a
    with env.store.session() as s:
        c = Claim(tenant_id=env.tokens.tenant_a, count=1, idempotency_key="elastic:p1:e2")
        s.add(c)
        s.commit()
        machine = s.get(Machine, m)
        assert machine is not None
        machine.claim_id = c.id
        s.add(machine)
        s.commit()
    res = _join(env, _token(env, m), _pub()).response()
    args = res["cluster"]["slurmd_args"]
    assert res["cluster"]["node_name"] == "e2"
    assert args[:2] == ["-N", "e2"] and "-Z" not in args
