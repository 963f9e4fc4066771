"""BMC fan-out: metald's scheduler + IPMI driver against an Ironic-style pool of 8 workers.

A simulated fleet of N IPMI 2.0 BMCs (default 1,000) answers on N loopback UDP ports from its
own process, speaking RMCP+ (cipher suite 3) through ``metald.bmc.rmcp``'s server half. Like real
BMCs on a busy management network, every reply is delayed 20-50 ms and every packet, in either
direction, is dropped with probability 1 %. Like real BMCs, a request re-sent with the same IPMI
sequence number is answered from a cache instead of being executed again; the simulator counts
what it executed per BMC, so the table proves that no command was lost or executed twice.

Both runs use the same driver (so the comparison is the concurrency model, not the client):
- metald: every command goes through ``BmcScheduler`` (global bound 256, per-BMC serialisation).
- baseline: 8 workers, one command at a time each (Ironic's ``sync_power_state_workers = 8``).
Each run does: power status on all BMCs, then power cycle on all BMCs, each cycle confirmed:
like real hardware, a simulated BMC reports the new power state only 0.2-1 s (``--settle-ms``)
after it accepted the command, and a cycle counts as done once the BMC reports the machine on
(``metald.bmc.power_confirm.wait_for_state``, the loop the daemon's power actions use, in both
runs: the comparison stays the concurrency model).

Run: .venv/bin/python bench/bmc_fanout.py [--bmcs 1000] [--seed 1]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import random
import resource
import statistics
import struct
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from metald.bmc import rmcp
from metald.bmc.base import BmcEndpoint, BmcError, PowerAction, PowerState
from metald.bmc.ipmi import IpmiDriver
from metald.bmc.power_confirm import CommandStatus, wait_for_state
from metald.bmc.scheduler import BmcScheduler

USER, PASSWORD = b"admin", b"fleet-password"
CONFIRM_GIVE_UP_S = 60.0


# --- the simulated fleet (its own process) ---


@dataclass
class _Session:
    keys: rmcp.SessionKeys
    console_sid: int
    seq: int = 0
    #: (rq_seq, netfn, cmd) -> the response already sent, for re-sent requests.
    cache: dict[tuple[int, int, int], bytes] = field(default_factory=dict)


class _Fleet:
    def __init__(
        self,
        n: int,
        delay: tuple[float, float],
        drop: float,
        seed: int,
        settle: tuple[float, float] = (0.2, 1.0),
        suites: tuple[int, ...] = (17, 3),
    ) -> None:
        self.n = n
        self.suites = suites
        self.delay = delay
        self.drop = drop
        self.settle = settle
        self.rng = random.Random(seed)
        self.reset()

    def reset(self) -> None:
        self.status = [0] * self.n
        self.controls = [0] * self.n
        self.power = [0] * self.n
        #: idx -> (power state to come, monotonic time it shows): a command takes effect later.
        self.pending: dict[int, tuple[int, float]] = {}
        self.rx = self.dropped = self.cached = 0


class _SimBmc(asyncio.DatagramProtocol):
    def __init__(self, fleet: _Fleet, idx: int) -> None:
        self.fleet, self.idx = fleet, idx
        self.guid = struct.pack("<I", idx) + b"\x00" * 12
        self.pending: dict[bytes, rmcp.ServerHandshake] = {}
        self.sessions: dict[int, _Session] = {}

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr: Any) -> None:
        f = self.fleet
        f.rx += 1
        if f.rng.random() < f.drop:
            f.dropped += 1
            return
        try:
            reply = self._handle(data)
        except rmcp.RmcpError:
            return
        if reply is None:
            return
        if f.rng.random() < f.drop:
            f.dropped += 1
            return
        asyncio.get_running_loop().call_later(f.rng.uniform(*f.delay), self._send, reply, addr)

    def _send(self, reply: bytes, addr: Any) -> None:
        if not self.transport.is_closing():
            self.transport.sendto(reply, addr)

    def _handle(self, data: bytes) -> bytes | None:
        if len(data) >= 14 and data[:4] == rmcp.RMCP_HEADER and data[4] == 0x00:
            return self._ipmi15(data)
        if len(data) < 16 or data[4] != rmcp.AUTH_RMCPP:
            return None
        ptype = data[5] & 0x3F
        if ptype == rmcp.PAYLOAD_IPMI:
            sid = struct.unpack_from("<I", data, 6)[0]
            sess = self.sessions.get(sid)
            if sess is None:
                return None
            p = rmcp.decode_packet(data, sess.keys)
            return self._command(sid, sess, rmcp.decode_request(p.payload))
        p = rmcp.decode_packet(data)
        if ptype == rmcp.PAYLOAD_OPEN_REQ:
            # Suites 17 and 3, as the fleet was told; another proposal is refused (0x11).
            hs = rmcp.ServerHandshake({USER: PASSWORD}, self.guid, accept=self.fleet.suites)
            if len(p.payload) < 32:
                return None
            rsp = hs.on_open_request(p.payload)
            if rsp[1] == 0:
                self.pending[hs.bmc_sid] = hs
            return rmcp.encode_packet(rmcp.PAYLOAD_OPEN_RSP, 0, 0, rsp)
        hs = self.pending.get(p.payload[4:8])
        if hs is None:
            return None
        if ptype == rmcp.PAYLOAD_RAKP1:
            return rmcp.encode_packet(rmcp.PAYLOAD_RAKP2, 0, 0, hs.on_rakp1(p.payload))
        if ptype == rmcp.PAYLOAD_RAKP3:
            rakp4, keys = hs.on_rakp3(p.payload)
            if keys is not None:
                sid = struct.unpack("<I", hs.bmc_sid)[0]
                console = struct.unpack("<I", hs.console_sid)[0]
                self.sessions.setdefault(sid, _Session(keys, console))
            return rmcp.encode_packet(rmcp.PAYLOAD_RAKP4, 0, 0, rakp4)
        return None

    def _ipmi15(self, data: bytes) -> bytes | None:
        """Session-less IPMI 1.5: only Get Channel Authentication Capabilities, which clients
        such as pyghmi and ipmitool send before RMCP+ (IPMI 2.0 only, suite 3)."""
        req = rmcp.decode_request(data[14 : 14 + data[13]])
        if (req.netfn, req.cmd) != (0x06, 0x38):
            return None
        body = rmcp.encode_response(req, 0, bytes([1, 0x80, 0x04, 0x02, 0, 0, 0, 0]))
        return data[:4] + bytes(9) + bytes([len(body)]) + body

    def _command(self, sid: int, sess: _Session, req: rmcp.IpmiRequest) -> bytes:
        f, i = self.fleet, self.idx
        key = (req.rq_seq, req.netfn, req.cmd)
        if key in sess.cache:
            f.cached += 1
            msg = sess.cache[key]
        else:
            data, code = b"", 0
            if (req.netfn, req.cmd) == (0x00, 0x01):  # Get Chassis Status
                f.status[i] += 1
                if i in f.pending and time.monotonic() >= f.pending[i][1]:
                    f.power[i] = f.pending.pop(i)[0]
                data = bytes([f.power[i], 0, 0])
            elif (req.netfn, req.cmd) == (0x00, 0x02):  # Chassis Control
                f.controls[i] += 1
                to = 0 if req.data[:1] in (b"\x00", b"\x05") else 1
                f.pending[i] = (to, time.monotonic() + f.rng.uniform(*f.settle))
            elif (req.netfn, req.cmd) == (0x06, 0x3B):  # Set Session Privilege Level
                data = req.data[:1]
            elif (req.netfn, req.cmd) == (0x06, 0x37):
                data = self.guid
            elif (req.netfn, req.cmd) == (0x06, 0x01):  # Get Device ID
                data = bytes([0x20, 0x01, 0x01, 0x00, 0x02, 0x9F, 0, 0, 0, 0, 0])
            elif (req.netfn, req.cmd) == (0x06, 0x3C):  # Close Session
                self.sessions.pop(sid, None)
            else:
                code = 0xC1
            msg = rmcp.encode_response(req, code, data)
            # Keep the last few answers only, as BMCs do (the sequence number wraps at 64).
            if len(sess.cache) > 16:
                sess.cache.pop(next(iter(sess.cache)))
            sess.cache[key] = msg
        sess.seq += 1
        return rmcp.encode_packet(rmcp.PAYLOAD_IPMI, sess.console_sid, sess.seq, msg, sess.keys)


def _fleet_main(
    conn: Any,
    base_port: int,
    n: int,
    delay: tuple[float, float],
    drop: float,
    seed: int,
    settle: tuple[float, float] = (0.2, 1.0),
    suites: tuple[int, ...] = (17, 3),
) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        fleet = _Fleet(n, delay, drop, seed, settle, suites)
        transports = []
        for i in range(n):
            t, _ = await loop.create_datagram_endpoint(
                lambda i=i: _SimBmc(fleet, i), local_addr=("127.0.0.1", base_port + i)
            )
            transports.append(t)
        conn.send("ready")
        while True:
            cmd = await loop.run_in_executor(None, conn.recv)
            if cmd == "reset":
                fleet.reset()
                conn.send("ok")
            elif cmd == "counts":
                conn.send(
                    {
                        "status": fleet.status,
                        "controls": fleet.controls,
                        "rx": fleet.rx,
                        "cpu": time.process_time(),
                        "dropped": fleet.dropped,
                        "cached": fleet.cached,
                        "power": fleet.power,
                    }
                )
            else:
                break
        for t in transports:
            t.close()

    asyncio.run(main())


# --- the two clients ---


def _drivers(base_port: int, n: int) -> list[IpmiDriver]:
    return [
        IpmiDriver(
            BmcEndpoint("127.0.0.1", base_port + i, USER.decode(), PASSWORD.decode()),
            request_timeout_s=9.0,
            resend_s=0.5,
        )
        for i in range(n)
    ]


async def _metald_phase(sched: BmcScheduler, drivers: list[IpmiDriver], phase: str) -> list[Any]:
    async def one(i: int, d: IpmiDriver) -> Any:
        t0 = time.perf_counter()
        try:
            if phase == "status":
                r: Any = await sched.run(str(i), d.get_power, name="bench-status")
            else:
                await sched.run(
                    str(i),
                    lambda: d.set_power(PowerAction.CYCLE),
                    name="bench-cycle",
                    idempotent=False,
                )
                r = await _confirm_on(sched, str(i), d)
        except BmcError as e:
            r = e
        return r, time.perf_counter() - t0

    return await asyncio.gather(*(one(i, d) for i, d in enumerate(drivers)))


async def _confirm_on(sched: BmcScheduler, key: str, d: IpmiDriver) -> Any:
    """Read the BMC until it reports the machine on, as the daemon confirms a power action."""
    status = await wait_for_state(
        lambda: sched.run(key, d.get_power, name="bench-confirm"),
        PowerState.ON,
        time.monotonic() + CONFIRM_GIVE_UP_S,
        errors=(BmcError,),
    )
    return status if status is CommandStatus.CONFIRMED else RuntimeError("never reported on")


async def _pool_phase(drivers: list[IpmiDriver], phase: str, workers: int = 8) -> list[Any]:
    """Ironic-style: a fixed pool of workers, each running one command at a time."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(drivers)):
        queue.put_nowait(i)
    out: list[Any] = [None] * len(drivers)
    sched = BmcScheduler(max_concurrency=workers, min_interval_s=0.0, timeout_s=10.0, retries=3)

    async def worker() -> None:
        while not queue.empty():
            i = queue.get_nowait()
            d = drivers[i]
            t0 = time.perf_counter()
            try:
                if phase == "status":
                    r: Any = await sched.run(str(i), d.get_power, name="bench-status")
                else:
                    await sched.run(
                        str(i),
                        lambda d=d: d.set_power(PowerAction.CYCLE),
                        name="bench-cycle",
                        idempotent=False,
                    )
                    # Ironic's worker waits for the new state before its next node, too.
                    r = await _confirm_on(sched, str(i), d)
            except BmcError as e:
                r = e
            out[i] = (r, time.perf_counter() - t0)

    await asyncio.gather(*(worker() for _ in range(workers)))
    return out


