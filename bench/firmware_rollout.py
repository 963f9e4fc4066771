"""Firmware rollout: one rollout over N simulated Redfish BMCs (default 1,000), with the
failure budget tripped by injected failures.

The fleet runs in its own process: N copies of the lab's Redfish BMC (``vmlab.redfish``, the
same one the firmware tests use, with ``UpdateService``, ``TaskService`` and the firmware
inventory), each on its own loopback port, with an in-memory machine behind it instead of a
QEMU (power state only). Each flash takes ``--flash-s`` seconds (progress in ten steps); the
BMCs named by ``--fail`` find their image corrupt (the lab BMC's ``checksum`` fault).

metald's side runs in this process, as the daemon wires it: the BMC service, the image store
and its route (the BMCs pull the image through SimpleUpdate), the firmware updates service and
the rollouts service, on SQLite. The rollout takes every machine (batch ``--batch``, at most
``--max-unavailable`` at once, budget ``--budget``). Printed: wall time, metald's CPU seconds
(this process: the BMCs are another), machines done / failed / untouched, and each BMC's
flash count (never more than one).

Run: .venv/bin/python bench/firmware_rollout.py [--bmcs 1000] [--batch 100]
     [--max-unavailable 100] [--budget 3] [--fail 150,420,777,901] [--flash-s 2]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import multiprocessing as mp
import resource
import socket
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

USER, PASSWORD = "admin", "bench-Pa55word-x9"


class _Machine:
    """A machine's power, in memory (what the lab BMC asks of its QEMU)."""

    def __init__(self) -> None:
        from vmlab.power import BootOverride

        self.on = False
        self.override = BootOverride()
        self.qmp = None

    def record(self, *_: Any) -> None:
        pass

    async def is_on(self) -> bool:
        return self.on

    def set_boot_override(self, *a: Any, **kw: Any) -> None:
        pass

    async def power_on(self) -> None:
        self.on = True

    async def power_off(self) -> None:
        self.on = False

    soft_off = power_off

    async def reset(self) -> None:
        self.on = True

    power_cycle = reset

    async def nmi(self) -> None:
        pass


def _free_ports(n: int) -> list[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def _fleet_main(conn: Any, n: int, fail: list[int], flash_s: float) -> None:
    """The simulated BMCs: N lab Redfish apps on N loopback ports."""
    from aiohttp import web

    from vmlab import redfish
    from vmlab.redfish_update import UPDATES

    async def main() -> None:
        apps, runners = [], []
        ports = _free_ports(n)
        for i, port in enumerate(ports):
            info = redfish.SystemInfo(
                system_id=f"s{i}", uuid=str(uuid.uuid4()), mac=f"52:54:01:{i >> 16 & 255:02x}:"
                f"{i >> 8 & 255:02x}:{i & 255:02x}", firmware="uefi", memory_mb=64, cpus=1,
                serial_number=f"BENCH-{i:05d}", username=USER, password=PASSWORD,
            )  # fmt: skip
            app = redfish.make_app(_Machine(), info)  # type: ignore[arg-type]
            app[UPDATES].flash_s = flash_s
            if i in fail:
                app[UPDATES].faults.add("checksum")
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port, backlog=64).start()
            apps.append(app)
            runners.append(runner)
        conn.send(ports)
        while True:
            if conn.poll():
                conn.recv()
                conn.send([len(a[UPDATES].flashed) for a in apps])
                return
            await asyncio.sleep(0.2)

    asyncio.run(main())


