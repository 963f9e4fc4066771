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
"""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from ipaddress import IPv4Address
from pathlib import Path
from typing import Any

from sqlalchemy import text

from metald.boot.dhcp.bootfile import BootFiles
from metald.boot.dhcp.lease_store import LeaseStore
from metald.boot.dhcp.packet import MessageType
from metald.boot.dhcp.server import DhcpServer
from metald.boot.plane import join_fleet
from metald.fleet.membership import Membership
from metald.store import Store
from tests.claims.helpers import add_image, add_ready, add_tenant
from tests.fleet.patroni_lab import PatroniLab
from tests.fleet.test_dhcp_peers import SUBNET, discover, mac, plan, selecting, send
from tests.fleet.test_dhcp_peers import Node as DhcpNode
from tests.test_daemon import BIN, wait_http
from vmlab.labnet import free_port

HEARTBEAT_S, DEAD_AFTER_S = 2.0, 10.0
FENCED_LOG = "fenced: no heartbeat written"


def http(port: int, method: str, path: str, token: str, body: Any = None) -> tuple[int, Any, Any]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
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

    @property
    def fence_after_s(self) -> float:
        return DEAD_AFTER_S - HEARTBEAT_S

    def as_json(self) -> dict[str, Any]:
        return {
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
        return (
            f"leader {self.leader_before} -> {self.leader_after}: promoted {self.promoted_s:.2f} s "
            f"after the kill, first 2xx claim {self.first_claim_s:.2f} s, first DHCP ACK "
            f"{self.first_ack_s:.2f} s; {self.orphaned} writes sent after the kill were "
            f"acknowledged by the old primary's last backends; fencing age {self.fence_after_s:.0f} s, fenced: "
            f"{self.fenced or 'none'}; {len(self.acked)} leases ACKed, {len(self.claims)} claims "
            f"2xx, {len(self.event_ids)} event ids; lost: {len(self.lost_leases)} leases, "
            f"{len(self.lost_claims)} claims, {len(self.lost_events)} events; "
            f"outcomes {dict(self.outcomes)}"
        )


def _conf(tmp: Path, name: str, port: int, url: str) -> Path:
    conf = tmp / f"{name}.toml"
    conf.write_text(
        f'state_dir = "{tmp / name}"\ninstance = "{name}"\n[store]\nurl = "{url}"\n'
        f'[api]\nlisten = "127.0.0.1:{port}"\n'
        f"[fleet]\nheartbeat_s = {HEARTBEAT_S}\ndead_after_s = {DEAD_AFTER_S}\n"
    )
    return conf


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
) -> Round:
    """Start the lab and the instances, run the load, kill the primary, measure, check.

    ``kill``: ``postmaster`` (``kill -9`` of the primary's postmaster; its Patroni fails over at
    its next cycle) or ``node`` (``kill -9`` of that node's Patroni, then of its postmaster: the
    host is gone, and the standby takes over once the leader key's ``ttl`` runs out)."""
    r = Round()
    lab = PatroniLab()
    procs: list[subprocess.Popen[bytes]] = []
    dhcp: DhcpNode | None = None
    store: Store | None = None
    try:
        lab.start()
        lab.wait_ready(timeout=180)
        lab.create_database("metald")
        url = lab.url("metald")
        ports = [free_port() for _ in range(instances)]
        for i, port in enumerate(ports):
            name = f"api{i}"
            if i > 0:  # every instance on one database shares its secrets key
                (tmp / name).mkdir(mode=0o700)
                shutil.copy2(tmp / "api0" / "secrets.key", tmp / name / "secrets.key")
            proc = subprocess.Popen(
                [BIN / "metald", "serve", "--config", _conf(tmp, name, port, url)],
                stderr=open(tmp / f"{name}.log", "w"),  # noqa: SIM115 - closed with the process
            )
            procs.append(proc)
            wait_http(port, proc, timeout=120)  # the first migrates and writes the admin token
        admin = (tmp / "api0" / "admin.token").read_text().strip()
        store = Store(url)
        add_ready(store, machines)
        tenant = add_tenant(store, "acme")
        image = add_image(store)
        code, _, tok = http(
            ports[0],
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

        async def claim_load(port: int) -> None:
            while not stop.is_set():
                sent = time.monotonic()
                got = await asyncio.to_thread(
                    http,
                    port,
                    "POST",
                    "/api/v1/claims",
                    orch,
                    {"tenant_id": tenant, "count": 1, "image_id": image},
                )
                if outcome("claim", *got):
                    r.claims.append(got[2]["id"])
                    claim_at.append((sent, time.monotonic()))
                else:
                    await asyncio.sleep(0.05)

        async def event_load(port: int) -> None:
            while not stop.is_set():
                got = await asyncio.to_thread(
                    http, port, "GET", "/api/v1/events?limit=50&sort=-id", admin
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
                m, xid = mac(i), 0x10000 + 2 * tries
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
            *(asyncio.create_task(claim_load(p)) for p in ports),
            *(asyncio.create_task(event_load(p)) for p in ports),
            asyncio.create_task(dhcp_load()),
        ]
        try:
            await until(
                lambda: len(r.claims) >= 5 and len(r.acked) >= 5 and r.event_ids, 120, "load"
            )
            old = lab.leader()
            assert old is not None
            r.leader_before = old.name
            if kill == "node":
                assert old.proc is not None
                old.proc.kill()
            lab.kill_postmaster(old)
            killed = time.monotonic()

            def promoted() -> bool:
                new = lab.leader()
                return new is not None and new.name != old.name and lab._writable(new)

            # Polled in a thread: Patroni's REST calls block.
            while not await asyncio.to_thread(promoted):
                if time.monotonic() - killed > 120:
                    raise TimeoutError(f"no standby promoted in 120 s: {lab.cluster()}")
                await asyncio.sleep(0.05)
            promoted_at = time.monotonic()
            r.promoted_s = promoted_at - killed
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
        return r
    finally:
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
        lab.stop()