def _pyghmi_phase(
    base_port: int, n: int, phase: str, threads: int, commands: dict[int, Any]
) -> list[Any]:
    """pyghmi's client, a pool of threads each running one BMC command at a time."""
    from concurrent.futures import ThreadPoolExecutor

    from pyghmi.ipmi.command import Command

    def one(i: int) -> Any:
        t0 = time.perf_counter()
        try:
            cmd = commands.get(i)
            if cmd is None:
                cmd = commands[i] = Command(
                    bmc="127.0.0.1",
                    userid=USER.decode(),
                    password=PASSWORD.decode(),
                    port=base_port + i,
                    keepalive=False,
                )
            if phase == "status":
                r: Any = PowerState(cmd.get_power()["powerstate"])
            else:
                r = cmd.raw_command(netfn=0x00, command=0x02, data=(2,))
                if r.get("code"):
                    r = RuntimeError(r.get("error", "failed"))
        except Exception as e:
            r = e
        return r, time.perf_counter() - t0

    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(one, range(n)))


def _pyghmi_run(conn: Any, base_port: int, n: int, threads: int) -> list[dict[str, Any]]:
    _ask(conn, "reset")
    commands: dict[int, Any] = {}
    rows = []
    sim_cpu = _ask(conn, "counts")["cpu"]
    for phase in ("status", "cycle"):
        t0, cpu0 = time.perf_counter(), time.process_time()
        results = _pyghmi_phase(base_port, n, phase, threads, commands)
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        counts = _ask(conn, "counts")
        sim_used, sim_cpu = counts["cpu"] - sim_cpu, counts["cpu"]
        rows.append(_row(f"pyghmi-{threads}", phase, results, counts, wall, cpu, sim_used))
    return rows