async def _run(args: argparse.Namespace, ports: list[int], tmp: Path) -> dict[str, Any]:
    from aiohttp import web
    from sqlmodel import select

    from metald import machines
    from metald.bmc.service import BmcService
    from metald.config import load_config
    from metald.firmware.baselines import BaselineSpec, Component
    from metald.firmware.images import FirmwareImages
    from metald.firmware.records import add_baseline
    from metald.firmware.rollouts import FirmwareRollouts
    from metald.firmware.service import FirmwareUpdates
    from metald.inventory.normalize import NormalizedInventory
    from metald.inventory.rules import EnrollmentRule
    from metald.lifecycle import Trigger
    from metald.secrets import SecretBox
    from metald.store import Store
    from metald.store.models import Bmc, FirmwareRollout
    from metald.usecases.firmware import Rollouts, RolloutSpec
    from vmlab.redfish_update import make_image

    cfg = load_config(None, environ={
        "METALD_STATE_DIR": str(tmp / "state"),
        "METALD_STORE__URL": f"sqlite:///{tmp}/metald.db",
        "METALD_BMC__NETWORKS": '["127.0.0.0/8"]',
    })  # fmt: skip
    cfg.bmc.min_interval_ms = 0
    cfg.firmware.poll_s = args.poll_s
    rule = EnrollmentRule.model_validate(
        {"match": {"gpu_model": "NVIDIA H100*"}, "commissioning": {"name": "h100-8x"}}
    )
    cfg.enroll.rules = [rule]
    store = Store(cfg.store.url)
    store.migrate()
    secrets = SecretBox.from_file(cfg.secrets_key_path)
    image = make_image("BIOS", "2023.05")
    src = tmp / "bios.bin"
    src.write_bytes(image)
    inv = NormalizedInventory(gpu_model="NVIDIA H100 80GB HBM3", gpu_count=8)
    with store.session() as s:
        spec = BaselineSpec(components=[Component(
            id="BIOS", version="2023.05", url=f"file://{src}",
            sha256=hashlib.sha256(image).hexdigest(), apply="host-reset",
        )])  # fmt: skip
        add_baseline(s, "h100-8x", spec, note=None, actor="bench", instance="bench")
        pw = secrets.encrypt(PASSWORD)
        for i, port in enumerate(ports):
            m = machines.create_machine(
                s, macs=[f"52:54:02:{i >> 16 & 255:02x}:{i >> 8 & 255:02x}:{i & 255:02x}"],
                actor="bench", name=f"n{i:05d}", rack=f"r{i // 40:03d}",
            )  # fmt: skip
            machines.transition(s, m.id, Trigger.INSPECT, actor="bench", commit=False)
            machines.transition(s, m.id, Trigger.INSPECTED, actor="bench", commit=False,
                                updates={"inventory": {"normalized": inv.model_dump(mode="json")},
                                         "gpu_model": inv.gpu_model, "gpu_count": 8,
                                         "firmware_versions": {"BIOS": "2022.11"}})  # fmt: skip
            s.add(Bmc(machine_id=m.id, address="http://127.0.0.1", port=port,
                      protocol="redfish", username=USER, password_enc=pw,
                      verify_tls=False))  # fmt: skip
        s.commit()
    bmc = BmcService(store, secrets, cfg.bmc, cfg.instance)
    images = FirmwareImages(tmp / "fw", max_bytes=1 << 24, timeout_s=30)
    runner = web.AppRunner(web.Application(), access_log=None)
    runner.app.router.add_routes(images.routes())
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    boot = f"http://127.0.0.1:{runner.addresses[0][1]}"
    fw = FirmwareUpdates(store, bmc.control, images, cfg.firmware, cfg.instance,
                         rules=lambda: cfg.enroll.rules, boot_url=boot)  # fmt: skip
    ro = FirmwareRollouts(store, fw, cfg.instance, tick_s=0.5, lease_s=30)
    fw.on_end = ro.wake
    uc = Rollouts(store, cfg.instance, rules=cfg.enroll.rules, wake=ro.wake)

    spec = RolloutSpec("h100-8x", 1, {"gpu_model": "NVIDIA H100*"}, args.batch,
                       args.max_unavailable, args.budget, "skip")  # fmt: skip

    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.monotonic()
    created = await uc.create(None, spec, actor="bench")  # type: ignore[arg-type]
    t_create = time.monotonic() - t0
    await ro.start()
    last = ""
    while True:
        got = await uc.get(None, created["id"])  # type: ignore[arg-type]
        p = got["progress"]
        line = (f"  {got['state']:8} wave {p['wave']:3}  {p['done']:5} done {p['failed']:3} "
                f"failed {p['updating']:4} updating {p['pending']:5} pending")  # fmt: skip
        if line != last:
            print(f"{time.monotonic() - t0:7.1f}s{line}", file=sys.stderr)
            last = line
        if got["finished_at"] is not None:
            break
        await asyncio.sleep(0.5)
    wall = time.monotonic() - t0
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    await ro.stop()
    await fw.stop()
    await bmc.stop()
    await runner.cleanup()
    with store.session() as s:
        r = s.exec(select(FirmwareRollout)).one()
        reason = r.reason
    store.close()
    return {
        "wall_s": wall,
        "create_s": t_create,
        "cpu_s": (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime),
        "state": got["state"],
        "reason": reason,
        "progress": got["progress"],
        "targets": got["targets"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bmcs", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=100)
    ap.add_argument("--max-unavailable", type=int, default=100)
    ap.add_argument("--budget", type=int, default=3)
    ap.add_argument("--fail", default="150,420,777,901", help="BMC indexes whose flash fails")
    ap.add_argument("--flash-s", type=float, default=2.0)
    ap.add_argument("--poll-s", type=float, default=0.5, help="[firmware] poll_s")
    args = ap.parse_args()
    fail = [int(x) for x in args.fail.split(",") if x.strip()]
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    fleet = ctx.Process(target=_fleet_main, args=(child, args.bmcs, fail, args.flash_s))
    fleet.start()
    try:
        ports = parent.recv()
        with tempfile.TemporaryDirectory() as tmp:
            out = asyncio.run(_run(args, ports, Path(tmp)))
        parent.send("count")
        flashes = parent.recv()
    finally:
        fleet.join(timeout=10)
        if fleet.is_alive():
            fleet.kill()
    p = out["progress"]
    untouched = [i for i, t in enumerate(out["targets"]) if t["status"] == "pending"]
    print(f"rollout over {args.bmcs} simulated Redfish BMCs (lab BMC, flash {args.flash_s} s, "
          f"poll {args.poll_s} s): waves of {args.batch}, at most {args.max_unavailable} at "
          f"once, failure budget {args.budget}, failing BMCs {fail}")  # fmt: skip
    print(f"  state          {out['state']}: {out['reason']}")
    print(f"  wall           {out['wall_s']:.1f} s (targets chosen in {out['create_s']:.2f} s)")
    print(f"  metald CPU     {out['cpu_s']:.1f} s ({100 * out['cpu_s'] / out['wall_s']:.0f}% "
          "of one core)")  # fmt: skip
    print(f"  machines       {p['done']} done, {p['failed']} failed, {p['skipped']} skipped, "
          f"{len(untouched)} untouched (pending), in {p['wave']} waves")  # fmt: skip
    print(f"  flashes        max {max(flashes)} per BMC, {sum(flashes)} in all; "
          f"untouched BMCs flashed: {sum(flashes[i] for i in untouched)}")  # fmt: skip


if __name__ == "__main__":
    main()
