"""Tenant mesh bench: the data path (through the hub vs direct) and the control path (how fast a
join or release reaches every node, and what it costs metald), side by side in one run.

    sudo .venv/bin/python bench/mesh.py                 # both parts, N = 2, 16, 128
    sudo .venv/bin/python bench/mesh.py --part data --seconds 5
    .venv/bin/python bench/mesh.py --part control --sizes 2,16,128

data (root; wireguard-go, iperf3): a hub and two nodes in namespaces on one bridge
(below). iperf3 node 1 -> node 2 over the overlay, first through the hub
(nodes peer with the hub only: today's path), then over the mesh (the views applied with the
node image's own shell). Reported: throughput, and the CPU the hub's wireguard-go used during
the transfer (utime+stime from /proc, in cores), and the bytes the hub's underlay saw.

control (no root): metald's API in its own process (SQLite), N simulated nodes as API
clients, each joined with a real join token and then long-polling POST /api/v1/mesh and
acknowledging what it applied, as the node agent does. Reported per N: how long one more
join takes to reach all N nodes, how long a release (the peer's removal, as the release flow
commits it) takes to be acknowledged by every remaining node (the wait the release flow makes
before it wipes), metald's CPU per join/release, its idle CPU with N long-polls, and the size
of one node's view.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

from metald.tenants import keys
from netconfig import guard, netns
from netconfig.uapi import PeerConfig, render_set
from netconfig.wireguard import Hub, UserspaceDevice
from vmlab.labnet import free_port

ROOT = Path(__file__).resolve().parents[1]
NODE_SCRIPT = ROOT / "bootassets/node/metald-node"


def table(headers: list[str], rows: list[list[object]]) -> str:
    cells = [headers] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    out = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in cells
    ]
    out.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(out)


def busy_seconds() -> float:
    """The whole machine's non-idle CPU time (all cores, softirq included), from /proc/stat."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(f[:8]) - f[3] - f[4]) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of one process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ---- the lab: a hub and nodes in namespaces (tests/tenants/test_mesh_netns.py uses it too) ----

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


# ---- data path ----------------------------------------------------------------------------


def data_path(seconds: float) -> list[list[object]]:
    lab = MeshLab().up(2)
    rows = []
    try:
        n1, n2 = lab.nodes
        assert lab.hub is not None and lab.hub.device is not None and lab.hub.device.proc
        hub_pid = _child_pid(lab.hub.device.proc.pid)
        for path in ("through the hub", "mesh (direct)"):
            if path.startswith("mesh"):
                lab.mesh()
            for _attempt in range(3):  # iperf3 sometimes ends without its totals: run again
                got = _measure(lab, n1, n2, hub_pid, seconds)
                if got is not None:
                    break
            else:
                raise RuntimeError("iperf3 gave no complete report in 3 runs")
            mbit, sent, hub_cpu, box_cpu, hub_rx = got
            rows.append(
                [
                    path,
                    f"{mbit:.0f}",
                    f"{hub_cpu:.2f}",
                    f"{box_cpu:.2f}",
                    f"{hub_rx / 1e6:.1f}",
                    f"{sent / 1e6:.1f}",
                ]
            )
    finally:
        lab.down()
    return rows