def _row(
    kind: str,
    phase: str,
    results: list[Any],
    counts: dict[str, Any],
    wall: float,
    cpu: float,
    sim_used: float,
) -> dict[str, Any]:
    executed = counts["status"] if phase == "status" else counts["controls"]
    ok = [r for r, _ in results if not isinstance(r, Exception)]
    if phase == "status":
        ok = [r for r in ok if r is PowerState.OFF]
    lat = sorted(t for _, t in results)
    return {
        "run": kind,
        "phase": phase,
        "answered": len(ok),
        "wall_s": wall,
        "p50_ms": statistics.median(lat) * 1000,
        "p99_ms": lat[int(len(lat) * 0.99) - 1] * 1000,
        "once": sum(1 for c in executed if c == 1),
        "lost": sum(1 for c in executed if c == 0),
        "twice": sum(1 for c in executed if c > 1),
        "rx": counts["rx"],
        "dropped": counts["dropped"],
        "cached": counts["cached"],
        "cpu": cpu,
        "sim_cpu": sim_used,
    }


def _ask(conn: Any, what: str) -> Any:
    conn.send(what)
    return conn.recv()


async def _run(
    kind: str, conn: Any, base_port: int, n: int, concurrency: int = 256
) -> list[dict[str, Any]]:
    _ask(conn, "reset")
    drivers = _drivers(base_port, n)
    # metald's defaults (BmcConfig): global bound 256, 200 ms between commands to one BMC.
    sched = BmcScheduler(max_concurrency=concurrency, min_interval_s=0.2, timeout_s=10.0, retries=3)
    rows = []
    sim_cpu = _ask(conn, "counts")["cpu"]
    try:
        for phase in ("status", "cycle"):
            t0, cpu0 = time.perf_counter(), time.process_time()
            if kind == "metald":
                results = await _metald_phase(sched, drivers, phase)
            else:
                results = await _pool_phase(drivers, phase)
            wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
            counts = _ask(conn, "counts")
            sim_used, sim_cpu = counts["cpu"] - sim_cpu, counts["cpu"]
            rows.append(_row(kind, phase, results, counts, wall, cpu, sim_used))
    finally:
        for d in drivers:
            await d.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bmcs", type=int, default=1000)
    ap.add_argument("--base-port", type=int, default=30000)
    ap.add_argument("--delay-ms", default="20,50")
    ap.add_argument("--drop", type=float, default=0.01)
    ap.add_argument(
        "--settle-ms", default="200,1000", help="how long after a command its state shows"
    )
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--concurrency", type=int, default=256, help="metald's global bound")
    ap.add_argument(
        "--pyghmi",
        default="",
        help="also run pyghmi's client with these thread counts, comma-separated (e.g. 8,64)",
    )
    args = ap.parse_args()
    args.load_before = os.getloadavg()[0]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, args.bmcs * 2 + 256)), hard))
    lo, hi = (float(x) / 1000 for x in args.delay_ms.split(","))
    s_lo, s_hi = (float(x) / 1000 for x in args.settle_ms.split(","))

    parent, child = mp.Pipe()
    proc = mp.get_context("fork").Process(
        target=_fleet_main,
        args=(child, args.base_port, args.bmcs, (lo, hi), args.drop, args.seed, (s_lo, s_hi)),
    )
    proc.start()
    try:
        assert parent.recv() == "ready"
        rows = asyncio.run(_run("metald", parent, args.base_port, args.bmcs, args.concurrency))
        _progress(rows)
        rows += asyncio.run(_run("pool-8", parent, args.base_port, args.bmcs))
        _progress(rows)
        for threads in filter(None, args.pyghmi.split(",")):
            rows += _pyghmi_run(parent, args.base_port, args.bmcs, int(threads))
            _progress(rows)
    finally:
        parent.send("stop")
        proc.join(10)
    _print(rows, args)


