"""Restart PostgreSQL under load, cleanly (``-m fast``) and as a crash (``-m immediate``):
nothing acknowledged is lost, metald reconnects and goes on without being restarted, and what
failed during the outage failed cleanly.

Real parts: a private PostgreSQL (Debian's binaries) the test restarts; a metald process taking
claims and answering the API; a DHCP server (``DhcpServer``, ``LeaseStore``, ``LeaseFeed``,
``Membership``) on the same database answering DORAs through a relay socket. The load runs
while PostgreSQL restarts; afterwards every ACKed lease, every 2xx claim and every event id the
API returned is read back from the database. During the outage an API call answers 2xx or 503
problem+json with Retry-After (never a 500), and a DHCP client is answered (after its lease is
durable) or not at all.

PostgreSQL here runs with ``fsync=off`` (tests/conftest's server): an immediate shutdown kills
the server processes, not the machine, so committed data is in the OS's page cache and WAL
replay finds it; power loss is not simulated.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections import Counter
from ipaddress import IPv4Address
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from metald.boot import metrics
from metald.boot.dhcp.packet import MessageType
from metald.store import Store
from tests.claims.helpers import add_image, add_ready, add_tenant
from tests.fleet.test_dhcp_peers import discover, mac, node, relay, selecting, send  # noqa: F401
from tests.fleet.test_membership import wait_for
from tests.test_daemon import BIN, wait_http
from vmlab.labnet import free_port
from vmlab.pg import PgServer

pytestmark = pytest.mark.postgres

MODES = ("fast", "immediate")


def _conf(tmp: Path, port: int, url: str) -> Path:
    conf = tmp / "m.toml"
    conf.write_text(
        f'state_dir = "{tmp / "state"}"\ninstance = "api0"\n[store]\nurl = "{url}"\n'
        f'[api]\nlisten = "127.0.0.1:{port}"\n'
        "[fleet]\nheartbeat_s = 0.5\ndead_after_s = 3.0\n"
    )
    return conf


def _http(port: int, method: str, path: str, token: str, body: Any = None) -> tuple[int, Any, Any]:
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


def restart(pg: PgServer, mode: str) -> None:
    pg._run(["pg_ctl", "-D", str(pg.data), "-m", mode, "-l", str(pg.dir / "log"), "-w", "restart"])


def _dhcp_dropped() -> float:
    """DHCP packets not answered because the store was away (read, write, or fenced)."""
    return (
        sum(
            metrics.dhcp_dropped.labels(r)._value.get()
            for r in ("lease-read-failed", "lease-write-failed")
        )
        + metrics.dhcp_ignored.labels("fenced")._value.get()
    )


async def test_restart_postgresql_under_load_nothing_acknowledged_is_lost(
    tmp_path: Path,
    relay: socket.socket,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="metald")
    pg = PgServer()
    proc: subprocess.Popen | None = None
    dhcp = None
    store: Store | None = None
    try:
        url = pg.new_database()
        port = free_port()
        proc = subprocess.Popen(
            [BIN / "metald", "serve", "--config", _conf(tmp_path, port, url)],
            stderr=open(tmp_path / "metald.log", "w"),  # noqa: SIM115 - closed with the process
        )
        wait_http(port, proc)
        admin = (tmp_path / "state" / "admin.token").read_text().strip()
        store = Store(url)
        add_ready(store, 200)
        tenant = add_tenant(store, "acme")
        image = add_image(store)
        code, _, tok = _http(
            port,
            "POST",
            "/api/v1/tokens",
            admin,
            {"name": "orch", "role": "orchestrator", "scope": [tenant]},
        )
        assert code == 201, tok
        orch = tok["token"]
        dhcp = await node(store, "dhcp0", "127.0.0.2", relay)

        claims: list[str] = []
        acked: dict[str, IPv4Address] = {}
        event_ids: set[int] = set()
        outcomes: Counter[str] = Counter()
        bad: list[Any] = []
        stop = asyncio.Event()
        claim_at: list[float] = []
        ack_at: list[float] = []
        gaps: dict[str, str] = {}

        def outcome(what: str, code: int, headers: Any, body: Any) -> bool:
            if 200 <= code < 300:
                outcomes[f"{what} {code}"] += 1
                return True
            ok = (
                code == 503
                and headers.get("Content-Type", "").startswith("application/problem+json")
                and headers.get("Retry-After")
                and body.get("detail")
            )
            outcomes[f"{what} {code}"] += 1
            if not ok:
                bad.append((what, code, dict(headers), body))
            return False

        async def claim_load() -> None:
            while not stop.is_set():
                got = await asyncio.to_thread(
                    _http,
                    port,
                    "POST",
                    "/api/v1/claims",
                    orch,
                    {"tenant_id": tenant, "count": 1, "image_id": image},
                )
                if outcome("claim", *got):
                    claims.append(got[2]["id"])
                    claim_at.append(time.monotonic())

        async def event_load() -> None:
            while not stop.is_set():
                got = await asyncio.to_thread(
                    _http, port, "GET", "/api/v1/events?limit=50&sort=-id", admin
                )
                if outcome("events", *got):
                    event_ids.update(e["id"] for e in got[2]["items"])
                await asyncio.sleep(0.05)

        async def dhcp_load() -> None:
            i = 0
            while not stop.is_set():
                m, xid = mac(i), 0x10000 + 2 * i
                offers = await send([dhcp], relay, discover(m, xid))
                if offers:
                    off, src = offers[0]
                    acks = await send(
                        [dhcp], relay, selecting(m, xid + 1, off.yiaddr, IPv4Address(src))
                    )
                    if not acks:
                        outcomes["dhcp no-ack"] += 1
                    for a, _ in acks:
                        if a.message_type is MessageType.ACK:
                            acked[m] = a.yiaddr
                            ack_at.append(time.monotonic())
                        outcomes[f"dhcp {a.message_type.name}"] += 1  # type: ignore[union-attr]
                else:
                    outcomes["dhcp silent"] += 1
                i += 1
                await asyncio.sleep(0.01)

        load = [
            asyncio.create_task(claim_load()),
            asyncio.create_task(event_load()),
            asyncio.create_task(dhcp_load()),
        ]
        dropped_before = _dhcp_dropped()
        try:
            for mode in (*MODES, None):
                n_claims, n_acks = len(claims), len(acked)
                # The load goes on (after a restart: metald came back without a restart).
                await wait_for(
                    lambda n_claims=n_claims, n_acks=n_acks: (
                        len(claims) >= n_claims + 3 and len(acked) >= n_acks + 3 and event_ids
                    ),
                    timeout=60,
                )
                if mode is not None:
                    began = time.monotonic()
                    await asyncio.to_thread(restart, pg, mode)
                    back = time.monotonic()
                    await wait_for(lambda b=back: claim_at[-1] > b and ack_at[-1] > b, timeout=60)
                    first_claim = min(t for t in claim_at if t > back) - began
                    first_ack = min(t for t in ack_at if t > back) - began
                    gaps[mode] = (
                        f"restart {back - began:.2f} s, next 2xx claim {first_claim:.2f} s, "
                        f"next ACK {first_ack:.2f} s"
                    )
            await wait_for(lambda: dhcp.feed.connected.is_set(), timeout=30)
        finally:
            stop.set()
            await asyncio.gather(*load, return_exceptions=True)

        assert proc.poll() is None, "metald exited"
        assert not bad, bad
        log = (tmp_path / "metald.log").read_text()
        assert "unhandled error" not in log and "Traceback" not in log, log[-4000:]
        traced = [r.getMessage() for r in caplog.records if r.exc_info]
        assert not traced, traced  # the in-process DHCP server's failures: warnings, no trace

        # Every acknowledged write is there.
        with store.session() as s:
            rows = {
                r[0]: r[1]
                for r in s.execute(
                    text("SELECT mac, ip FROM leases WHERE network = 'prov' AND state = 'bound'")
                ).all()
            }
            missing_leases = {m: ip for m, ip in acked.items() if rows.get(m) != str(ip)}
            got_claims = {r[0] for r in s.execute(text("SELECT id FROM claims")).all()}
            got_events = {r[0] for r in s.execute(text("SELECT id FROM events")).all()}
        assert not missing_leases, missing_leases
        assert set(claims) <= got_claims, set(claims) - got_claims
        assert event_ids <= got_events, event_ids - got_events
        print(
            f"\npg restart ({', '.join(MODES)}) under load: {len(acked)} leases ACKed, "
            f"{len(claims)} claims 2xx, {len(event_ids)} event ids returned, none lost; "
            f"outcomes {dict(outcomes)}; DHCP packets dropped while the store was away "
            f"{_dhcp_dropped() - dropped_before:.0f}; after the restart command began: {gaps}"
        )
    finally:
        if dhcp is not None:
            await dhcp.stop()
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
        if store is not None:
            store.close()
        pg.stop()
