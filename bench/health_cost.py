"""metald's CPU for watching machines in use (no root, no peers): what one BMC visit costs with
100 and 1,000 event-log records, one node report, and one watch round over the fleet, turned
into the monitoring cost of 1,000 in-use machines as a share of one core.

    .venv/bin/python bench/health_cost.py [--machines 1000] [--visits 200] [--before main]

A SQLite store (in a temporary folder) holds ``--machines`` active machines of one claim, each
with a BMC. A BMC visit is ``HealthWatch.read_bmcs`` (as a round calls it, over ``--visits`` machines) on an in-memory BMC whose event log holds
N records (as ``BmcService.event_log`` renders them) plus one new record per visit, and four
sensors: metald's part (new-entry detection, classification, the cursor and fault writes in
the store). The protocol read itself (pyghmi / Redfish JSON) is not in it. A node report is
``metald.usecases.health.node_report``'s transaction on the real A100 capture (1 GPU, no
kernel lines). A round is ``HealthWatch.round(reads=False)`` (silence check and open
remediations) over all machines. Prints process CPU (user+system) medians of 5 runs, and the
share of one core at the default intervals for 1,000 in-use machines on one instance and for
docs/fleet.md's 12,500 over 26 instances; ``--before REF`` runs the same on the code at a git
revision (e.g. ``main``) and prints it beside."""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlmodel import select

from metald import machines
from metald.claims.allocation import Selector, create_claim
from metald.health.config import HealthConfig
from metald.healthwatch.watch import HealthWatch, InUse
from metald.healthwatch.workflow import MarkBroken, Remediations
from metald.lifecycle import State, Trigger
from metald.provision import netboot
from metald.provision.intents import DeployImage
from metald.store import Store
from metald.store.models import Bmc, Image, Machine, NodeHeartbeat
from metald.tenants.clusters import new_tenant

XML = (
    Path(__file__).resolve().parents[1]
    / "tests/fixtures/gpu/nvidia-smi-q-x_a100-sxm4-80gb_mig_drv535.54.03.xml"
)
DEPLOY = DeployImage("discovery/vmlinuz", "discovery/initrd.img")
SENSORS = [
    {"name": f"Temp{i}", "kind": "temperature", "value": 40.0 + i, "units": "C", "health": "ok"}
    for i in range(4)
]


class Bmcs:
    """Every machine's BMC in memory: ``records`` entries, one more at each visit when
    ``growing`` (else the same log every visit, the common case)."""

    def __init__(self, records: int, growing: bool = True) -> None:
        self.growing = growing
        self.base = [
            {"id": str(i), "at": None, "severity": "info",
             "message": f"System Event #{i} OEM record | Asserted"}
            for i in range(1, records + 1)
        ]  # fmt: skip
        self.extra: dict[str, int] = {}

    async def event_log(self, machine_id: str) -> list[dict[str, Any]]:
        n = self.extra[machine_id] = self.extra.get(machine_id, 0) + int(self.growing or 1)
        if not self.growing:
            n = 1
        tail = [
            {"id": str(len(self.base) + k), "at": None, "severity": "info",
             "message": f"Power Unit #{k} power on | Asserted"}
            for k in range(1, n + 1)
        ][-5:]  # fmt: skip
        return self.base[len(tail) :] + tail  # a full log rotates

    async def sensors(self, machine_id: str) -> list[dict[str, Any]]:
        return SENSORS


def fleet(store: Store, n: int) -> list[str]:
    with store.session() as s:
        rows = [
            Machine(name=f"gpu{i}", state=State.READY.value, gpu_model="A100", gpu_count=1,
                    memory_mb=1_000_000, labels={"pool": "p"}, inventory={"schema_version": 1})
            for i in range(n)
        ]  # fmt: skip
        s.add_all(rows)
        t = new_tenant(s, name="acme", cluster_kind="slurm")
        img = Image(name="node", kind="stateless", spec={"kernel": "k", "initrd": "i"})
        s.add(img)
        s.commit()
        claim, _ = create_claim(s, t.id, n, Selector(labels={"pool": "p"}), img.id, None, "b",
                                deploy=DEPLOY)  # fmt: skip
        ids = [m.id for m in s.exec(select(Machine).where(Machine.claim_id == claim.id))]
        netboot.start_provisioning(s, ids, actor="b")
        for mid in ids:
            for trig in (Trigger.PROVISIONED, Trigger.JOIN, Trigger.JOINED):
                machines.transition(s, mid, trig, actor="b")
            s.add(Bmc(machine_id=mid, address=f"10.9.{len(ids) // 250}.{len(ids) % 250}",
                      port=None, protocol="ipmi", username="u", password_enc=b"x"))  # fmt: skip
            s.add(NodeHeartbeat(machine_id=mid, claim_id=claim.id, last_at=datetime.now(UTC),
                                reports=1))  # fmt: skip
        s.commit()
        return ids


