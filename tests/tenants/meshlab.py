"""A tenant's hub and nodes in network namespaces of their own, on one underlay bridge, each
with a wireguard-go device: the ground for the mesh's traffic-path test and bench/mesh.py.

Nodes join the hub's way (hub peer: the tenant prefix); ``mesh`` then gives each node the
view metald would send (``metald.tenants.mesh.view`` over a real store) and applies it with
the node image's own shell (``mesh_apply`` from bootassets/node/metald-node), so the test and
the bench run the code a node runs. Interface names are unique host-wide (wireguard-go's
control sockets are global).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from metald.tenants import keys
from netconfig import guard, netns
from netconfig.uapi import PeerConfig, render_set
from netconfig.wireguard import Hub, UserspaceDevice

ROOT = Path(__file__).resolve().parents[2]
NODE_SCRIPT = ROOT / "bootassets/node/metald-node"
PREFIX = "100.70.0.0/24"
HUB_IP = "10.98.0.1"
PORT = 51820


def underlay_ip(i: int) -> str:
    return f"10.98.0.{10 + i}"


def overlay_ip(i: int) -> str:
    return f"100.70.0.{10 + i}"


def sh(ns: str, *argv: str, check: bool = True, **kw) -> subprocess.CompletedProcess[str]:  # type: ignore[no-untyped-def]
    r = subprocess.run(netns.exec_argv(ns, argv), capture_output=True, text=True, **kw)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} in {ns}: {r.stderr.strip() or r.stdout.strip()}")
    return r


def link_stats(ns: str, ifname: str) -> tuple[int, int]:
    """(rx_bytes, tx_bytes) of an interface in a namespace: the kernel's own counters (``ip -s``;
    /sys/class/net under nsenter shows the host's)."""
    stats = json.loads(sh(ns, "ip", "-j", "-s", "link", "show", "dev", ifname).stdout)[0]["stats64"]
    return int(stats["rx"]["bytes"]), int(stats["tx"]["bytes"])


@dataclass
class Node:
    index: int
    ns: str
    ifname: str
    private_key: str = field(repr=False)
    device: UserspaceDevice | None = None

    @property
    def public_key(self) -> str:
        return keys.public_key(self.private_key)

    @property
    def underlay(self) -> str:
        return underlay_ip(self.index)

    @property
    def overlay(self) -> str:
        return overlay_ip(self.index)


@dataclass
class MeshLab:
    tag: str = field(default_factory=lambda: secrets.token_hex(2))
    nodes: list[Node] = field(default_factory=list)
    hub: Hub | None = None
    hub_key: str = field(default_factory=keys.generate_private_key, repr=False)
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="meshlab-")))

    @property
    def bridge_ns(self) -> str:
        return f"mtb-{self.tag}"

    @property
    def hub_ns(self) -> str:
        return f"mth-{self.tag}"

    def up(self, n: int, *, guards: bool = True) -> MeshLab:
        netns.create(self.bridge_ns)
        sh(self.bridge_ns, "ip", "link", "add", "br0", "type", "bridge", "forward_delay", "0")
        sh(self.bridge_ns, "ip", "link", "set", "br0", "up")
        self._attach(self.hub_ns, "uh0", "bh0", f"{HUB_IP}/24")
        sh(self.hub_ns, "sysctl", "-qw", "net.ipv4.ip_forward=1")  # the route of last resort
        if guards:
            guard.apply(self.hub_ns, guard.render(["uh0"], wireguard_port=PORT))
        self.hub = Hub(self.hub_ns, f"mhw{self.tag}", "100.70.0.1/24", PORT)
        self.hub.up(self.hub_key)
        for i in range(1, n + 1):
            self.add_node(i, guards=guards)
        return self

    def _attach(self, ns: str, inner: str, outer: str, cidr: str) -> None:
        netns.create(ns)
        netns.veth(ns, inner, self.bridge_ns, outer)
        sh(self.bridge_ns, "ip", "link", "set", outer, "master", "br0", "up")
        netns.address(ns, inner, cidr)

    def add_node(self, i: int, *, guards: bool = True) -> Node:
        node = Node(i, f"mtn-{self.tag}-{i}", f"mnw{self.tag}{i}", keys.generate_private_key())
        self._attach(node.ns, "un0", f"bn{i}", f"{node.underlay}/24")
        if guards:
            guard.apply(node.ns, guard.render(["un0"], mesh_port=PORT))
        node.device = UserspaceDevice(node.ns, node.ifname)
        node.device.start()
        node.device.configure(
            render_set(
                private_key=node.private_key,
                listen_port=PORT,
                peers=[
                    PeerConfig(
                        keys.public_key(self.hub_key),
                        [PREFIX],
                        endpoint=f"{HUB_IP}:{PORT}",
                        persistent_keepalive=25,
                    )
                ],
            )
        )
        netns.address(node.ns, node.ifname, f"{node.overlay}/24")
        assert self.hub is not None
        self.hub.add_peer(node.public_key, node.overlay)
        self.nodes.append(node)
        return node

    def view(self, node: Node, generation: int = 1, members: list[Node] | None = None) -> dict:
        """The mesh view metald's ``mesh.view`` builds (same shape), for ``members``."""
        others = [m for m in (members if members is not None else self.nodes) if m is not node]
        return {
            "generation": generation,
            "address": node.overlay,
            "listen_port": PORT,
            "hub": {
                "public_key": keys.public_key(self.hub_key),
                "endpoint": f"{HUB_IP}:{PORT}",
                "address": "100.70.0.1",
                "allowed_ips": [PREFIX],
            },
            "peers": [
                {
                    "public_key": m.public_key,
                    "address": m.overlay,
                    "allowed_ips": [f"{m.overlay}/32"],
                    "endpoint": f"{m.underlay}:{PORT}",
                }
                for m in others
            ],
            "guard": {
                "wireguard_port": PORT,
                "sources": [HUB_IP] + [m.underlay for m in others],
            },
        }

    def apply_view(self, node: Node, view: dict) -> None:
        """What the node image does with a view: its ``mesh_apply``, run by busybox sh."""
        state = self.workdir / f"node{node.index}"
        state.mkdir(exist_ok=True)
        vfile = state / "view.json"
        vfile.write_text(json.dumps(view))
        script = f". {NODE_SCRIPT}\nWG_IF={node.ifname}\nmesh_apply {vfile}\n"
        env = dict(os.environ, METALD_NODE_LIB="1", METALD_NODE_STATE=str(state))
        sh(node.ns, shutil.which("busybox") or "busybox", "sh", "-c", script, env=env)

    def mesh(self) -> None:
        for node in self.nodes:
            self.apply_view(node, self.view(node))

    def down(self) -> None:
        for node in self.nodes:
            if node.device is not None:
                node.device.stop()
        if self.hub is not None:
            self.hub.down()
        for node in self.nodes:
            netns.delete(node.ns)
        netns.delete(self.hub_ns)
        netns.delete(self.bridge_ns)
        shutil.rmtree(self.workdir, ignore_errors=True)
