"""The web console's fleet page with a large fleet: server time per request.

    .venv/bin/python bench/ui_fleet.py [--machines 5000] [--runs 30] [--db URL]

Fills a fresh SQLite store (or ``--db``, e.g. a PostgreSQL URL) with N machines the way a
fleet looks (a NIC and a BMC each, racks of 40, labels, four tenants holding a quarter of the
machines, a commissioning run on every tenth), serves metald's app on loopback, logs in as a
technician and asks for the fleet page ``--runs`` times per view: the first page, a deep page
(keyset cursor), a state + rack filter, searches by MAC, IP and BMC address, a sorted and
two grouped views, and the rack view. Prints the
median and p95 of the whole request (loopback HTTP, so server time plus a little client) and
of the query alone (``metald.usecases.console.fleet_page``). A benchmark, not a test: nothing here passes
or fails on a timing.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import aiohttp
from aiohttp import web

from api.app import create_app, server_settings
from api.context import AppContext
from metald.auth import issue_token
from metald.config import load_config
from metald.events import EventBus
from metald.secrets import SecretBox
from metald.store import Store
from metald.store.models import (
    Bmc,
    CommissioningRun,
    Lease,
    Machine,
    Nic,
    Tenant,
    utcnow,
)
from metald.usecases import console as ui_fleet

STATES = ["ready"] * 6 + ["claimed", "deployed", "maintenance", "broken"]


def fill(store: Store, n: int) -> tuple[str, dict[str, str]]:
    """N machines; returns a technician token and sample values to search for."""
    now = utcnow()
    with store.session() as s:
        tenants = [Tenant(name=f"tenant-{i}") for i in range(4)]
        s.add_all(tenants)
        s.commit()
        tids = [t.id for t in tenants]
        rows, nics, bmcs, leases, runs = [], [], [], [], []
        for i in range(n):
            m = Machine(
                name=f"r{i // 40:03d}-u{i % 40:02d}",
                state=STATES[i % len(STATES)],
                rack=f"r{i // 40:03d}",
                rack_position=f"u{i % 40:02d}",
                labels={"pool": ["blue", "green", "red"][i % 3], "row": str(i // 400)},
                gpu_model=["NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "NVIDIA H200"][i % 3],
                gpu_count=8,
                memory_mb=2 * 1024 * 1024,
                serial=f"SN{i:07d}",
                firmware="2.19.1",
                power_state="on",
                tenant_id=tids[i % 4] if i % 4 == 0 else None,
                state_changed_at=now - timedelta(minutes=i % 600),
            )
            rows.append(m)
            mac = f"52:54:{i >> 24 & 255:02x}:{i >> 16 & 255:02x}:{i >> 8 & 255:02x}:{i & 255:02x}"
            nics.append(Nic(machine_id=m.id, mac=mac, name="eno1", link=True, pxe=True))
            leases.append(
                Lease(
                    network="prov",
                    ip=f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}",
                    mac=mac,
                    state="bound",
                    expires_at=now + timedelta(hours=1),
                )
            )
            bmcs.append(
                Bmc(
                    machine_id=m.id,
                    address=f"10.200.{i >> 8 & 255}.{i & 255}",
                    protocol="ipmi",
                    username="admin",
                    password_enc=b"x",
                    health="ok",
                    power_state="on",
                )
            )
            if i % 10 == 0:
                runs.append(
                    CommissioningRun(
                        machine_id=m.id, profile="gpu", status="passed", requested_by="bench"
                    )
                )
        s.add_all(rows)
        s.commit()
        for group in (nics, leases, bmcs, runs):
            s.add_all(group)
            s.commit()
        _row, secret = issue_token(s, name="bench-tech", role="technician")
    k = n // 2
    return secret, {
        "mac": f"52:54:00:00:{k >> 8 & 255:02x}:{k & 255:02x}",
        "ip": f"10.0.{k >> 8 & 255}.{k & 255}",
        "bmc": f"10.200.{k >> 8 & 255}.{k & 255}",
    }


async def timed(http: aiohttp.ClientSession, url: str, runs: int) -> tuple[list[float], str]:
    times, text = [], ""
    for _ in range(runs):
        t0 = time.perf_counter()
        async with http.get(url) as r:
            text = await r.text()
            assert r.status == 200, (r.status, text[:300])
        times.append((time.perf_counter() - t0) * 1000)
    return times, text


def stats(ms: list[float]) -> str:
    ms = sorted(ms)
    p95 = ms[min(len(ms) - 1, int(len(ms) * 0.95))]
    return f"median {statistics.median(ms):7.1f} ms   p95 {p95:7.1f} ms"


async def main(args: argparse.Namespace) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="ui-fleet-"))
    url = args.db or f"sqlite:///{tmp / 'metald.db'}"
    store = Store(url)
    store.migrate()
    t0 = time.perf_counter()
    secret, sample = fill(store, args.machines)
    print(
        f"filled {args.machines} machines in {time.perf_counter() - t0:.1f} s ({url.split(':')[0]})"
    )
    cfg = load_config(
        None, environ={"METALD_STATE_DIR": str(tmp / "state"), "METALD_STORE__URL": url}
    )
    ctx = AppContext(
        cfg=cfg, store=store, secrets=SecretBox.from_file(cfg.secrets_key_path), bus=EventBus()
    )
    runner = web.AppRunner(create_app(ctx), access_log=None, **server_settings())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    base = f"http://127.0.0.1:{runner.addresses[0][1]}"
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as http:
        async with http.post(f"{base}/ui/login", data={"token": secret, "next": "/ui/"}) as r:
            assert r.status == 200 and "Fleet" in await r.text()
        _, first = await timed(http, f"{base}/ui/", 1)
        cursor = re.search(r'rel="next" href="([^"]+)"', first)
        deep = cursor.group(1).replace("&amp;", "&") if cursor else "/ui/"
        # walk 20 pages in, for a cursor deep in the fleet
        for _ in range(20):
            _, text = await timed(http, base + deep, 1)
            m = re.search(r'rel="next" href="([^"]+)"', text)
            if m is None:
                break
            deep = m.group(1).replace("&amp;", "&")
        views = {
            "first page (100 rows)": "/ui/",
            "deep page (keyset)": deep,
            "state=ready&rack=r060": "/ui/?state=ready&rack=r060",
            "label pool=green": "/ui/?label=pool%3Dgreen",
            f"search MAC {sample['mac']}": f"/ui/?q={sample['mac']}",
            f"search IP {sample['ip']}": f"/ui/?q={sample['ip']}",
            f"search BMC {sample['bmc']}": f"/ui/?q={sample['bmc']}",
            "sorted by memory, descending": "/ui/?sort=-memory",
            "grouped by rack, sorted by state": "/ui/?group=rack&sort=state",
            "grouped by SKU": "/ui/?group=sku",
            "rack view (every rack)": "/ui/racks",
        }
        print(f"\nfleet page, {args.machines} machines, {args.runs} runs each (whole request):")
        for name, path in views.items():
            ms, text = await timed(http, base + path, args.runs)
            n_rows = text.count("<tr data-id=")
            print(f"  {name:34s} {stats(ms)}   {n_rows} rows, {len(text) / 1024:.0f} KiB")
    principal = await store.read(
        lambda s: __import__("metald.auth", fromlist=["x"]).authenticate(s, secret)
    )
    q = ui_fleet.FleetQuery()
    ms = []
    for _ in range(args.runs):
        t0 = time.perf_counter()
        await store.read(ui_fleet.fleet_page, principal, q)
        ms.append((time.perf_counter() - t0) * 1000)
    print(f"\n  query alone (fleet_page, first page) {stats(ms)}")
    await runner.cleanup()
    store.close()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--machines", type=int, default=5000)
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--db", default=None)
    asyncio.run(main(ap.parse_args()))