def watch_of(store: Store, cfg: HealthConfig, bmc: Any) -> HealthWatch:
    rem = Remediations(store=store, cfg=cfg, instance="b", scheduler_for=lambda _t: None,
                       repair=MarkBroken("b"), deploy=DEPLOY)  # fmt: skip
    return HealthWatch(store, cfg, "b", remediations=rem, table=cfg.table(), bmc=bmc)


async def visits(
    store: Store, cfg: HealthConfig, records: int, n: int, growing: bool
) -> list[float]:
    bmcs = Bmcs(records, growing)
    w = watch_of(store, cfg, bmcs)
    us = [u for u in await store.read(_in_use) if u.bmc_id][:n]
    await w.read_bmcs(us)  # the first visit sets the cursor
    runs = []
    for _ in range(5):
        t = time.process_time()
        await w.read_bmcs(us)  # as a round does: whatever it reads for all of them included
        runs.append((time.process_time() - t) / len(us) * 1e3)
    return runs


def _in_use(s: Any) -> list[InUse]:
    from metald.healthwatch.watch import in_use

    return in_use(s)


async def rounds(store: Store, cfg: HealthConfig) -> list[float]:
    from sqlalchemy import update

    with store.session() as s:  # every node reported just now: nobody is silent
        s.execute(update(NodeHeartbeat).values(last_at=datetime.now(UTC)))
        s.commit()
    w = watch_of(store, cfg, None)
    runs = []
    for _ in range(5):
        t = time.process_time()
        await w.round(reads=False)
        runs.append((time.process_time() - t) * 1e3)
    return runs


async def reports(store: Store, cfg: HealthConfig, ids: list[str], n: int) -> list[float]:
    from metald.store.models import WgPeer
    from metald.tenants import mesh
    from metald.usecases.health import node_report

    secrets = []
    with store.session() as s:
        for i, mid in enumerate(ids[:n]):
            secret, digest = mesh.mint_node_token()
            m = s.get(Machine, mid)
            assert m is not None
            s.add(WgPeer(tenant_id=m.tenant_id, machine_id=mid, public_key=f"k{i}",
                         address=f"10.200.{i // 250}.{i % 250 + 2}", node_token_hash=digest))  # fmt: skip
            secrets.append(secret)
        s.commit()
    xml = XML.read_text()
    # Each run's report is the same GPU later: another timestamp and temperature.
    bodies = [
        {"kernel_log": "", "nvidia_smi_xml": xml.replace("11:44:30", f"11:45:{k:02d}")
         .replace("<gpu_temp>27 C<", f"<gpu_temp>{30 + k} C<")}
        for k in range(6)
    ]  # fmt: skip
    # As the daemon does where the code has it: the health watch's memory of clean reports,
    # whose heartbeats its round writes (timed here, once per run).
    watch = watch_of(store, cfg, None)
    memo = getattr(watch, "memo", None)
    kw = {"memo": memo} if "memo" in inspect.signature(node_report).parameters else {}
    runs = []
    for k in range(5):
        t = time.process_time()
        for secret in secrets:
            await node_report(store, secret, bodies[k], cfg=cfg, instance="b", **kw)
        if kw:
            await watch.flush_reports()
        runs.append((time.process_time() - t) / len(secrets) * 1e3)
    return runs


def med(runs: list[float]) -> float:
    return statistics.median(runs)


#: The fleet of docs/fleet.md's scale model: 12,500 servers over 13 segments of 2 instances.
FLEET, INSTANCES = 12_500, 26


