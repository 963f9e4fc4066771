"""One round of "PostgreSQL itself fails over" under load: shared by
tests/fleet/test_patroni_failover.py and bench/pg_failover.py.

Real parts: the Patroni lab (tests/fleet/patroni_lab.py: 3 etcd members, a primary and its
synchronous standby), ``metald serve`` processes on the lab's multi-host URL
(``target_session_attrs=read-write``) taking claims and answering event reads through their
API, and an in-process DHCP server (DhcpServer, LeaseStore, LeaseFeed, Membership) on the same
URL ACKing DORAs through a relay socket. Fleet timings are metald's defaults (heartbeat 2 s,
dead after 10 s: an instance fences itself 8 s after its last heartbeat).

While the load runs, the primary's postmaster gets ``kill -9`` (Patroni on that node lives on
and, with ``primary_start_timeout: 0``, hands the leader key over instead of restarting it in
place). Measured from the kill: when a standby is promoted (Patroni's ``/cluster`` names a new
leader that accepts writes), the first 2xx claim, the first DHCP ACK; and, after the round,
every acknowledged lease, claim and event id is read back from the new primary.

``kill="cut"``: the lab runs in network namespaces (``PatroniLab(netns=True)``: each database
host in its own, etcd1+pg1, etcd2+pg2, etcd3; each ``metald serve`` in its own) and the
primary's host is cut off with nftables (every packet dropped, both ways, but loopback:
tests/fleet/netcut.py), its processes alive. Measured besides: when the old primary stopped
taking writes (Patroni demotes it once it cannot reach the etcd majority), the packets the cut
dropped; then the cut heals: when the old primary is a streaming replica again, whether
pg_rewind ran, and every acknowledged write read back from the rejoined replica too.

``kill="partition"``: the same, but the cut lets the primary's host still reach the standby's
host (and the standby it), and nothing else: the primary loses etcd and metald, not its
replication. Patroni must not promote beside a primary that still runs, and the primary must
demote itself on its own (it cannot reach the etcd majority to renew the leader key); the
standby, which sees the old primary's REST API all along, is promoted once the key expires.
Measured and checked as for ``cut``.

``kill="none"``: no failover at all (the storm's baseline, ``storm`` > 0): the same lab, the
same load and storm, so that a failover's cost is a difference between two runs of one setup.

``storm=N``: an enrollment storm of N simulated machines (bench/storm.py's simulation, run in a
client namespace against the first instance's boot plane: DHCP through a relay, iPXE script,
inventory) is under way when the primary is killed or cut; its result (time to all ready,
DHCP retransmits, PXE restarts, HTTP retries, machines held up) comes back in ``Round.storm``
and every machine it enrolled must be ready in the database afterwards.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from ipaddress import IPv4Address
from pathlib import Path
from typing import Any

import psycopg
from sqlalchemy import text

from metald.boot.dhcp.bootfile import BootFiles
from metald.boot.dhcp.lease_store import LeaseStore
from metald.boot.dhcp.packet import MessageType
from metald.boot.dhcp.server import DhcpServer
from metald.boot.plane import join_fleet
from metald.fleet.membership import Membership
from metald.store import Store
from netconfig import netns
from tests.claims.helpers import add_image, add_ready, add_tenant
from tests.fleet.netcut import dropped
from tests.fleet.patroni_lab import Node as PgNode
from tests.fleet.patroni_lab import PatroniLab
from tests.fleet.test_dhcp_peers import SUBNET, discover, mac, plan, selecting, send
from tests.fleet.test_dhcp_peers import Node as DhcpNode
from tests.test_daemon import BIN
from vmlab.labnet import free_port

HEARTBEAT_S, DEAD_AFTER_S = 2.0, 10.0
FENCED_LOG = "fenced: no heartbeat written"
ROOT = Path(__file__).resolve().parents[2]
#: bench/storm.py's addresses: its simulation talks to the boot plane at SRV from CLI.
STORM_SRV, STORM_CLI = "10.77.0.1", "10.77.0.2"


def http(addr: str, method: str, path: str, token: str, body: Any = None) -> tuple[int, Any, Any]:
    """``addr``: host:port of an instance's API."""
    req = urllib.request.Request(
        f"http://{addr}{path}",
        method=method,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.headers, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, e.headers, json.loads(e.read() or b"null")
    except OSError as e:  # the instance itself is gone: never expected here
        return 0, {}, {"error": str(e)}


@dataclass
class Round:
    kill: str = "postmaster"
    leader_before: str = ""
    leader_after: str = ""
    promoted_s: float = 0.0
    first_claim_s: float = 0.0
    first_ack_s: float = 0.0
    orphaned: int = 0
    claims: list[str] = field(default_factory=list)
    acked: dict[str, IPv4Address] = field(default_factory=dict)
    event_ids: set[int] = field(default_factory=set)
    outcomes: Counter[str] = field(default_factory=Counter)
    bad: list[Any] = field(default_factory=list)
    fenced: list[str] = field(default_factory=list)
    lost_leases: dict[str, Any] = field(default_factory=dict)
    lost_claims: set[str] = field(default_factory=set)
    lost_events: set[int] = field(default_factory=set)
    # kill="cut" only:
    #: Cut -> the old primary no longer a writable primary (demoted, stopped or in recovery).
    demoted_s: float | None = None
    #: What the old primary was when the cut healed: "stopped" or "read-only".
    old_state: str = ""
    #: Packets the cut dropped, in and out of the old primary's host.
    cut_dropped: dict[str, int] = field(default_factory=dict)
    #: Rows on the old primary (read over its Unix socket before the heal) not on the new one;
    #: None when it was stopped. Acknowledged ones among them would be lost writes.
    only_on_old: int | None = None
    acked_only_on_old: int = 0
    #: Heal -> the old primary streams from the new one; whether Patroni ran pg_rewind.
    rejoined_s: float | None = None
    rewound: bool = False
    sync_waits_cancelled: int = 0
    #: The old primary holds the leader key again after the heal (it did not rejoin), and
    #: Patroni's /cluster then.
    failback: bool = False
    after_heal: dict[str, Any] | None = None
    #: Acknowledged writes missing on the rejoined replica.
    replica_missing: int = 0
    #: The old primary still took writes when the standby's promotion was seen.
    both_primary: bool = False
    #: Lines of the new leader's Patroni log that say why it waited (partition: it sees the
    #: old primary's REST API), counted: {"still alive": n, "ahead": n}.
    waited: dict[str, int] = field(default_factory=dict)
    storm: dict[str, Any] = field(default_factory=dict)

    @property
    def fence_after_s(self) -> float:
        return DEAD_AFTER_S - HEARTBEAT_S

    def as_json(self) -> dict[str, Any]:
        return {
            "kill": self.kill,
            "demoted_s": self.demoted_s,
            "old_state": self.old_state,
            "cut_dropped": self.cut_dropped,
            "only_on_old": self.only_on_old,
            "acked_only_on_old": self.acked_only_on_old,
            "rejoined_s": self.rejoined_s,
            "rewound": self.rewound,
            "sync_waits_cancelled": self.sync_waits_cancelled,
            "failback": self.failback,
            "after_heal": self.after_heal,
            "replica_missing": self.replica_missing,
            "both_primary": self.both_primary,
            "waited": self.waited,
            "storm": self.storm,
            "leader_before": self.leader_before,
            "leader_after": self.leader_after,
            "promoted_s": self.promoted_s,
            "first_claim_s": self.first_claim_s,
            "first_ack_s": self.first_ack_s,
            "orphaned": self.orphaned,
            "fenced": self.fenced,
            "fence_after_s": self.fence_after_s,
            "acked_leases": len(self.acked),
            "claims": len(self.claims),
            "event_ids": len(self.event_ids),
            "lost": len(self.lost_leases) + len(self.lost_claims) + len(self.lost_events),
            "outcomes": dict(self.outcomes),
        }

    def summary(self) -> str:
        cut = ""
        if self.kill in ("cut", "partition"):
            cut = (
                f"; cut: old primary no longer writable after {self.demoted_s} s "
                f"({self.old_state} at the heal), dropped {self.cut_dropped}, rows only on the "
                f"old primary {self.only_on_old} (acknowledged: {self.acked_only_on_old}); "
                f"healed: rejoined as a replica after {self.rejoined_s} s, pg_rewind "
                f"{'ran' if self.rewound else 'not needed'} ({self.sync_waits_cancelled} commits "
                "waiting for the standby were cancelled on the old primary, none acknowledged), "
                "acknowledged writes missing on it "
                f"{self.replica_missing}"
            )
        if self.storm:
            cut += f"; storm: {json.dumps(self.storm)}"
        return (
            cut.lstrip("; ")
            + "\n"
            + (
                f"leader {self.leader_before} -> {self.leader_after}: promoted {self.promoted_s:.2f} s "
                f"after the kill, first 2xx claim {self.first_claim_s:.2f} s, first DHCP ACK "
                f"{self.first_ack_s:.2f} s; {self.orphaned} writes sent after the kill were "
                f"acknowledged by the old primary's last backends; fencing age {self.fence_after_s:.0f} s, fenced: "
                f"{self.fenced or 'none'}; {len(self.acked)} leases ACKed, {len(self.claims)} claims "
                f"2xx, {len(self.event_ids)} event ids; lost: {len(self.lost_leases)} leases, "
                f"{len(self.lost_claims)} claims, {len(self.lost_events)} events; "
                f"outcomes {dict(self.outcomes)}"
            )
        )


def _conf(tmp: Path, name: str, listen: str, url: str, extra: str = "") -> Path:
    conf = tmp / f"{name}.toml"
    conf.write_text(
        f'state_dir = "{tmp / name}"\ninstance = "{name}"\n[store]\nurl = "{url}"\n'
        f'[api]\nlisten = "{listen}"\n'
        f"[fleet]\nheartbeat_s = {HEARTBEAT_S}\ndead_after_s = {DEAD_AFTER_S}\n" + extra
    )
    return conf


def storm_boot(tmp: Path) -> str:
    """The boot plane bench/storm.py's simulation expects (its metald_config's [boot],
    [enroll] and [provision] tables), on the instance's ``vs`` leg."""
    (tmp / "assets").mkdir(exist_ok=True)
    return f"""[boot]
enabled = true
dhcp_mode = "full"
interfaces = ["vs"]
server_address = "{STORM_SRV}"
router_advertisements = false
assets_dir = "{tmp / "assets"}"
script_clients = "any"
[[boot.networks]]
name = "storm"
subnet = "10.77.0.0/16"
pool_start = "10.77.1.0"
pool_end = "10.77.250.255"
lease_seconds = 3600
interface = "vs"
[enroll]
after_inspection = "poweroff"
[[enroll.rules]]
match = {{ gpu_model = "NVIDIA H100*" }}
labels = {{ pool = "storm" }}
min_gpu_count = 8
[provision]
progress_event_interval_s = 0
"""


def wait_http(addr: str, proc: subprocess.Popen[bytes], log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"metald exited with {proc.returncode}: {log.read_text()[-3000:]}")
        try:
            urllib.request.urlopen(f"http://{addr}/healthz", timeout=1).read()
            return
        except OSError:
            time.sleep(0.2)
    raise AssertionError(f"metald did not come up at {addr}: {log.read_text()[-3000:]}")


def old_primary_state(lab: PatroniLab, node: PgNode) -> str:
    """``primary`` (takes writes), ``read-only`` (in recovery) or ``stopped``, asked over its
    Unix socket (reachable while its host is cut)."""
    try:
        with psycopg.connect(lab.local_conninfo(node, "postgres"), connect_timeout=2) as c:
            rec = c.execute("SELECT pg_is_in_recovery()").fetchone()
            return "read-only" if rec and rec[0] else "primary"
    except psycopg.Error:
        return "stopped"


def rows(conninfo: str) -> tuple[dict[str, str], set[str], set[int]] | None:
    """Bound leases (mac -> ip), claim ids, event ids of one PostgreSQL node, or None."""
    try:
        with psycopg.connect(conninfo, connect_timeout=3) as c:
            leases: dict[str, str] = {
                m: ip
                for m, ip in c.execute(
                    "SELECT mac, ip FROM leases WHERE network = 'prov' AND state = 'bound'"
                ).fetchall()
            }
            claims = {x for (x,) in c.execute("SELECT id FROM claims").fetchall()}
            events = {x for (x,) in c.execute("SELECT id FROM events").fetchall()}
            return leases, claims, events
    except psycopg.Error:
        return None


async def dhcp_node(store: Store, relay: socket.socket) -> DhcpNode:
    """tests.fleet.test_dhcp_peers.node with metald's default fleet timings."""
    ip = "127.0.0.2"
    m = Membership(
        store,
        "dhcp0",
        heartbeat_s=HEARTBEAT_S,
        dead_after_s=DEAD_AFTER_S,
        serves={"provisioning_networks": [str(SUBNET)]},
    )
    await m.start()
    leases = LeaseStore(store)
    await leases.load()
    srv = DhcpServer(
        mode="full",
        interfaces=["lo"],
        networks=[plan()],
        server_id=IPv4Address(ip),
        files=BootFiles(http_base="http://127.0.0.1:1"),
        leases=leases,
        port=0,
        bind_host=ip,
        relay_port=relay.getsockname()[1],
    )
    lf, peers = join_fleet(srv, m, takeover_secs=10)
    await peers.start()
    await lf.start()
    await asyncio.wait_for(lf.connected.wait(), 10)
    await srv.start()
    return DhcpNode("dhcp0", IPv4Address(ip), m, leases, srv, lf, peers)


async def until(cond: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        await asyncio.sleep(0.05)


async def failover_round(
    tmp: Path,
    relay: socket.socket,
    *,
    instances: int = 2,
    machines: int = 300,
    kill: str = "postmaster",
    storm: int = 0,
) -> Round:
    """Start the lab and the instances, run the load, kill the primary, measure, check.

    ``kill``: ``postmaster`` (``kill -9`` of the primary's postmaster; its Patroni fails over at
    its next cycle) or ``node`` (``kill -9`` of that node's Patroni, then of its postmaster: the
    host is gone, and the standby takes over once the leader key's ``ttl`` runs out) or
    ``cut`` (the primary's host cut off with nftables, then healed: see the module's
    docstring). ``storm``: that many simulated machines enroll meanwhile (netns mode)."""
    r = Round(kill=kill)
    cuts = kill in ("cut", "partition")
    in_ns = cuts or storm > 0
    # etcd on hosts of its own, as deploy/patroni/ ships it; METALD_PG_ETCD_APART=0: etcd1 and
    # etcd2 beside pg1 and pg2 (the layout that shows Patroni 3.0's split brain at a heal).
    # METALD_PG_DCS: JSON laid over the shipped bootstrap.dcs (bench/pg_failover.py --dcs).
    lab = PatroniLab(
        netns=in_ns,
        etcd_apart=in_ns and os.environ.get("METALD_PG_ETCD_APART") != "0",
        dcs=json.loads(os.environ.get("METALD_PG_DCS") or "{}"),
    )
    procs: list[subprocess.Popen[bytes]] = []
    storm_proc: subprocess.Popen[str] | None = None
    dhcp: DhcpNode | None = None
    store: Store | None = None
    try:
        lab.start()
        lab.wait_ready(timeout=180)
        lab.create_database("metald")
        url = lab.url("metald")
        addrs: list[str] = []
        cli_ns = None
        for i in range(instances):
            name = f"api{i}"
            if i > 0:  # every instance on one database shares its secrets key
                (tmp / name).mkdir(mode=0o700)
                shutil.copy2(tmp / "api0" / "secrets.key", tmp / name / "secrets.key")
            argv = [str(BIN / "metald"), "serve", "--config"]
            extra, listen = "", f"127.0.0.1:{free_port()}"
            addr = listen
            if lab.net is not None:  # each instance on a host of its own on the bridge
                ns, ip = lab.net.add(f"m{i}", 31 + i)
                listen, addr = f"{ip}:8080", f"{ip}:8080"
                if i == 0 and storm:  # the storm's boot plane: a leg to the machines' side
                    cli_ns = lab.net.namespace("cli")
                    netns.veth(ns, "vs", cli_ns, "vc")
                    netns.address(ns, "vs", f"{STORM_SRV}/16")
                    netns.address(cli_ns, "vc", f"{STORM_CLI}/16")
                    extra, listen = storm_boot(tmp), "0.0.0.0:8080"
                argv = netns.exec_argv(ns, argv)
            log = tmp / f"{name}.log"
            proc = subprocess.Popen(
                [*argv, str(_conf(tmp, name, listen, url, extra))],
                stderr=open(log, "w"),  # noqa: SIM115 - closed with the process
            )
            lab.track(name, proc.pid)
            procs.append(proc)
            addrs.append(addr)
            wait_http(addr, proc, log, timeout=120)  # the first migrates, writes the admin token
        admin = (tmp / "api0" / "admin.token").read_text().strip()
        store = Store(url)
        # The load's claims take only these (the storm's machines are pool=storm).
        if cuts:  # a longer round (a ttl, then a heal): more for the claims to take
            machines = max(machines, 3000)
        add_ready(store, machines, labels={"pool": "load"})
        tenant = add_tenant(store, "acme")
        image = add_image(store)
        code, _, tok = http(
            addrs[0],
            "POST",
            "/api/v1/tokens",
            admin,
            {"name": "orch", "role": "orchestrator", "scope": [tenant]},
        )
        assert code == 201, tok
        orch = tok["token"]
        dhcp = await dhcp_node(store, relay)

        # (sent, answered) of each acknowledged write. After a postmaster's kill -9 its
        # backends live on for a moment (each exits when it notices), and may still commit
        # (and replicate) a write sent after the kill: those are counted (``orphaned``) and
        # checked like the others; "the first write after the kill" is the first answered
        # after the promotion was seen.
        claim_at: list[tuple[float, float]] = []
        ack_at: list[tuple[float, float]] = []
        stop = asyncio.Event()

        def outcome(what: str, code: int, headers: Any, body: Any) -> bool:
            r.outcomes[f"{what} {code}"] += 1
            if 200 <= code < 300:
                return True
            ok = (
                code == 503
                and headers.get("Content-Type", "").startswith("application/problem+json")
                and headers.get("Retry-After")
            )
            if not ok:
                r.bad.append((what, code, dict(headers), body))
            return False

        async def claim_load(addr: str) -> None:
            while not stop.is_set():
                sent = time.monotonic()
                got = await asyncio.to_thread(
                    http,
                    addr,
                    "POST",
                    "/api/v1/claims",
                    orch,
                    {
                        "tenant_id": tenant,
                        "count": 1,
                        "image_id": image,
                        "selector": {"labels": {"pool": "load"}},
                    },
                )
                if outcome("claim", *got):
                    r.claims.append(got[2]["id"])
                    claim_at.append((sent, time.monotonic()))
                else:
                    await asyncio.sleep(0.05)

        async def event_load(addr: str) -> None:
            while not stop.is_set():
                got = await asyncio.to_thread(
                    http, addr, "GET", "/api/v1/events?limit=50&sort=-id", admin
                )
                if outcome("events", *got):
                    r.event_ids.update(e["id"] for e in got[2]["items"])
                await asyncio.sleep(0.1)

        async def dhcp_load() -> None:
            # A client keeps its MAC until it is ACKed (as a real one retries), so the
            # addresses offered during the outage are not a new client's each time: the pool
            # (200) is not drained by an outage's retries.
            assert dhcp is not None
            i = tries = 0
            while not stop.is_set():
                # 150 clients over and over (the pool holds 200): a client that comes back gets
                # its address again, ACKed only once the renewed lease committed, like a new one.
                m, xid = mac(i % 150), 0x10000 + 2 * tries
                tries += 1
                sent = time.monotonic()
                offers = await send([dhcp], relay, discover(m, xid))
                if offers:
                    off, src = offers[0]
                    acks = await send(
                        [dhcp], relay, selecting(m, xid + 1, off.yiaddr, IPv4Address(src))
                    )
                    for a, _ in acks:
                        if a.message_type is MessageType.ACK:
                            r.acked[m] = a.yiaddr
                            ack_at.append((sent, time.monotonic()))
                            i += 1
                        r.outcomes[f"dhcp {a.message_type.name}"] += 1  # type: ignore[union-attr]
                else:
                    r.outcomes["dhcp silent"] += 1
                await asyncio.sleep(0.02)

        dhcp_fenced: list[float] = []

        async def watch_fence() -> None:
            assert dhcp is not None
            while not stop.is_set():
                if dhcp.fleet.fenced:
                    dhcp_fenced.append(time.monotonic())
                await asyncio.sleep(0.05)

        load = [
            asyncio.create_task(watch_fence()),
            *(asyncio.create_task(claim_load(a)) for a in addrs),
            *(asyncio.create_task(event_load(a)) for a in addrs),
            asyncio.create_task(dhcp_load()),
        ]
        storm_out: asyncio.Task[str] | None = None
        try:
            await until(
                lambda: len(r.claims) >= 5 and len(r.acked) >= 5 and r.event_ids, 120, "load"
            )
            if storm:
                assert cli_ns is not None
                storm_proc, storm_out = start_storm(tmp, cli_ns, storm, procs[0].pid)
                # Kill in the thick of it: a third of the machines ready.
                await storm_progress(store, storm // 3, storm_proc, storm_out, tmp)
            old = lab.leader()
            assert old is not None
            r.leader_before = old.name
            if kill == "node":
                assert old.proc is not None
                old.proc.kill()
            if kill == "cut":
                lab.cut(old)
            elif kill == "partition":  # its replication alone goes on
                standby = next(n for n in lab.nodes if n.name != old.name)
                lab.cut(old, allow=[standby.host])
            elif kill != "none":
                lab.kill_postmaster(old)
            killed = time.monotonic()
            if kill == "none":  # the baseline: no failover; the load goes on through the storm
                r.leader_after = old.name
                n = len(r.claims)
                await until(lambda: len(r.claims) >= n + 3, 60, "claims go on")
            else:

                def promoted() -> bool:
                    new = lab.leader()
                    return new is not None and new.name != old.name and lab._writable(new)

                # Polled in a thread: Patroni's REST calls block.
                while not await asyncio.to_thread(promoted):
                    if time.monotonic() - killed > 120:
                        raise TimeoutError(f"no standby promoted in 120 s: {lab.cluster()}")
                    if (
                        cuts
                        and r.demoted_s is None
                        and await asyncio.to_thread(old_primary_state, lab, old) != "primary"
                    ):
                        r.demoted_s = time.monotonic() - killed
                    await asyncio.sleep(0.05)
                promoted_at = time.monotonic()
                r.promoted_s = promoted_at - killed
                if cuts:  # two primaries at once: the split brain a partition invites
                    state = await asyncio.to_thread(old_primary_state, lab, old)
                    r.both_primary = state == "primary"
                leader = lab.leader()
                r.leader_after = leader.name if leader else "?"
                await until(
                    lambda: (
                        claim_at
                        and claim_at[-1][1] > promoted_at
                        and ack_at
                        and ack_at[-1][1] > promoted_at
                    ),
                    120,
                    "a claim and an ACK after the kill",
                )
                r.first_claim_s = min(d for _, d in claim_at if d > promoted_at) - killed
                r.first_ack_s = min(d for _, d in ack_at if d > promoted_at) - killed
                r.orphaned = sum(
                    1 for sent, done in (*claim_at, *ack_at) if sent > killed and done < promoted_at
                )
                n = len(r.claims)
                await until(lambda: len(r.claims) >= n + 3, 60, "claims go on")
                if cuts:
                    await cut_then_heal(r, lab, old, killed)
                    n = len(r.claims)
                    await until(lambda: len(r.claims) >= n + 3, 60, "claims go on after the heal")
            if storm_out is not None:
                assert storm_proc is not None
                r.storm = await storm_result(storm_proc, storm_out, tmp)
        finally:
            stop.set()
            await asyncio.gather(*load, return_exceptions=True)

        for i, proc in enumerate(procs):
            assert proc.poll() is None, f"api{i} exited"
            if FENCED_LOG in (tmp / f"api{i}.log").read_text():
                r.fenced.append(f"api{i}")
        if dhcp_fenced:
            r.fenced.append("dhcp0")

        # Every acknowledged write is on the new primary (the URL only connects to it).
        with store.session() as s:
            rows = {
                m: ip
                for m, ip in s.execute(
                    text("SELECT mac, ip FROM leases WHERE network = 'prov' AND state = 'bound'")
                ).all()
            }
            r.lost_leases = {m: ip for m, ip in r.acked.items() if rows.get(m) != str(ip)}
            got_claims = {x for (x,) in s.execute(text("SELECT id FROM claims")).all()}
            got_events = {x for (x,) in s.execute(text("SELECT id FROM events")).all()}
        r.lost_claims = set(r.claims) - got_claims
        r.lost_events = r.event_ids - got_events
        if cuts:  # and on the old primary, a replica again
            r.replica_missing = await replica_missing(r, lab, old)
        if storm:
            with store.session() as s:
                r.storm["ready_in_db"] = s.execute(
                    text(
                        "SELECT count(*) FROM machines WHERE state = 'ready' "
                        "AND labels->>'pool' = 'storm'"
                    )
                ).scalar_one()
        return r
    finally:
        if storm_proc is not None and storm_proc.poll() is None:
            storm_proc.kill()
            storm_proc.wait()
        if dhcp is not None:
            await dhcp.stop()
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
        if store is not None:
            store.close()
        # Keep etcd's and Patroni's logs with the test's (the lab's folder goes with it).
        (tmp / "lab").mkdir(exist_ok=True)
        for f in lab.root.glob("*.log"):
            shutil.copy2(f, tmp / "lab" / f.name)
        lab.stop()


async def cut_then_heal(r: Round, lab: PatroniLab, old: PgNode, cut_at: float) -> None:
    """The cut is on and a standby promoted: wait for the old primary to stop taking writes,
    compare what it holds with the new primary, heal, wait for it to stream again."""
    deadline = time.monotonic() + 90
    while r.demoted_s is None:
        if await asyncio.to_thread(old_primary_state, lab, old) != "primary":
            r.demoted_s = time.monotonic() - cut_at
        elif time.monotonic() > deadline:
            raise AssertionError("the cut-off old primary still takes writes after 90 s")
        else:
            await asyncio.sleep(0.2)
    r.old_state = await asyncio.to_thread(old_primary_state, lab, old)
    assert old.ns is not None
    r.cut_dropped = dropped(old.ns)
    on_old = await asyncio.to_thread(rows, lab.local_conninfo(old, "metald"))
    new = lab.leader()
    assert new is not None
    on_new = await asyncio.to_thread(rows, lab.conninfo(new, "metald"))
    assert on_new is not None, "the new primary does not answer"
    if on_old is not None:
        only = (
            {m for m, ip in on_old[0].items() if on_new[0].get(m) != ip},
            on_old[1] - on_new[1],
            on_old[2] - on_new[2],
        )
        r.only_on_old = sum(len(x) for x in only)
        r.acked_only_on_old = (
            len(only[0] & set(r.acked)) + len(only[1] & set(r.claims)) + len(only[2] & r.event_ids)
        )
    lab.heal(old)
    healed = time.monotonic()
    deadline = healed + 180
    while True:
        c = await asyncio.to_thread(lab.cluster) or {}
        members = {m["name"]: m for m in c.get("members", [])}
        me = members.get(old.name, {})
        lead: dict[str, Any] = next((m for m in members.values() if m["role"] == "leader"), {})
        # Patroni 3.0 says "running" for a replica that streams (later ones "streaming").
        if (
            me.get("role") in ("replica", "sync_standby")
            and me.get("state") in ("running", "streaming")
            and lead.get("name") != old.name
            and me.get("timeline") == lead.get("timeline")
            and await asyncio.to_thread(old_primary_state, lab, old) == "read-only"
        ):
            break
        if time.monotonic() > deadline:
            # Not a replica: record what Patroni made of it and go on to the checks of what
            # was acknowledged (the caller asserts rejoined_s).
            r.after_heal = c
            r.failback = lead.get("name") == old.name
            break
        await asyncio.sleep(0.2)
    if r.after_heal is None:
        r.rejoined_s = time.monotonic() - healed
    log = lab.log(old.name)
    r.rewound = "running pg_rewind" in log
    # Commits that reached the old primary alone and waited for the standby's flush: never
    # acknowledged; PostgreSQL cancels the wait when Patroni demotes it, pg_rewind drops them.
    r.sync_waits_cancelled = log.count("canceling the wait for synchronous replication")
    new_log = lab.log(new.name)
    r.waited = {
        "still alive": new_log.count("is still alive"),
        "ahead": new_log.count("is ahead of my wal position"),
    }


async def replica_missing(r: Round, lab: PatroniLab, old: PgNode) -> int:
    """Acknowledged writes not (yet) on the rejoined old primary; waits up to 60 s for it to
    replay what the new primary has."""
    deadline = time.monotonic() + 60
    while True:
        got = await asyncio.to_thread(rows, lab.local_conninfo(old, "metald"))
        missing = -1
        if got is not None:
            missing = (
                sum(1 for m, ip in r.acked.items() if got[0].get(m) != str(ip))
                + len(set(r.claims) - got[1])
                + len(r.event_ids - got[2])
            )
            if missing == 0:
                return 0
        if time.monotonic() > deadline:
            return missing
        await asyncio.sleep(0.5)


def start_storm(
    tmp: Path, cli_ns: str, machines: int, metald_pid: int
) -> tuple[subprocess.Popen[str], asyncio.Task[str]]:
    """bench/storm.py's simulation in the client namespace, enrollment only, patient (its
    agents retry through a failover, as the real agent does); its stdout is read by a task."""
    params = {
        "machines": machines,
        "claim_size": 10,
        "enroll_only": True,
        "connections": 64,
        "metald_pid": metald_pid,
        "admin_token": str(tmp / "api0" / "admin.token"),
        "patient": True,
        "count_filter": "&label=pool%3Dstorm",  # the load's machines are ready too
    }
    proc = subprocess.Popen(
        netns.exec_argv(
            cli_ns,
            [sys.executable, str(ROOT / "bench" / "storm.py"), "--_client", json.dumps(params)],
        ),
        stdout=subprocess.PIPE,
        stderr=open(tmp / "storm.log", "w"),  # noqa: SIM115 - closed with the process
        text=True,
        cwd=ROOT,
    )
    assert proc.stdout is not None
    return proc, asyncio.create_task(asyncio.to_thread(proc.stdout.read))


async def storm_progress(
    store: Store, ready: int, proc: subprocess.Popen[str], out: asyncio.Task[str], tmp: Path
) -> None:
    """Wait for ``ready`` storm machines to be ready."""
    deadline = time.monotonic() + 600

    def count() -> int:
        with store.session() as s:
            return int(
                s.execute(
                    text(
                        "SELECT count(*) FROM machines WHERE state = 'ready' "
                        "AND labels->>'pool' = 'storm'"
                    )
                ).scalar_one()
            )

    while await asyncio.to_thread(count) < ready:
        if out.done() or proc.poll() is not None:
            raise AssertionError(
                f"the storm ended early: {(tmp / 'storm.log').read_text()[-3000:]}"
            )
        if time.monotonic() > deadline:
            raise AssertionError("the storm made no progress in 600 s")
        await asyncio.sleep(0.2)


async def storm_result(
    proc: subprocess.Popen[str], out: asyncio.Task[str], tmp: Path
) -> dict[str, Any]:
    text_out = await asyncio.wait_for(out, 900)
    proc.wait(timeout=30)
    line = next((x for x in text_out.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise AssertionError(f"no storm result: {(tmp / 'storm.log').read_text()[-3000:]}")
    res = json.loads(line[len("RESULT ") :])
    if "error" in res:
        raise AssertionError(f"storm: {res['error']}; {(tmp / 'storm.log').read_text()[-2000:]}")
    p1 = res["phase1"]
    keep = ("wall_s", "ready", "dora", "dhcp_retransmits", "pxe_restarts", "http_retries",
            "server_errors", "p50_s", "p99_s", "machines_held_up", "max_s",
            "inventory_answers_lost")  # fmt: skip
    return {"machines": res["machines"], **{k: p1.get(k) for k in keep}}
