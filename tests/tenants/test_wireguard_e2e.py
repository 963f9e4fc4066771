"""The real thing, in namespaces: a tenant hub on wireguard-go, a node that makes its own key
and joins with a one-time token, traffic over the overlay, and release cutting it off."""

from __future__ import annotations

import secrets
import shutil
from pathlib import Path

import pytest
from cryptography.fernet import Fernet
from sqlmodel import select

from metald.secrets import SecretBox
from metald.store import Store
from metald.store.models import Tenant, WgHub, WgPeer
from metald.tenants import clusters, keys
from metald.tenants.hubs import LocalHubs
from netconfig import guard, netns
from netconfig.wireguard import UserspaceDevice
from tests.tenants.conftest import make_env
from tests.tenants.nslab import in_ns, tcp_listener, tcp_reaches, underlay, wait_for

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(
        not (shutil.which("wireguard-go") and shutil.which("wg")), reason="wireguard-go missing"
    ),
]


@pytest.fixture
def sqlite_store(tmp_path: Path):  # type: ignore[no-untyped-def]
    s = Store(f"sqlite:///{tmp_path / 'metald.db'}")
    s.migrate()
    yield s
    s.close()


def node_up(ns: str, ifname: str, private_key: str, joined: dict) -> UserspaceDevice:  # type: ignore[type-arg]
    """What the node's join service does with the response: wg + ip, nothing from metald."""
    dev = UserspaceDevice(ns, ifname)
    dev.start()
    hub = joined["hub"]
    r = in_ns(
        ns,
        "wg", "set", ifname,
        "private-key", "/dev/stdin",
        "peer", hub["public_key"],
        "endpoint", hub["endpoint"],
        "allowed-ips", ",".join(joined["allowed_ips"]),
        "persistent-keepalive", str(joined["persistent_keepalive"]),
        input=private_key + "\n",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    for argv in (
        ["ip", "addr", "add", joined["overlay_address"], "dev", ifname],
        ["ip", "link", "set", ifname, "up"],
    ):
        r = in_ns(ns, *argv)
        assert r.returncode == 0, r.stderr
    return dev


def test_join_handshake_traffic_release(sqlite_store: Store) -> None:
    box = SecretBox(Fernet.generate_key())
    env = make_env(sqlite_store, box)
    tenant_id, machine_id = env.tokens.tenant_a, env.tokens.machine_a
    hubs = LocalHubs()
    node_dev: UserspaceDevice | None = None
    with underlay() as u, sqlite_store.session() as s:
        hub = s.exec(select(WgHub).where(WgHub.tenant_id == tenant_id)).one()
        tenant = s.get(Tenant, tenant_id)
        assert tenant is not None and tenant.overlay_prefix and hub.endpoint.startswith(u.hub_ip)
        try:
            hubs.start_from_store(s, box, tenant_id, u.hub_ns)
            secret, _ = clusters.issue_join_token(s, machine_id, actor="test")

            # The node: its own key, never sent anywhere.
            node_priv = keys.generate_private_key()
            node_pub = keys.public_key(node_priv)
            result = clusters.join(s, box, secret, node_pub)
            hubs.add_peer(tenant_id, result.peer.public_key, result.peer.address)  # as the API does
            joined = result.response()
            node_dev = node_up(u.node_ns, f"mn{secrets.token_hex(4)}", node_priv, joined)

            assert wait_for(lambda: hubs.handshakes(tenant_id).get(node_pub) is not None)
            seen = hubs.handshakes(tenant_id)[node_pub]
            clusters.observe(s, machine_id, handshake_at=seen, scheduler_reports_node=False)
            peer = s.exec(select(WgPeer).where(WgPeer.machine_id == machine_id)).one()
            assert peer.last_handshake_at is not None

            # Like slurmctld, the listener takes every address of the hub namespace.
            with tcp_listener(u.hub_ns, "0.0.0.0", 7070):
                assert wait_for(lambda: tcp_reaches(u.node_ns, hub.address, 7070))
                assert tcp_reaches(u.node_ns, u.hub_ip, 7070)  # unguarded underlay: open
                guard.apply(u.hub_ns, guard.render(["uh0"], wireguard_port=hub.listen_port))
                guard.apply(u.node_ns, guard.render(["un0"]))
                assert not tcp_reaches(u.node_ns, u.hub_ip, 7070)
                assert tcp_reaches(u.node_ns, hub.address, 7070)  # the tunnel still works

                # A restarted hub (metald restart) comes back from the store with its peers.
                hubs.stop()
                hubs.start_from_store(s, box, tenant_id, u.hub_ns)
                assert wait_for(lambda: tcp_reaches(u.node_ns, hub.address, 7070))

                removed = clusters.remove_peer(s, machine_id, actor="test")
                s.commit()
                assert removed is not None
                hubs.remove_peer(tenant_id, removed.public_key)
                assert node_pub not in hubs.handshakes(tenant_id)
                assert not tcp_reaches(u.node_ns, hub.address, 7070)
        finally:
            if node_dev is not None:
                node_dev.stop()
            hubs.stop()
        assert hub.ifname not in netns.links(u.hub_ns)