async def measure(machines: int, visits_n: int) -> dict[str, Any]:
    cfg = HealthConfig(report_min_interval_s=0)
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(f"sqlite:///{tmp}/bench.db")
        store.migrate()
        ids = fleet(store, machines)
        out = {
            "visit_100_same": await visits(store, cfg, 100, visits_n, False),
            "visit_1000_same": await visits(store, cfg, 1000, visits_n, False),
            "visit_100_new": await visits(store, cfg, 100, visits_n, True),
            "visit_1000_new": await visits(store, cfg, 1000, visits_n, True),
            "round": await rounds(store, cfg),
            "report": await reports(store, cfg, ids, min(visits_n, len(ids))),
        }
        store.close()
    import metald

    return {"code": str(Path(metald.__file__).parent), "machines": machines, "runs": out}


def shares(m: dict[str, Any], per_instance: float, records: int) -> dict[str, float]:
    """Share of one core of one instance watching ``per_instance`` in-use machines at the
    default intervals (the round's own cost scales with the machines it covers)."""
    cfg = HealthConfig()
    r = m["runs"]
    bmc = per_instance * med(r[f"visit_{records}_same"]) / 1e3 / cfg.bmc_interval_s
    rpt = per_instance * med(r["report"]) / 1e3 / cfg.report_interval_s
    rnd = med(r["round"]) * per_instance / m["machines"] / 1e3 / cfg.watch_interval_s
    return {"bmc": bmc * 100, "report": rpt * 100, "round": rnd * 100,
            "total": (bmc + rpt + rnd) * 100}  # fmt: skip


def before(ref: str, machines: int, visits_n: int) -> dict[str, Any]:
    """This bench run on the package as it is at ``ref`` (git archive into a temporary
    folder, first on the child's path)."""
    root = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as tmp:
        tar = subprocess.run(["git", "-C", str(root), "archive", ref, "metald"],
                             check=True, capture_output=True).stdout  # fmt: skip
        subprocess.run(["tar", "-x", "-C", tmp], input=tar, check=True)
        env = {**os.environ, "PYTHONPATH": tmp}
        got = subprocess.run(
            [sys.executable, __file__, "--json", "--machines", str(machines), "--visits",
             str(visits_n)], env=env, check=True, capture_output=True, text=True,
        )  # fmt: skip
        m: dict[str, Any] = json.loads(got.stdout)
        assert m["code"].startswith(tmp), m["code"]
        m["code"] = ref
        return m


def report(cols: list[tuple[str, dict[str, Any]]]) -> None:
    rows = [
        ("BMC visit, 100 records, nothing new", "visit_100_same"),
        ("BMC visit, 1,000 records, nothing new", "visit_1000_same"),
        ("BMC visit, 100 records, one new", "visit_100_new"),
        ("BMC visit, 1,000 records, one new", "visit_1000_new"),
        ("node report (A100, 1 GPU, as the last)", "report"),
    ]
    w = 40
    print(f"{'ms CPU (median of 5)':{w}}" + "".join(f"{name:>28}" for name, _ in cols))
    for label, key in rows:
        print(f"{label:{w}}" + "".join(f"{med(m['runs'][key]):>28.3f}" for _, m in cols))
    n = cols[0][1]["machines"]
    print(f"{f'watch round over {n:,} machines':{w}}"
          + "".join(f"{med(m['runs']['round']):>28.2f}" for _, m in cols))  # fmt: skip
    print()
    share = FLEET / INSTANCES
    for records in (100, 1000):
        for label, per in ((f"1,000 in-use machines, one instance, {records} SEL records", 1000),
                           (f"12,500 over {INSTANCES} instances ({share:.0f} each), "
                            f"{records} records", share)):  # fmt: skip
            print(f"% of one core: {label}")
            for part in ("bmc", "report", "round", "total"):
                print(f"{'  ' + part:{w}}"
                      + "".join(f"{shares(m, per, records)[part]:>27.2f}%" for _, m in cols))  # fmt: skip


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--machines", type=int, default=1000)
    ap.add_argument("--visits", type=int, default=200)
    ap.add_argument("--before", metavar="REF", help="also run on the code at this git revision")
    ap.add_argument("--json", action="store_true", help="print the raw runs as JSON")
    args = ap.parse_args()
    now = await measure(args.machines, args.visits)
    if args.json:
        print(json.dumps(now))
        return
    cols = [("this tree", now)]
    if args.before:
        cols.insert(0, (args.before, before(args.before, args.machines, args.visits)))
    report(cols)


if __name__ == "__main__":
    asyncio.run(main())
