"""metald's CPU for watching machines in use (no root, no peers): what one BMC visit costs with
100 and 1,000 event-log records, one node report, and one watch round over the fleet, turned
into the monitoring cost of 1,000 in-use machines as a share of one core.

    .venv/bin/python bench/health_cost.py [--machines 1000] [--visits 200]

A SQLite store (in a temporary folder) holds ``--machines`` active machines of one claim, each
with a BMC. A BMC visit is ``HealthWatch._read_bmc`` on an in-memory BMC whose event log holds
N records (as ``BmcService.event_log`` renders them) plus one new record per visit, and four
sensors: metald's part (new-entry detection, classification, the cursor and fault writes in
the store). The protocol read itself (pyghmi / Redfish JSON) is not in it. A node report is
``metald.usecases.health.node_report``'s transaction on the real A100 capture (1 GPU, no
kernel lines). A round is ``HealthWatch.round(reads=False)`` (silence check and open
remediations) over all machines. Prints process CPU (user+system) medians of 5 runs."""

from __future__ import annotations

import argparse
import asyncio
import statistics
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
    gate = asyncio.Semaphore(1)
    for u in us:  # the first visit sets the cursor
        await w._read_bmc(u, gate)
    runs = []
    for _ in range(5):
        t = time.process_time()
        for u in us:
            await w._read_bmc(u, gate)
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
    body = {"kernel_log": "", "nvidia_smi_xml": XML.read_text()}
    runs = []
    for _ in range(5):
        t = time.process_time()
        for secret in secrets:
            await node_report(store, secret, body, cfg=cfg, instance="b")
        runs.append((time.process_time() - t) / len(secrets) * 1e3)
    return runs


def med(runs: list[float]) -> float:
    return statistics.median(runs)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--machines", type=int, default=1000)
    ap.add_argument("--visits", type=int, default=200)
    args = ap.parse_args()
    cfg = HealthConfig(report_min_interval_s=0)
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(f"sqlite:///{tmp}/bench.db")
        store.migrate()
        ids = fleet(store, args.machines)
        v100 = await visits(store, cfg, 100, args.visits, False)
        v1000 = await visits(store, cfg, 1000, args.visits, False)
        g100 = await visits(store, cfg, 100, args.visits, True)
        g1000 = await visits(store, cfg, 1000, args.visits, True)
        rnd = await rounds(store, cfg)
        rep = await reports(store, cfg, ids, min(args.visits, len(ids)))
        store.close()
    print(f"BMC visit, 100 records, one new:   median {med(g100):.2f} ms CPU "
          f"({', '.join(f'{r:.2f}' for r in g100)})")  # fmt: skip
    print(f"BMC visit, 1,000 records, one new: median {med(g1000):.2f} ms CPU "
          f"({', '.join(f'{r:.2f}' for r in g1000)})")  # fmt: skip
    print(f"BMC visit, 100 records, nothing new:   median {med(v100):.2f} ms CPU "
          f"({', '.join(f'{r:.2f}' for r in v100)})")  # fmt: skip
    print(f"BMC visit, 1,000 records, nothing new: median {med(v1000):.2f} ms CPU "
          f"({', '.join(f'{r:.2f}' for r in v1000)})")  # fmt: skip
    print(f"node report (A100, 1 GPU): median {med(rep):.2f} ms CPU "
          f"({', '.join(f'{r:.2f}' for r in rep)})")  # fmt: skip
    print(f"watch round over {args.machines} machines: median {med(rnd):.1f} ms CPU "
          f"({', '.join(f'{r:.1f}' for r in rnd)})")  # fmt: skip
    n = args.machines
    for records, v in ((100, med(v100)), (1000, med(v1000))):
        bmc = n * v / 1e3 / cfg.bmc_interval_s
        rpt = n * med(rep) / 1e3 / cfg.report_interval_s
        rd = med(rnd) / 1e3 / cfg.watch_interval_s
        total = bmc + rpt + rd
        print(
            f"{n} in-use machines, {records} SEL records: BMC visits every "
            f"{cfg.bmc_interval_s:g} s {bmc * 100:.2f} %, node reports every "
            f"{cfg.report_interval_s} s {rpt * 100:.2f} %, watch rounds every "
            f"{cfg.watch_interval_s:g} s {rd * 100:.2f} %: {total * 100:.2f} % of one core"
        )


if __name__ == "__main__":
    asyncio.run(main())