def _progress(rows: list[dict[str, Any]]) -> None:
    for r in rows[-2:]:
        print(
            f"# {r['run']} {r['phase']}: {r['answered']} answered in {r['wall_s']:.2f} s",
            file=sys.stderr,
            flush=True,
        )


def _print(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(
        f"# BMC fan-out: {args.bmcs} simulated IPMI BMCs, replies delayed {args.delay_ms} ms, "
        f"{args.drop:.0%} of packets dropped each way, power state shown {args.settle_ms} ms "
        f"after a command, cycles confirmed; {os.cpu_count()} CPUs"
    )
    print(
        f"# command: .venv/bin/python bench/bmc_fanout.py --bmcs {args.bmcs} --seed {args.seed} "
        f"--concurrency {args.concurrency}; 1-min load average before {args.load_before:.2f}, after {os.getloadavg()[0]:.2f}"
    )
    head = (
        "run",
        "phase",
        "answered",
        "wall s",
        "client CPU s",
        "fleet CPU s",
        "p50 ms",
        "p99 ms",
        "executed once",
        "lost",
        "executed twice",
        "pkts in",
        "dropped",
        "re-sent, answered from cache",
    )
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        print(
            f"| {r['run']} | {r['phase']} | {r['answered']}/{args.bmcs} | {r['wall_s']:.2f} | "
            f"{r['cpu']:.2f} | {r['sim_cpu']:.2f} | "
            f"{r['p50_ms']:.0f} | {r['p99_ms']:.0f} | {r['once']} | {r['lost']} | {r['twice']} | "
            f"{r['rx']} | {r['dropped']} | {r['cached']} |"
        )
    by = {(r["run"], r["phase"]): r["wall_s"] for r in rows}
    others = [r for r in dict.fromkeys(r["run"] for r in rows) if r != "metald"]
    print()
    print("| phase | metald s | " + " | ".join(f"{o} s | {o} / metald" for o in others) + " |")
    print("|---|---|" + "---|---|" * len(others))
    for phase in ("status", "cycle", "both"):

        def wall(run: str, phase: str = phase) -> float:
            if phase == "both":
                return by[(run, "status")] + by[(run, "cycle")]
            return by[(run, phase)]

        m = wall("metald")
        cells = " | ".join(f"{wall(o):.2f} | {wall(o) / m:.1f}x" for o in others)
        print(f"| {phase} | {m:.2f} | {cells} |")


if __name__ == "__main__":
    main()