def _measure(
    lab: MeshLab, n1: Node, n2: Node, hub_pid: int, seconds: float
) -> tuple[float, int, float, float, int] | None:
    """One iperf3 run n1 -> n2: (Mbit/s, bytes sent, hub CPU, machine CPU, hub rx bytes)."""
    server = subprocess.Popen(
        ["nsenter", f"--net=/run/netns/{n2.ns}", "iperf3", "-s", "-1", "-B", n2.overlay],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(50):  # until the server listens
            busy0, cpu0 = busy_seconds(), cpu_seconds(hub_pid)
            rx0, t0 = link_stats(lab.hub_ns, "uh0")[0], time.monotonic()
            r = sh(n1.ns, "iperf3", "-c", n2.overlay, "-t", str(seconds), "-J", check=False)
            if r.returncode == 0:
                break
            time.sleep(0.1)
        else:
            raise RuntimeError(f"iperf3 failed: {r.stdout[-300:]} {r.stderr[-300:]}")
        wall = time.monotonic() - t0
        hub_cpu = (cpu_seconds(hub_pid) - cpu0) / wall
        box_cpu = (busy_seconds() - busy0) / wall
        hub_rx = link_stats(lab.hub_ns, "uh0")[0] - rx0
    finally:
        server.kill()
        server.wait()
    end = json.loads(r.stdout).get("end", {})
    if "sum_received" not in end or "sum_sent" not in end:
        return None
    mbit = end["sum_received"]["bits_per_second"] / 1e6
    return mbit, end["sum_sent"]["bytes"], hub_cpu, box_cpu, hub_rx


def _child_pid(nsenter_pid: int) -> int:
    """wireguard-go runs under nsenter (which execs it: same pid) or as its child."""
    cmd = Path(f"/proc/{nsenter_pid}/cmdline").read_bytes()
    if b"wireguard-go" in cmd.split(b"\0")[0]:
        return nsenter_pid
    kids = Path(f"/proc/{nsenter_pid}/task/{nsenter_pid}/children").read_text().split()
    return int(kids[0]) if kids else nsenter_pid


# ---- control path -------------------------------------------------------------------------

SERVER = textwrap.dedent(
    """
    import sys
    from aiohttp import web
    from api.app import create_app
    from api.context import AppContext
    from metald.config import load_config
    from metald.events import EventBus
    from metald.secrets import SecretBox
    from metald.store import Store
    state, port = sys.argv[1], int(sys.argv[2])
    cfg = load_config(None, environ={"METALD_STATE_DIR": state,
                                     "METALD_STORE__URL": f"sqlite:///{state}/metald.db"})
    store = Store(cfg.store.url)
    ctx = AppContext(cfg=cfg, store=store, secrets=SecretBox.from_file(cfg.secrets_key_path),
                     bus=EventBus())
    web.run_app(create_app(ctx), host="127.0.0.1", port=port, print=None)
    """
)


class Fleet:
    """The store side of the simulated tenant: machines, a hub, join tokens, all direct."""

    def __init__(self, state: Path) -> None:
        from cryptography.fernet import Fernet

        from metald.secrets import SecretBox
        from metald.store import Store

        state.mkdir(parents=True, exist_ok=True)
        key = state / "secrets.key"
        key.write_bytes(Fernet.generate_key())
        os.chmod(key, 0o600)
        self.store = Store(f"sqlite:///{state}/metald.db")
        self.store.migrate()
        self.box = SecretBox.from_file(key)
        from metald.tenants import clusters

        with self.store.session() as s:
            t = clusters.new_tenant(s, name="bench", cluster_kind="slurm")
            s.commit()
            clusters.setup_hub(s, self.box, t.id, endpoint_host="10.0.0.1", prefixlen=16)
            self.tenant_id = t.id
            from metald.auth import issue_token
            from metald.store.models import Claim

            _row, self.admin = issue_token(s, name="bench", role="admin")
            claim = Claim(tenant_id=t.id, count=1, selector={}, state="allocated")
            s.add(claim)
            s.commit()
            self.claim_id = claim.id

    def machine_with_token(self, i: int) -> tuple[str, str]:
        from metald import machines
        from metald.lifecycle import Trigger
        from metald.tenants import clusters

        with self.store.session() as s:
            m = machines.create_machine(
                s,
                macs=[f"52:54:01:{i >> 16 & 255:02x}:{i >> 8 & 255:02x}:{i & 255:02x}"],
                actor="bench",
            )
            for trig, upd in (
                (Trigger.INSPECT, None),
                (Trigger.INSPECTED, None),
                (Trigger.CLAIM, {"tenant_id": self.tenant_id, "claim_id": self.claim_id}),
                (Trigger.PROVISION, None),
                (Trigger.PROVISIONED, None),
            ):
                machines.transition(s, m.id, trig, actor="bench", updates=upd)
            secret, _ = clusters.issue_join_token(s, m.id, actor="bench")
            return m.id, secret


class SimNode:
    """An API client doing what the node agent does: join, then long-poll and acknowledge."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.token = ""
        self.machine_id = ""
        self.address = ""
        self.peers: set[str] = set()
        self.generation = 0
        self.changed = asyncio.Event()
        self.view_bytes = 0

    async def join(self, http, base: str, secret: str) -> None:  # type: ignore[no-untyped-def]
        from metald.tenants import keys

        pub = keys.public_key(keys.generate_private_key())
        async with http.post(f"{base}/api/v1/join", json={"token": secret, "public_key": pub}) as r:
            body = await r.json()
            assert r.status == 200, body
        self.token = body["mesh"]["node_token"]
        self.address = body["overlay_address"].split("/")[0]

    async def run(self, http, base: str) -> None:  # type: ignore[no-untyped-def]
        hdr = {"Authorization": f"Bearer {self.token}"}
        while True:
            async with http.post(
                f"{base}/api/v1/mesh", json={"applied": self.generation, "wait_s": 25}, headers=hdr
            ) as r:
                if r.status == 401:
                    return
                raw = await r.read()
            v = json.loads(raw)
            self.view_bytes = len(raw)
            self.peers = {p["address"] for p in v["peers"]}
            self.generation = v["generation"]
            self.changed.set()


async def _until(cond, timeout: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError("the mesh did not converge")
        await asyncio.sleep(0.002)


def _release_event(s):  # type: ignore[no-untyped-def]
    from sqlmodel import col, select

    from metald.store.models import Event

    ev = s.exec(
        select(Event).where(Event.kind == "tenant.mesh.released").order_by(col(Event.id).desc())
    ).first()
    return ev.data


async def control_path(n: int, state: Path) -> list[object]:
    import aiohttp

    fleet = Fleet(state)
    tokens = [fleet.machine_with_token(i) for i in range(n + 1)]
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(state), str(port)],
        cwd=ROOT,
    )
    base = f"http://127.0.0.1:{port}"
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(
        connector=conn, timeout=aiohttp.ClientTimeout(total=60)
    ) as http:
        try:
            for _ in range(200):
                try:
                    async with http.get(f"{base}/healthz") as r:
                        if r.status < 500:
                            break
                except aiohttp.ClientError:
                    await asyncio.sleep(0.05)
            nodes = []
            for i, (mid, secret) in enumerate(tokens[:n]):
                node = SimNode(f"n{i}")
                node.machine_id = mid
                await node.join(http, base, secret)
                nodes.append(node)
            tasks = [asyncio.create_task(nd.run(http, base)) for nd in nodes]
            await _until(lambda: all(len(nd.peers) == n - 1 for nd in nodes))
            await asyncio.sleep(1.0)
            cpu0 = cpu_seconds(proc.pid)
            await asyncio.sleep(3.0)
            idle = (cpu_seconds(proc.pid) - cpu0) / 3.0

            # One more join: until every node has it.
            newcomer = SimNode("new")
            newcomer.machine_id = tokens[n][0]
            cpu0, t0 = cpu_seconds(proc.pid), time.monotonic()
            await newcomer.join(http, base, tokens[n][1])
            await _until(lambda: all(newcomer.address in nd.peers for nd in nodes))
            join_s = time.monotonic() - t0
            await asyncio.sleep(0.2)
            join_cpu = cpu_seconds(proc.pid) - cpu0

            # Release it through the claim release route: it answers once every remaining node
            # acknowledged the generation without it (the wait before the wipe's power cycle).
            cpu0, t0 = cpu_seconds(proc.pid), time.monotonic()
            async with http.post(
                f"{base}/api/v1/claims/{fleet.claim_id}/machines/{newcomer.machine_id}/release",
                headers={"Authorization": f"Bearer {fleet.admin}"},
            ) as r:
                assert r.status == 200, await r.text()
            release_s = time.monotonic() - t0
            assert all(newcomer.address not in nd.peers for nd in nodes)
            release_cpu = cpu_seconds(proc.pid) - cpu0
            acked = await fleet.store.run(_release_event)
            assert acked["acknowledged"], acked
            view = max(nd.view_bytes for nd in nodes)
            for t in tasks:
                t.cancel()
        finally:
            proc.terminate()
            proc.wait()
            fleet.store.close()
    return [
        n,
        n * (n - 1) // 2,
        f"{join_s * 1000:.0f}",
        f"{release_s * 1000:.0f}",
        f"{join_cpu * 1000:.0f}",
        f"{release_cpu * 1000:.0f}",
        f"{idle:.3f}",
        f"{view / 1024:.1f}",
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=["data", "control", "both"], default="both")
    ap.add_argument("--sizes", default="2,16,128")
    ap.add_argument("--seconds", type=float, default=5.0)
    args = ap.parse_args()
    if args.part in ("data", "both"):
        if os.geteuid() != 0:
            sys.exit("the data part needs root (network namespaces); use --part control")
        rows = data_path(args.seconds)
        print(
            f"## Data path: iperf3 node 1 -> node 2, {args.seconds:.0f} s, wireguard-go everywhere\n"
        )
        print(
            table(
                [
                    "path",
                    "Mbit/s",
                    "hub wireguard-go CPU (cores)",
                    "machine CPU (cores)",
                    "hub underlay rx (MB)",
                    "sent (MB)",
                ],
                rows,
            )
        )
        print()
    if args.part in ("control", "both"):
        rows = []
        for n in (int(x) for x in args.sizes.split(",")):
            with tempfile.TemporaryDirectory(prefix="meshbench-") as d:
                rows.append(asyncio.run(control_path(n, Path(d))))
        print(
            "## Control path: N nodes long-polling POST /api/v1/mesh (SQLite, metald in its own process)\n"
        )
        print(
            table(
                [
                    "N",
                    "tunnels",
                    "join reaches all (ms)",
                    "release acked by all (ms)",
                    "metald CPU per join (ms)",
                    "per release (ms)",
                    "idle CPU (cores)",
                    "view size (KiB)",
                ],
                rows,
            )
        )


if __name__ == "__main__":
    main()
