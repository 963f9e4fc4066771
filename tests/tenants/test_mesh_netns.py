"""The mesh for real, in namespaces: a hub and three nodes on wireguard-go, the views metald
builds from its store, applied by the node image's own shell. A node-to-node transfer goes
through the hub before the mesh and straight between the nodes after it (read from the
kernel's byte counters on the hub's underlay interface, not from timings); a released node is
off the others and their guards; the guard admits WireGuard only from the tenant's own."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography.fernet import Fernet

from bench.mesh import HUB_IP, PORT, MeshLab, Node, link_stats, sh
from metald import machines
from metald.lifecycle import Trigger
from metald.secrets import SecretBox
from metald.store import Store
from metald.store.models import Tenant, WgPeer
from metald.tenants import clusters, keys, mesh

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(
        not all(shutil.which(t) for t in ("wireguard-go", "wg", "nft", "busybox", "jq", "iperf3")),
        reason="needs wireguard-go, wireguard-tools, nftables, busybox, jq and iperf3",
    ),
]
BYTES = 8 << 20  # per transfer


@pytest.fixture
def lab() -> Iterator[MeshLab]:
    lab = MeshLab()
    try:
        yield lab.up(3)
    finally:
        lab.down()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store(f"sqlite:///{tmp_path / 'metald.db'}")
    s.migrate()
    yield s
    s.close()


def tenant_of(store: Store, lab: MeshLab) -> tuple[str, dict[int, str]]:
    """The lab's tenant as metald stores it: hub, and one peer per node that joined from its
    underlay address. Returns (tenant id, node index -> machine id)."""
    box = SecretBox(Fernet.generate_key())
    ids = {}
    with store.session() as s:
        t = clusters.new_tenant(s, name="acme", cluster_kind="slurm")
        s.commit()
        hub = clusters.setup_hub(s, box, t.id, endpoint_host=HUB_IP, supernet="100.70.0.0/24")
        hub.public_key = keys.public_key(lab.hub_key)  # the lab's running hub is this one
        s.add(hub)
        tenant = s.get(Tenant, t.id)
        assert tenant is not None and tenant.overlay_prefix == "100.70.0.0/24"
        for node in lab.nodes:
            m = machines.create_machine(s, macs=[f"52:54:00:70:00:{node.index:02x}"], actor="test")
            machines.transition(s, m.id, Trigger.INSPECT, actor="test")
            machines.transition(s, m.id, Trigger.INSPECTED, actor="test")
            machines.transition(s, m.id, Trigger.CLAIM, actor="test", updates={"tenant_id": t.id})
            s.add(
                WgPeer(
                    tenant_id=t.id,
                    machine_id=m.id,
                    public_key=node.public_key,
                    address=node.overlay,
                    registered_from=node.underlay,
                    node_token_hash=mesh.hash_token(f"mnt_node{node.index}"),
                )
            )
            mesh.bump(s, t.id)
            ids[node.index] = m.id
        s.commit()
        return t.id, ids


def apply_from_store(store: Store, lab: MeshLab, nodes: list[Node]) -> None:
    for node in nodes:
        with store.session() as s:
            view, _ = mesh.sync(s, f"mnt_node{node.index}", 0)
        lab.apply_view(node, view.response())


def peers_of(node: Node) -> set[str]:
    assert node.device is not None
    return {p.public_key for p in node.device.peers()}


def transfer(src: Node, dst: Node) -> None:
    """iperf3: ``BYTES`` from src to dst over the overlay (a fixed amount, not a duration). A
    run whose report lacks its totals (iperf3 sometimes ends so) is run again; the callers'
    byte counters span every run, and every run takes the same path."""
    for _ in range(3):
        if _iperf3(src, dst):
            return
    raise AssertionError("iperf3 gave no complete report in 3 runs")


def _iperf3(src: Node, dst: Node) -> bool:
    server = subprocess.Popen(
        ["nsenter", f"--net=/run/netns/{dst.ns}", "iperf3", "-s", "-1", "-B", dst.overlay],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(50):  # the server binds within a moment; retry the client until it does
            r = sh(src.ns, "iperf3", "-c", dst.overlay, "-n", str(BYTES), "-J", check=False)
            if r.returncode == 0:
                sent = json.loads(r.stdout).get("end", {}).get("sum_sent", {}).get("bytes", 0)
                return sent >= BYTES
            if "Connection refused" not in r.stdout + r.stderr:
                raise AssertionError(r.stdout[-500:] + r.stderr[-500:])
            sh(src.ns, sys.executable, "-c", "import time; time.sleep(0.1)")
        raise AssertionError("iperf3 server never came up")
    finally:
        server.kill()
        server.wait()


def hub_share(lab: MeshLab, src: Node, dst: Node) -> float:
    """Bytes the hub's underlay interface received during a transfer, as a share of what
    the sender put on its own underlay."""
    hub0, src0 = link_stats(lab.hub_ns, "uh0")[0], link_stats(src.ns, "un0")[1]
    transfer(src, dst)
    sent = link_stats(src.ns, "un0")[1] - src0
    assert sent >= BYTES * 0.8, sent  # iperf3 ends on its control channel: some may trail
    return (link_stats(lab.hub_ns, "uh0")[0] - hub0) / sent


def test_node_to_node_goes_direct_with_the_mesh_and_release_cuts_it(
    lab: MeshLab, store: Store
) -> None:
    n1, n2, n3 = lab.nodes
    tenant_id, ids = tenant_of(store, lab)
    # Before the mesh: every byte from n1 to n2 crosses the hub's underlay interface.
    assert hub_share(lab, n1, n2) >= 0.95
    apply_from_store(store, lab, lab.nodes)
    hub_pub = keys.public_key(lab.hub_key)
    assert peers_of(n1) == {hub_pub, n2.public_key, n3.public_key}
    # With it: the hub sees (almost) nothing of the transfer; n2's underlay sees all of it.
    n2_before = link_stats(n2.ns, "un0")[0]
    share = hub_share(lab, n1, n2)
    assert share < 0.01, share
    assert link_stats(n2.ns, "un0")[0] - n2_before >= BYTES * 0.8

    # Release n3: metald drops its peer (a new generation); the others apply their views.
    with store.session() as s:
        clusters.remove_peer(s, ids[3], actor="test")
        s.commit()
    apply_from_store(store, lab, [n1, n2])
    for node in (n1, n2):
        assert n3.public_key not in peers_of(node)
        listing = json.loads(
            sh(node.ns, "nft", "-j", "list", "set", "inet", "metald_guard", "wg_sources").stdout
        )
        (elems,) = [e["set"].get("elem", []) for e in listing["nftables"] if "set" in e]
        other = n2 if node is n1 else n1
        assert set(elems) == {HUB_IP, other.underlay}, elems
    # n3's released token opens nothing any more.
    with store.session() as s, pytest.raises(Exception, match="revoked"):
        mesh.sync(s, "mnt_node3", 0)
    assert hub_share(lab, n1, n2) < 0.01  # the rest of the mesh still holds


def test_guard_admits_wireguard_only_from_the_tenants_own(lab: MeshLab, store: Store) -> None:
    n1, n2, n3 = lab.nodes
    tenant_id, ids = tenant_of(store, lab)
    with store.session() as s:  # n3 is not of this tenant's mesh any more
        clusters.remove_peer(s, ids[3], actor="test")
        s.commit()
    apply_from_store(store, lab, [n1, n2])

    def drops(node: Node) -> int:
        rules = json.loads(
            sh(node.ns, "nft", "-j", "list", "chain", "inet", "metald_guard", "input").stdout
        )
        return sum(
            e["rule"]["expr"][-2]["counter"]["packets"]
            for e in rules["nftables"]
            if "rule" in e and any("counter" in x for x in e["rule"]["expr"])
        )

    send = "import socket,sys; socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x'*32, (sys.argv[1], int(sys.argv[2])))"
    before = drops(n1)
    sh(n3.ns, sys.executable, "-c", send, n1.underlay, str(PORT))  # an outsider: dropped, counted
    after_outsider = drops(n1)
    sh(n2.ns, sys.executable, "-c", send, n1.underlay, str(PORT))  # a tenant peer: admitted
    assert after_outsider == before + 1
    assert drops(n1) == after_outsider
