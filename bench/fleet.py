"""Fleet power sync: 1 metald instance vs 3 on one PostgreSQL, N simulated IPMI BMCs, and a
kill -9 of one of the 3.

    .venv/bin/python bench/fleet.py                 # 300 BMCs
    .venv/bin/python bench/fleet.py --bmcs 1000 --interval 5

The BMCs are bench/bmc_fanout.py's simulated fleet (RMCP+ server half of ``metald.bmc.rmcp``,
its own process, replies delayed 1-5 ms), extended to remember which IPMI session read each
BMC's power state: a session belongs to one client, so "each BMC polled by exactly one
instance" is counted at the BMCs, not taken from metald's word. The BMC rows are written into
the store directly (registration's own cost is not what is measured).

Per run: start the instances, wait until every BMC has been read, then count over a window of
``--window`` seconds: BMCs read by exactly one session, by more, by none; status reads; CPU
seconds per instance. With 3 instances, kill -9 the one holding most BMCs, report the time
until the survivors hold all of them in the store (the takeover) and count a window again.
Not a storm: machines do not enroll or provision here (bench/storm.py does that, one instance).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import bmc_fanout as sim
from _lab import table
from cryptography.fernet import Fernet
from sqlmodel import select

from metald.secrets import SecretBox
from metald.store import Store
from metald.store.models import Bmc
from vmlab.labnet import free_port
from vmlab.pg import PgServer

BIN = Path(sys.executable).parent


class _CountingBmc(sim._SimBmc):
    """Remembers, per BMC, the sessions that read its power state since the last reset."""

    readers: dict[int, set[int]] = {}

    def _command(self, sid: int, sess: Any, req: Any) -> bytes:
        if (req.netfn, req.cmd) == (0x00, 0x01):
            self.readers.setdefault(self.idx, set()).add(sid)
        return super()._command(sid, sess, req)


def _fleet_main(conn: Any, base_port: int, n: int) -> None:
    import asyncio

    async def main() -> None:
        loop = asyncio.get_running_loop()
        fleet = sim._Fleet(n, (0.001, 0.005), 0.0, 1)
        ts = [
            (
                await loop.create_datagram_endpoint(
                    lambda i=i: _CountingBmc(fleet, i), local_addr=("127.0.0.1", base_port + i)
                )
            )[0]
            for i in range(n)
        ]
        conn.send("ready")
        while True:
            cmd = await loop.run_in_executor(None, conn.recv)
            if cmd == "reset":
                fleet.reset()
                _CountingBmc.readers = {}
                conn.send("ok")
            elif cmd == "counts":
                conn.send(
                    {
                        "status": fleet.status,
                        "readers": {i: len(s) for i, s in _CountingBmc.readers.items()},
                        "cpu": time.process_time(),
                    }
                )
            else:
                break
        for t in ts:
            t.close()

    asyncio.run(main())


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _conf(tmp: Path, name: str, port: int, url: str, args: argparse.Namespace) -> Path:
    conf = tmp / f"{name}.toml"
    conf.write_text(
        f'state_dir = "{tmp / name}"\ninstance = "{name}"\n[store]\nurl = "{url}"\n'
        f'[api]\nlisten = "127.0.0.1:{port}"\n'
        f"[fleet]\nheartbeat_s = {args.heartbeat}\ndead_after_s = {args.dead_after}\n"
        f"[bmc]\npower_sync_interval_s = {args.interval}\nmin_interval_ms = 0\n"
        "[provision]\nwatchdog_interval_s = 0\n"
    )
    return conf


def _owners(store: Store) -> Counter[str | None]:
    with store.session() as s:
        return Counter(o for o in s.exec(select(Bmc.owner)).all())


def _window(conn: Any, n: int, procs: dict[str, subprocess.Popen], seconds: float) -> dict:
    cpu0 = {k: _cpu_s(p.pid) for k, p in procs.items() if p.poll() is None}
    conn.send("reset")
    conn.recv()
    time.sleep(seconds)
    conn.send("counts")
    c = conn.recv()
    readers = [c["readers"].get(i, 0) for i in range(n)]
    return {
        "once": sum(1 for r in readers if r == 1),
        "more": sum(1 for r in readers if r > 1),
        "none": sum(1 for r in readers if r == 0),
        "reads": sum(c["status"]),
        "cpu": {k: _cpu_s(procs[k].pid) - v for k, v in cpu0.items() if procs[k].poll() is None},
    }


def _run(
    k: int, url: str, conn: Any, args: argparse.Namespace, tmp: Path, key: bytes
) -> list[list[object]]:
    names = [f"rack{i}" for i in range(k)]
    for n in names:
        (tmp / n).mkdir(parents=True, exist_ok=True)
        (tmp / n / "secrets.key").write_bytes(key)
        os.chmod(tmp / n / "secrets.key", 0o600)
    procs = {
        n: subprocess.Popen(
            [BIN / "metald", "serve", "--config", _conf(tmp, n, free_port(), url, args)],
            stdout=subprocess.DEVNULL,
            stderr=open(tmp / f"{n}.log", "w"),  # noqa: SIM115 - lives as long as the process
        )
        for n in names
    }
    store = Store(url)
    rows: list[list[object]] = []
    try:
        deadline = time.monotonic() + 120
        while sum(v for o, v in _owners(store).items() if o in names) < args.bmcs:
            if time.monotonic() > deadline:
                raise SystemExit(f"the instances never held every BMC: {_owners(store)}")
            time.sleep(0.2)
        time.sleep(args.interval)  # every BMC read once at least: sessions are open
        w = _window(conn, args.bmcs, procs, args.window)
        per = args.window / args.interval
        rows.append(_row(f"{k} instance(s)", w, per, args, _owners(store)))
        if k > 1:
            victim = _owners(store).most_common(1)[0][0]
            assert victim is not None
            procs[victim].send_signal(signal.SIGKILL)
            procs[victim].wait()
            killed = time.monotonic()
            while _owners(store).get(victim):
                time.sleep(0.05)
            takeover = time.monotonic() - killed
            time.sleep(args.interval)
            w = _window(conn, args.bmcs, procs, args.window)
            rows.append(
                _row(
                    f"{k} after kill -9 {victim} (takeover {takeover:.1f} s)",
                    w,
                    per,
                    args,
                    _owners(store),
                )
            )
    finally:
        store.close()
        for p in procs.values():
            if p.poll() is None:
                p.terminate()
                p.wait(timeout=30)
    return rows


def _row(
    label: str, w: dict, per: float, args: argparse.Namespace, owners: Counter[str | None]
) -> list[object]:
    cpu = w["cpu"]
    return [
        label,
        " ".join(f"{o}:{v}" for o, v in sorted(owners.items(), key=lambda x: str(x[0]))),
        w["once"],
        w["more"],
        w["none"],
        f"{w['reads'] / (args.bmcs * per):.2f}",
        " ".join(f"{k}:{v:.2f}" for k, v in sorted(cpu.items())),
        f"{1000 * sum(cpu.values()) / (args.bmcs * per):.2f}",
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bmcs", type=int, default=300)
    ap.add_argument("--interval", type=float, default=3.0, help="[bmc] power_sync_interval_s")
    ap.add_argument("--window", type=float, default=9.0, help="seconds counted per window")
    ap.add_argument("--heartbeat", type=float, default=2.0)
    ap.add_argument("--dead-after", type=float, default=10.0)
    ap.add_argument("--base-port", type=int, default=31000)
    args = ap.parse_args()

    parent, child = mp.Pipe()
    fleet = mp.Process(target=_fleet_main, args=(child, args.base_port, args.bmcs), daemon=True)
    fleet.start()
    assert parent.recv() == "ready"
    pg = PgServer()
    key = Fernet.generate_key()
    results: list[list[object]] = []
    try:
        for k in (1, 3):
            url = pg.new_database()
            store = Store(url)
            store.migrate()
            with tempfile.TemporaryDirectory(prefix="metald-fleet-bench-") as d:
                box = SecretBox(key)
                with store.session() as s:
                    for i in range(args.bmcs):
                        s.add(
                            Bmc(
                                address="127.0.0.1",
                                port=args.base_port + i,
                                protocol="ipmi",
                                username=sim.USER.decode(),
                                password_enc=box.encrypt(sim.PASSWORD.decode()),
                            )
                        )
                    s.commit()
                store.close()
                print(f"# {k} instance(s), {args.bmcs} BMCs ...", file=sys.stderr, flush=True)
                results += _run(k, url, parent, args, Path(d), key)
    finally:
        parent.send("stop")
        fleet.join(5)
        pg.stop()
    print(
        f"# fleet power sync: {args.bmcs} simulated IPMI BMCs, power_sync_interval_s "
        f"{args.interval}, windows of {args.window} s, heartbeat_s {args.heartbeat}, "
        f"dead_after_s {args.dead_after}; {os.cpu_count()} CPUs"
    )
    print(
        f"# command: .venv/bin/python bench/fleet.py --bmcs {args.bmcs} --interval "
        f"{args.interval} --window {args.window} --heartbeat {args.heartbeat} "
        f"--dead-after {args.dead_after}"
    )
    print(
        table(
            [
                "run",
                "BMCs held (store)",
                "read by 1 session",
                "by >1",
                "by none",
                "reads per BMC per interval",
                "CPU s per instance",
                "CPU ms per BMC read",
            ],
            results,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
