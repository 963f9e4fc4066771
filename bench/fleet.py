"""Fleet storm: 1 metald instance x N machines, then 3 instances x N on one PostgreSQL, with a
``kill -9`` of one of the 3 in the middle of the storm.

    sudo .venv/bin/python bench/fleet.py                  # 1 x 1,000 then 3 x 1,000
    sudo .venv/bin/python bench/fleet.py --quick          # 1 x 40 then 3 x 40 (the smoke test)
    sudo .venv/bin/python bench/fleet.py --machines 300 --instances 2 --json /tmp/fleet.json

Per run, a fresh PostgreSQL database (vmlab/pg.py's private cluster, one for the whole bench)
holds one BMC row per simulated machine (IPMI, the machine's system UUID, so the machine's
first inventory links it). The instances are real ``metald serve`` processes, each in its own
network namespace, all on one provisioning segment (a bridge in the simulation's namespace),
all serving the same ``[[boot.networks]]`` in DHCP load-balancing mode. The simulation's
namespace holds:

- the simulated BMCs (bench/bmc_fanout.py's RMCP+ server half, one UDP port each, in their own
  process) that record which *source address* (which instance) read each BMC's power state,
  so "each BMC polled by exactly one instance" is counted at the BMCs;
- the simulated machines (bench/storm.py's phase 1: iPXE DORA, boot script, discovery DORA,
  inventory, next) behind one simulated relay that forwards every DHCP packet to every
  instance (one ``ip helper-address`` per instance); the instance whose bucket the MAC falls
  in answers, and the machine then speaks HTTP to the instance that answered it.

A run: start the instances (the first alone, so it writes the admin token), wait until every
BMC is held in the store, count one power-sync window at the BMCs, power on all machines at
once, wait until the API counts them all ready, count a window again. With several instances,
once a third of the machines are ready (``--kill-at``) the bench sends ``kill -9`` to the
second instance and measures the takeover: its BMCs held by the survivors in the store, and
the first DHCP answer by a survivor to a machine the dead instance had answered. A simulated
machine whose instance stops answering its HTTP calls (connection refused) powers off and
PXE-boots again (counted as a reboot; a real one would be power-cycled by its agent's give-up
or the watchdog through its BMC's new owner): if the API says it is already ready, its
inventory landed before the kill and it stops there.

Measured from /proc (utime + stime): each metald's CPU and PostgreSQL's (postmaster, its live
children and its reaped ones) over the storm; from pg_stat_database: transactions committed
and rows written (inserted + updated + deleted) over the storm, per machine and at the peak
(sliding window of ``--peak-window`` seconds; the bench's own few queries are subtracted).
Not measured: claims and provisioning (bench/storm.py), assets, real boot times.

The outer process (root namespace) sets up and always tears down: metald, the simulators,
the namespaces, PostgreSQL, the temp dir (also on Ctrl-C).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import bmc_fanout as sim_bmc
import storm
from _lab import ROOT, namespaces, table, veth

SUBNET_PREFIX = "10.77.0"
RELAY = f"{SUBNET_PREFIX}.2"  # the simulation's address on the bridge: relay, BMCs
API_PORT = storm.API_PORT
#: A simulated machine gives up on an instance after this many HTTP tries (0.5 + 1 s apart)
#: and PXE-boots again; and after this many reboots the bench fails.
AGENT_TRIES = 3
MAX_REBOOTS = 12


def server_addr(i: int) -> str:
    return f"{SUBNET_PREFIX}.{10 + i}"


def system_uuid(i: int) -> str:
    """The system UUID vmlab.inventory.h100_server reports for machine ``i``."""
    return str(uuid.UUID(int=(0x4C4C4544 << 96) | i))


# ======================================================================================
# The simulated BMCs (own process, in the simulation's namespace)
# ======================================================================================


class _CountingBmc(sim_bmc._SimBmc):
    """Remembers, per BMC, the source addresses (instances) that read its power state."""

    readers: dict[int, set[str]] = {}

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self._peer = addr[0]
        super().datagram_received(data, addr)

    def _command(self, sid: int, sess: Any, req: Any) -> bytes:
        if (req.netfn, req.cmd) == (0x00, 0x01):
            self.readers.setdefault(self.idx, set()).add(self._peer)
        return super()._command(sid, sess, req)


def bmcs_main(params_json: str) -> int:
    """Serve N simulated BMCs; commands on stdin (reset, counts, stop), answers on stdout."""
    p = json.loads(params_json)
    n, base = p["n"], p["base_port"]

    async def main() -> None:
        loop = asyncio.get_running_loop()
        fleet = sim_bmc._Fleet(n, (0.001, 0.005), 0.0, 1)
        ts = [
            (
                await loop.create_datagram_endpoint(
                    lambda i=i: _CountingBmc(fleet, i), local_addr=(RELAY, base + i)
                )
            )[0]
            for i in range(n)
        ]
        print("ready", flush=True)
        while True:
            cmd = (await loop.run_in_executor(None, sys.stdin.readline)).strip()
            if cmd == "reset":
                fleet.status = [0] * n
                _CountingBmc.readers = {}
                print("ok", flush=True)
            elif cmd == "counts":
                readers = {i: sorted(s) for i, s in _CountingBmc.readers.items()}
                print(json.dumps({"status": fleet.status, "readers": readers}), flush=True)
            else:
                break
        for t in ts:
            t.close()

    asyncio.run(main())
    return 0


# ======================================================================================
# The simulated machines (own process, in the simulation's namespace): bench/storm.py's
# phase 1, with the relay forwarding to every instance and machines that reboot when the
# instance they talk to dies.
# ======================================================================================


class AlreadyReady(Exception):
    """The store already has this machine's inventory (posted to an instance that died)."""


class FleetStorm(storm.Storm):
    #: One script per boot: a token-less one is handled in ``enroll`` (and counted there).
    tokenless_tries = 1

    def __init__(self, p: dict[str, Any]) -> None:
        super().__init__(p)
        self.servers: list[str] = p["servers"]
        self.api = f"http://{self.servers[0]}:{API_PORT}"
        self.reboots = 0
        self.found_ready = 0
        self.failovers = 0
        self.tokenless = 0
        self.stranded: list[str] = []
        #: Machines whose scripts came without a token for over a minute, then with one.
        self.recovered: list[str] = []
        self.stranded_wait_s: float = p.get("stranded_wait_s", 420.0)
        self.reboot_reasons: set[str] = set()
        #: (monotonic time, machine index, answering server) per DHCP ACK.
        self.acks: list[tuple[float, int, str]] = []

    async def _exchange(self, pkt: Any, want: set[int], timeouts: tuple[float, ...]) -> Any:
        """As storm.Storm._exchange, but every packet goes to every instance."""
        from metald.boot.dhcp.packet import serialize

        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.relay.waiters[pkt.xid] = (fut, want)
        wire = serialize(pkt)
        try:
            for n, t in enumerate(timeouts):
                if n:
                    self.c.dhcp_retransmits += 1
                assert self.relay.transport is not None
                for srv in self.servers:
                    self.relay.transport.sendto(wire, (srv, 67))
                try:
                    return await asyncio.wait_for(asyncio.shield(fut), t)
                except TimeoutError:
                    continue
            raise storm.StormError(f"no DHCP answer after {len(timeouts)} tries")
        finally:
            self.relay.waiters.pop(pkt.xid, None)

    async def dhcp(self, sim: Any, *, ipxe: bool) -> Any:
        ack = await super().dhcp(sim, ipxe=ipxe)
        self.acks.append((time.monotonic(), sim.idx, str(ack.server_id)))
        return ack

    async def http(self, method: str, url: str, *, tries: int = 8, api: bool = False, **kw: Any) -> Any:  # fmt: skip
        """Agent and iPXE calls go to ``boot.http_url`` as a fleet address (a VIP or a DNS name
        over the instances): when the instance behind it stops answering, the next call
        reaches a live one. Modelled as: after a few failed tries, the next instance."""
        if api:
            return await super().http(method, url, tries=tries, api=True, **kw)
        for _hop in range(len(self.servers)):
            try:
                return await super().http(method, url, tries=min(tries, AGENT_TRIES), **kw)
            except storm.StormError as e:
                if " 409 " in str(e) and "is ready, not inspecting" in str(e):
                    # Its inventory landed at an instance that died before answering: the
                    # agent stops (not retried by storm.py's inventory loop).
                    raise AlreadyReady(str(e)) from None
                if re.search(r": [1-4]\d\d ", str(e)) or len(self.servers) == 1:
                    raise  # an answer, not a dead instance
                host = urlsplit(url).hostname or ""
                nxt = self.servers[(self.servers.index(host) + 1) % len(self.servers)]
                url = url.replace(f"//{host}:", f"//{nxt}:", 1)
                self.failovers += 1
        raise storm.StormError(f"{method} {url}: no instance answered")

    async def pxe_boot(self, sim: Any, expect: str) -> dict[str, str]:
        try:
            return await super().pxe_boot(sim, expect)
        except storm.Tokenless:  # a script without an agent token: one try per boot here
            self.tokenless += 1
            raise

    async def enroll(self, sim: Any, t0: float) -> None:
        reboots = 0
        tokenless_since: float | None = None
        while True:
            try:
                await super().enroll(sim, t0)
                if tokenless_since is not None and time.monotonic() - tokenless_since > 60:
                    self.recovered.append(sim.mac)  # a stranded boot armed again by metald
                return None
            except (storm.StormError, AlreadyReady) as e:
                self.reboot_reasons.add(str(e)[:200])
                if sim.machine_id is not None:
                    m = await self.http(
                        "GET", f"{self.api}/api/v1/machines/{sim.machine_id}",
                        token=self.admin, api=True,
                    )  # fmt: skip
                    if m["state"] == "ready":  # its inventory landed before the kill
                        self.found_ready += 1
                        self.c.latencies.append(time.monotonic() - t0)
                        return None
                now = time.monotonic()
                if isinstance(e, storm.Tokenless):
                    tokenless_since = tokenless_since or now
                    if now - tokenless_since > self.stranded_wait_s:
                        # Its armed boot is gone (taken by a fetch whose answer never came)
                        # and metald did not arm another: it stays inspecting until
                        # inspecting_timeout_s. Counted, not waited for.
                        self.stranded.append(sim.mac)
                        return None
                    wait = min(2.0 ** min(6, int(now - tokenless_since) // 8), 8.0)
                else:
                    tokenless_since = None
                    reboots += 1
                    if reboots > MAX_REBOOTS:
                        raise storm.StormError(
                            f"{sim.mac}: still not ready after {MAX_REBOOTS} reboots"
                        ) from None
                    wait = 1.0
                self.reboots += 1
                await asyncio.sleep(wait)  # PXE again

    async def wait_count(self, state: str, want: int, timeout: float = 60) -> int:
        # Stranded machines are reported as such, not waited for (the store's count is the
        # figure the bench prints).
        got = await super().wait_count(state, want - len(self.stranded), timeout)
        return got + len(self.stranded)

    async def run(self) -> dict[str, Any]:
        res = await super().run()
        res["reboots"] = self.reboots
        res["found_ready"] = self.found_ready
        res["failovers"] = self.failovers
        res["tokenless"] = self.tokenless
        res["stranded"] = self.stranded
        res["recovered"] = self.recovered
        res["reboot_reasons"] = sorted(self.reboot_reasons)[:5]
        res["acks"] = self.acks
        return res


def machines_main(params_json: str) -> int:
    """Run the storm; the result goes to the file ``result`` (too big for a pipe's buffer)."""
    p = json.loads(params_json)
    out = Path(p["result"])
    try:
        res = asyncio.run(FleetStorm(p).run())
    except storm.StormError as e:
        out.write_text(json.dumps({"error": str(e)}))
        return 1
    out.write_text(json.dumps(res))
    return 0


# ======================================================================================
# The outer process
# ======================================================================================


def _stat(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def cpu_of(pid: int) -> float:
    try:
        f = _stat(pid)
    except OSError:
        return 0.0
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def pg_cpu(postmaster: int) -> float:
    """PostgreSQL's CPU seconds so far: the postmaster, its reaped children, its live ones."""
    tck = os.sysconf("SC_CLK_TCK")
    f = _stat(postmaster)
    total = sum(int(x) for x in f[11:15])
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            c = _stat(int(d.name))
        except OSError:
            continue
        if int(c[1]) == postmaster:
            total += int(c[11]) + int(c[12])
    return total / tck


class Pg:
    """The bench's one connection to its database: readiness, owners, statistics. Its own
    transactions are counted, to be subtracted from pg_stat_database's."""

    def __init__(self, pg: Any, dbname: str) -> None:
        import psycopg

        self.conn = psycopg.connect(
            f"host={pg.dir} port={pg.port} user=metald dbname={dbname}", autocommit=True
        )
        self.dbname = dbname
        self.own_xacts = 0

    def one(self, sql: str, *args: Any) -> Any:
        self.own_xacts += 1
        return self.conn.execute(sql, args).fetchone()

    def all(self, sql: str, *args: Any) -> list[Any]:
        self.own_xacts += 1
        return self.conn.execute(sql, args).fetchall()

    def ready(self) -> int:
        return int(self.one("SELECT count(*) FROM machines WHERE state = 'ready'")[0])

    def owners(self) -> dict[str, int]:
        rows = self.all("SELECT owner, count(*) FROM bmcs GROUP BY owner")
        return {str(o): int(c) for o, c in rows}

    def stats(self) -> tuple[float, int, int]:
        """(time, commits, rows written) of this database, less this connection's commits."""
        c, w = self.one(
            "SELECT xact_commit, tup_inserted + tup_updated + tup_deleted "
            "FROM pg_stat_database WHERE datname = %s",
            self.dbname,
        )
        return time.monotonic(), int(c) - self.own_xacts, int(w)

    def store(self) -> dict[str, Any]:
        """The database's size, its largest tables' live rows, and the boot events that say
        whether a boot was stranded (``boot.stranded``) or armed again (``boot.rearmed``)."""
        size = int(self.one("SELECT pg_database_size(current_database())")[0])
        tables = self.all(
            "SELECT relname, n_live_tup, pg_total_relation_size(relid) FROM pg_stat_user_tables "
            "ORDER BY pg_total_relation_size(relid) DESC LIMIT 8"
        )
        kinds = self.all(
            "SELECT kind, count(*) FROM events WHERE kind IN "
            "('boot.stranded', 'boot.rearmed', 'boot.script_refetched') GROUP BY kind"
        )
        return {
            "bytes": size,
            "tables": {str(n): [int(r), int(b)] for n, r, b in tables},
            "boot_events": {str(k): int(c) for k, c in kinds},
        }

    def close(self) -> None:
        self.conn.close()


def peak(samples: list[tuple[float, int, int]], window: float, col: int) -> float:
    """Highest rate of column ``col`` over any span of at least ``window`` seconds."""
    best = 0.0
    j = 0
    for i in range(len(samples)):
        while j < len(samples) and samples[j][0] - samples[i][0] < window:
            j += 1
        if j == len(samples):
            break
        best = max(best, (samples[j][col] - samples[i][col]) / (samples[j][0] - samples[i][0]))
    return best


def metald_config(tmp: Path, name: str, i: int, url: str, args: argparse.Namespace) -> Path:
    state = tmp / name
    state.mkdir()
    text = storm.metald_config(state, url)
    text = text.replace('instance = "storm"', f'instance = "{name}"').replace(
        storm.SRV, server_addr(i)
    )
    text = text.replace('level = "info"', f'level = "{args.log_level}"')
    text += (
        f"[fleet]\nheartbeat_s = {args.heartbeat}\ndead_after_s = {args.dead_after}\n"
        f"[bmc]\npower_sync_interval_s = {args.interval}\nmin_interval_ms = 0\n"
    )
    conf = tmp / f"{name}.toml"
    conf.write_text(text)
    return conf


class Run:
    """One run: k instances, k x N machines and BMCs, one database."""

    def __init__(self, k: int, args: argparse.Namespace, pg: Any, key: bytes, tmp: Path) -> None:
        self.k, self.args, self.pg, self.key, self.tmp = k, args, pg, key, tmp
        self.n = k * args.machines
        self.names = [f"rack{i}" for i in range(k)]
        self.procs: dict[str, subprocess.Popen[Any]] = {}
        self.bmcs: subprocess.Popen[str] | None = None
        self.res: dict[str, Any] = {"instances": k, "machines": self.n}

    def seed(self, url: str) -> None:
        from metald.secrets import SecretBox
        from metald.store import Store
        from metald.store.models import Bmc

        store = Store(url)
        store.migrate()
        box = SecretBox(self.key)
        password = box.encrypt(sim_bmc.PASSWORD.decode())
        with store.session() as s:
            for i in range(self.n):
                s.add(
                    Bmc(
                        address=RELAY,
                        port=self.args.base_port + i,
                        protocol="ipmi",
                        username=sim_bmc.USER.decode(),
                        password_enc=password,
                        system_uuid=system_uuid(i),
                    )
                )
            s.commit()
        store.close()

    def bmc(self, cmd: str) -> Any:
        assert self.bmcs is not None and self.bmcs.stdin and self.bmcs.stdout
        self.bmcs.stdin.write(cmd + "\n")
        self.bmcs.stdin.flush()
        line = self.bmcs.stdout.readline()
        return json.loads(line) if cmd == "counts" else line.strip()

    def window(self) -> dict[str, Any]:
        """Count which instances read each BMC's power state over one window, once every BMC
        was read since the last change (an instance's first round opens a session to each of
        its BMCs: slower than a round)."""
        self.bmc("reset")
        t0 = time.monotonic()
        while len(self.bmc("counts")["readers"]) < self.n:
            if time.monotonic() - t0 > 3 * self.args.interval + 60:
                break  # counted as "by none" below
            time.sleep(0.5)
        warmup = time.monotonic() - t0
        self.bmc("reset")
        time.sleep(self.args.window)
        c = self.bmc("counts")
        readers = [len(c["readers"].get(str(i), ())) for i in range(self.n)]
        by: dict[str, int] = {}
        for rs in c["readers"].values():
            for r in rs:
                by[r] = by.get(r, 0) + 1
        return {
            "alive": sum(1 for p in self.procs.values() if p.poll() is None),
            "once": sum(1 for r in readers if r == 1),
            "more": sum(1 for r in readers if r > 1),
            "none": sum(1 for r in readers if r == 0),
            "reads_per_bmc": sum(c["status"]) / self.n,
            "bmcs_per_reader": by,
            "warmup_s": warmup,
        }

    def go(self, ns: dict[str, Any]) -> dict[str, Any]:
        cli = ns["cli"]
        cli.run("ip", "link", "add", "br0", "type", "bridge")
        cli.run("ip", "addr", "add", f"{RELAY}/16", "dev", "br0")
        cli.run("ip", "link", "set", "br0", "up")
        for i in range(self.k):
            veth(ns[f"s{i}"], "vs", f"{server_addr(i)}/16", cli, f"vc{i}", "")
            cli.run("ip", "link", "set", f"vc{i}", "master", "br0")
        dbname = self.pg.new_database().rsplit("/", 1)[1]
        # metald runs in a namespace: PostgreSQL over its Unix socket.
        url = f"postgresql+psycopg://metald@/{dbname}?host={self.pg.dir}&port={self.pg.port}"
        self.seed(url)
        db = Pg(self.pg, dbname)
        postmaster = int((self.pg.data / "postmaster.pid").read_text().split()[0])
        try:
            return self._go(ns, url, db, postmaster)
        finally:
            db.close()

    def _start(self, ns: dict[str, Any], i: int, url: str) -> None:
        name = self.names[i]
        conf = metald_config(self.tmp, name, i, url, self.args)
        key = self.tmp / name / "secrets.key"
        key.write_bytes(self.key)
        key.chmod(0o600)
        log = open(self.tmp / f"{name}.log", "w")  # noqa: SIM115 - lives as long as metald
        self.procs[name] = ns[f"s{i}"].popen(
            sys.executable, "-m", "metald", "serve", "--config", str(conf),
            stdout=log, stderr=subprocess.STDOUT, cwd=str(ROOT), preexec_fn=storm._child_setup,
        )  # fmt: skip

    def fenced_episodes(self) -> dict[str, int]:
        """Per instance, the times it fenced itself and came back (its log's word)."""
        return {
            n: (self.tmp / f"{n}.log")
            .read_text()
            .count("heartbeat written again: no longer fenced")
            for n in self.names
        }

    def log_tail(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text()[-3000:]

    def _go(self, ns: dict[str, Any], url: str, db: Pg, postmaster: int) -> dict[str, Any]:
        args, res = self.args, self.res
        self.bmcs = ns["cli"].popen(
            sys.executable, str(Path(__file__).resolve()), "--_bmcs",
            json.dumps({"n": self.n, "base_port": args.base_port}),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=str(ROOT),
            preexec_fn=storm._child_setup,
        )  # fmt: skip
        assert self.bmcs.stdout is not None
        if self.bmcs.stdout.readline().strip() != "ready":
            raise RuntimeError("the simulated BMCs did not start")
        # The first instance alone: it writes the admin token (the store's first admin).
        self._start(ns, 0, url)
        token = self.tmp / self.names[0] / "admin.token"
        self._wait(lambda: token.exists(), 90, "rack0 did not write its admin token")
        for i in range(1, self.k):
            self._start(ns, i, url)

        def settled() -> bool:  # every BMC held, and each instance holds its share
            held = db.owners()
            return sum(held.get(n, 0) for n in self.names) == self.n and all(
                held.get(n) for n in self.names
            )

        self._wait(settled, 120, "the instances never shared every BMC")
        res["bmcs_held_before"] = db.owners()
        res["window_before"] = self.window()

        # The storm.
        params = {
            "machines": self.n,
            "claim_size": 10,
            "enroll_only": True,
            "connections": args.connections,
            "metald_pid": self.procs["rack0"].pid,
            "admin_token": str(token),
            "servers": [server_addr(i) for i in range(self.k)],
            "result": str(self.tmp / "storm.json"),
        }
        cpu0 = {n: cpu_of(p.pid) for n, p in self.procs.items()}
        pg0 = pg_cpu(postmaster)
        samples = [db.stats()]
        t0 = time.monotonic()
        client = ns["cli"].popen(
            sys.executable, str(Path(__file__).resolve()), "--_machines", json.dumps(params),
            cwd=str(ROOT), preexec_fn=storm._child_setup,
        )  # fmt: skip
        self.client = client
        victim = self.names[1] if self.k > 1 else None
        killed_at: float | None = None
        cpu_victim = 0.0
        took_over_at: float | None = None
        victim_bmcs = 0
        load = [os.getloadavg()[0]]
        while client.poll() is None:
            time.sleep(args.sample)
            samples.append(db.stats())
            load.append(os.getloadavg()[0])
            if victim and killed_at is None and db.ready() >= args.kill_at * self.n:
                victim_bmcs = db.owners().get(victim, 0)
                cpu_victim = cpu_of(self.procs[victim].pid) - cpu0[victim]
                os.kill(self.procs[victim].pid, signal.SIGKILL)
                killed_at = time.monotonic()
                self.procs[victim].wait()
                log(f"kill -9 {victim} at {killed_at - t0:.1f} s ({victim_bmcs} BMCs held)")
            if killed_at is not None and took_over_at is None and not db.owners().get(victim):
                took_over_at = time.monotonic()
                log(f"{victim}'s BMCs held by the survivors {took_over_at - killed_at:.1f} s on")
            if time.monotonic() - t0 > args.timeout:
                raise RuntimeError(f"the storm took longer than {args.timeout} s")
        t_end = time.monotonic()
        cpu1 = {
            n: (cpu_of(p.pid) - cpu0[n]) if p.poll() is None else cpu_victim
            for n, p in self.procs.items()
        }
        pg1 = pg_cpu(postmaster) - pg0
        result = self.tmp / "storm.json"
        if not result.exists():
            raise RuntimeError(f"the simulation gave no result (exit {client.returncode})")
        sim = json.loads(result.read_text())
        if "error" in sim:
            raise RuntimeError(
                f"storm failed: {sim['error']}\n"
                + "\n".join(f"-- {n}:\n{self.log_tail(n)}" for n in self.names)
            )
        # Statistics are flushed by each backend at most once a second: let them land.
        time.sleep(max(1.5, args.sample))
        samples.append(db.stats())
        while killed_at is not None and took_over_at is None:
            if not db.owners().get(victim):
                took_over_at = time.monotonic()
            elif time.monotonic() - killed_at > 120:
                raise RuntimeError(f"{victim}'s BMCs were never taken over: {db.owners()}")
            time.sleep(0.05)
        p1 = sim["phase1"]
        served = self.served(sim["acks"])
        res.update(
            ready_api=p1["ready"] - len(sim["stranded"]),
            fenced_episodes=self.fenced_episodes(),
            ready_store=db.ready(),
            storm_s=p1["wall_s"],
            p50_s=p1["p50_s"],
            p99_s=p1["p99_s"],
            dhcp_retransmits=p1["dhcp_retransmits"],
            pxe_restarts=p1["pxe_restarts"],
            http_retries=p1["http_retries"],
            server_errors=p1["server_errors"],
            reboots=sim["reboots"],
            failovers=sim["failovers"],
            tokenless=sim["tokenless"],
            stranded=sim["stranded"],
            found_ready=sim["found_ready"],
            reboot_reasons=sim["reboot_reasons"],
            client_wall_s=t_end - t0,
            metald_cpu_s=cpu1,
            served=served,
            pg_cpu_s=pg1,
            commits=samples[-1][1] - samples[0][1],
            rows_written=samples[-1][2] - samples[0][2],
            peak_commits_per_s=peak(samples, args.peak_window, 1),
            peak_rows_per_s=peak(samples, args.peak_window, 2),
            bmcs_held_after=db.owners(),
            recovered=sim["recovered"],
            load_avg={"start": load[0], "max": max(load), "end": load[-1]},
            store=db.store(),
        )
        log(
            f"storm: {res['ready_store']} ready, load average {load[0]:.1f} -> max "
            f"{max(load):.1f} -> {load[-1]:.1f}, store {res['store']['bytes'] / 1e6:.1f} MB, "
            f"boot events {res['store']['boot_events']}"
        )
        if killed_at is not None:
            by_server = {server_addr(i): n for i, n in enumerate(self.names)}
            vip = server_addr(1)
            theirs = {ix for t, ix, s in sim["acks"] if s == vip and t < killed_at}
            later = sorted(
                t for t, ix, s in sim["acks"] if ix in theirs and t > killed_at and s != vip
            )
            res["takeover"] = {
                "victim": victim,
                "killed_after_s": killed_at - t0,
                "ready_at_kill": int(args.kill_at * self.n),
                "victim_bmcs": victim_bmcs,
                "bmcs_s": (took_over_at or killed_at) - killed_at,
                "victim_clients": len(theirs),
                "first_dhcp_s": later[0] - killed_at if later else None,
                "last_dhcp_s": later[-1] - killed_at if later else None,
                "kill_to_all_ready_s": t0 + p1["wall_s"] - killed_at,
                "servers": by_server,
            }
        res["window_after"] = self.window()
        return res

    def served(self, acks: list[list[Any]]) -> dict[str, int]:
        """Machines per instance by the server of each machine's last DHCP answer."""
        last: dict[int, str] = {}
        for _t, ix, s in acks:
            last[ix] = s
        names = {server_addr(i): n for i, n in enumerate(self.names)}
        out: dict[str, int] = {}
        for s in last.values():
            out[names.get(s, s)] = out.get(names.get(s, s), 0) + 1
        return out

    def _wait(self, cond: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            for n, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{n} exited ({p.returncode}):\n{self.log_tail(n)}")
            if time.monotonic() > deadline:
                raise RuntimeError(what)
            time.sleep(0.2)

    def stop(self) -> None:
        for p in [getattr(self, "client", None), *self.procs.values()]:
            storm.stop(p, grace=15)
        if self.bmcs is not None and self.bmcs.poll() is None:
            try:
                assert self.bmcs.stdin is not None
                self.bmcs.stdin.write("stop\n")
                self.bmcs.stdin.flush()
                self.bmcs.wait(5)
            except (OSError, subprocess.TimeoutExpired):
                self.bmcs.kill()
                self.bmcs.wait()
        self.res["pids"] = [p.pid for p in self.procs.values()]


def log(msg: str) -> None:
    print(f"fleet: {msg}", file=sys.stderr, flush=True)


def run_one(k: int, args: argparse.Namespace, pg: Any, key: bytes) -> dict[str, Any]:
    roles = ["cli", *(f"s{i}" for i in range(k))]
    with namespaces(*roles) as ns, tempfile.TemporaryDirectory(prefix="metald-fleet-") as d:
        run = Run(k, args, pg, key, Path(d))
        try:
            run.go(ns)
        finally:
            run.stop()
        run.res["namespaces"] = [n.name for n in ns.values()]
        return run.res


def report(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    def ms(x: float, n: int) -> str:
        return f"{1000 * x / n:.1f}"

    rows = []
    for r in results:
        n = r["machines"]
        cpu = r["metald_cpu_s"]
        per = " ".join(
            f"{k}:{v:.1f}s/{r['served'].get(k, 0)}={ms(v, max(1, r['served'].get(k, 0)))}"
            for k, v in sorted(cpu.items())
        )
        rows.append([
            f"{r['instances']} x {n // r['instances']}", f"{r['ready_api']}/{n}",
            f"{r['storm_s']:.1f}", f"{r['p50_s']:.1f}/{r['p99_s']:.1f}", per,
            ms(sum(cpu.values()), n), f"{r['pg_cpu_s']:.1f}", ms(r["pg_cpu_s"], n),
            f"{r['commits'] / n:.1f}", f"{r['rows_written'] / n:.1f}",
            f"{r['peak_commits_per_s']:.0f}", f"{r['peak_rows_per_s']:.0f}",
            f"{r['dhcp_retransmits']}/{r['pxe_restarts']}/{r['reboots']}",
        ])  # fmt: skip
    print(
        "\nStorm (power-on -> ready, all machines at once). CPU from /proc (utime+stime); "
        "per instance: CPU s / machines it answered (last DHCP ACK) = ms per machine; "
        "a killed instance's CPU is counted up to its kill."
    )
    print(
        table(
            [
                "instances x machines",
                "ready (API)",
                "storm s",
                "machine p50/p99 s",
                "metald CPU per instance",
                "metald CPU ms/machine (all)",
                "PostgreSQL CPU s",
                "PostgreSQL CPU ms/machine",
                "commits/machine",
                "rows written/machine",
                f"peak commits/s ({args.peak_window:g} s)",
                "peak rows/s",
                "DHCP retx / PXE restarts / reboots",
            ],
            rows,
        )  # fmt: skip
    )
    rows = []
    for r in results:
        for when in ("before", "after"):
            w = r[f"window_{when}"]
            rows.append([
                f"{r['instances']} x {r['machines'] // r['instances']}",
                f"{when} the storm", w["alive"], w["once"], w["more"], w["none"],
                f"{w['reads_per_bmc']:.2f}",
                " ".join(f"{k}:{v}" for k, v in sorted(w["bmcs_per_reader"].items())),
            ])  # fmt: skip
    print(
        f"\nPower sync, counted at the simulated BMCs over {args.window:g} s windows "
        f"(power_sync_interval_s {args.interval:g}): instances (source addresses) that read "
        "each BMC's power state."
    )
    print(
        table(
            [
                "run",
                "window",
                "instances alive",
                "BMCs read by 1 instance",
                "by >1",
                "by none",
                "reads per BMC",
                "BMCs read per instance",
            ],
            rows,
        )  # fmt: skip
    )
    for r in results:
        t = r.get("takeover")
        if not t:
            continue
        print(
            f"\nkill -9 {t['victim']} {t['killed_after_s']:.1f} s into the storm of "
            f"{r['machines']} (once >= {t['ready_at_kill']} were ready; heartbeat_s "
            f"{args.heartbeat:g}, dead_after_s {args.dead_after:g}):"
        )
        print(
            table(
                ["what", "value"],
                [
                    [
                        "its BMCs held by the survivors (store)",
                        f"{t['bmcs_s']:.1f} s ({t['victim_bmcs']} BMCs)",
                    ],
                    [
                        "first DHCP answer by a survivor to one of its clients",
                        _s(t["first_dhcp_s"]),
                    ],
                    ["last such answer", _s(t["last_dhcp_s"])],
                    ["its clients (machines it had answered)", t["victim_clients"]],
                    ["kill -> every machine ready", f"{t['kill_to_all_ready_s']:.1f} s"],
                    ["agent/iPXE calls moved to a live instance (fleet address)", r["failovers"]],
                    [
                        "machines whose inventory landed at it, unanswered (409 ready)",
                        r["found_ready"],
                    ],
                    [
                        "machines that PXE-booted again / got a script without a token",
                        f"{r['reboots']} / {r['tokenless']}",
                    ],
                    [
                        "ready at the end (API / store)",
                        f"{r['ready_api']} / {r['ready_store']} of {r['machines']}",
                    ],
                    [
                        "BMCs held after",
                        " ".join(f"{k}:{v}" for k, v in sorted(r["bmcs_held_after"].items())),
                    ],
                    [
                        "stranded: scripts without a token for good (its armed boot gone)",
                        len(r["stranded"]),
                    ],
                    [
                        "token-less for over a minute, then armed again and ready",
                        len(r["recovered"]),
                    ],
                    [
                        "boot events in the store (stranded / rearmed / refetched)",
                        " / ".join(
                            str(r["store"]["boot_events"].get(f"boot.{k}", 0))
                            for k in ("stranded", "rearmed", "script_refetched")
                        ),
                    ],
                    [
                        "times each instance fenced itself and came back (its log)",
                        " ".join(f"{k}:{v}" for k, v in sorted(r["fenced_episodes"].items())),
                    ],
                ],
            )  # fmt: skip
        )
    if len(results) > 1:
        a, b = results[0], results[-1]
        ca = sum(a["metald_cpu_s"].values()) / a["machines"]
        cb = sum(b["metald_cpu_s"].values()) / b["machines"]
        print(
            f"\n{b['instances']} x vs 1 x: metald CPU per machine {cb / ca:.2f}x, PostgreSQL CPU "
            f"per machine {b['pg_cpu_s'] / b['machines'] / (a['pg_cpu_s'] / a['machines']):.2f}x, "
            f"storm time {b['storm_s'] / a['storm_s']:.2f}x for {b['machines'] / a['machines']:.0f}x "
            f"the machines on {os.cpu_count()} CPUs"
        )


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f} s"


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--_bmcs":
        return bmcs_main(sys.argv[2])
    if len(sys.argv) == 3 and sys.argv[1] == "--_machines":
        return machines_main(sys.argv[2])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--machines", type=int, default=1000, help="machines (and BMCs) per instance")
    ap.add_argument("--instances", type=int, default=3, help="instances of the second run")
    ap.add_argument(
        "--quick", action="store_true",
        help="smoke: 40 machines per instance, heartbeat 0.5 s, dead after 3 s, short windows",
    )  # fmt: skip
    ap.add_argument(
        "--interval", type=float, default=60.0,
        help="[bmc] power_sync_interval_s (production's default, 60)",
    )  # fmt: skip
    ap.add_argument("--window", type=float, default=0.0, help="BMC count window (2.5 x interval)")
    ap.add_argument("--heartbeat", type=float, default=2.0, help="[fleet] heartbeat_s")
    ap.add_argument("--dead-after", type=float, default=10.0, help="[fleet] dead_after_s")
    ap.add_argument("--kill-at", type=float, default=1 / 3, help="kill once this share is ready")
    ap.add_argument("--connections", type=int, default=256)
    ap.add_argument("--base-port", type=int, default=20000, help="first simulated BMC's port")
    ap.add_argument("--sample", type=float, default=0.5, help="seconds between store samples")
    ap.add_argument("--peak-window", type=float, default=3.0)
    ap.add_argument("--log-level", default="info")
    ap.add_argument("--timeout", type=float, default=1200)
    ap.add_argument("--json", help="also write the results as JSON to this file")
    ap.add_argument(
        "--fleet-only",
        action="store_true",
        help="skip the one-instance run: only the run with --instances (and its kill)",
    )
    args = ap.parse_args()
    if args.quick:
        args.machines, args.interval, args.heartbeat, args.dead_after = 40, 2.0, 0.5, 3.0
    args.window = args.window or 2.5 * args.interval
    if os.geteuid() != 0:
        print("fleet.py needs root (it creates network namespaces)", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, storm._on_sigterm)
    from cryptography.fernet import Fernet

    from vmlab.pg import PgServer

    key = Fernet.generate_key()
    pg = PgServer()
    results: list[dict[str, Any]] = []
    try:
        for k in [args.instances] if args.fleet_only else sorted({1, args.instances}):
            log(f"{k} instance(s) x {args.machines} machines")
            results.append(run_one(k, args, pg, key))
            if args.json:
                Path(args.json).write_text(json.dumps(results, indent=2))
    finally:
        pg.stop()
    print(
        f"# command: sudo .venv/bin/python bench/fleet.py --machines {args.machines} "
        f"--instances {args.instances} --interval {args.interval:g} --heartbeat "
        f"{args.heartbeat:g} --dead-after {args.dead_after:g} --kill-at {args.kill_at:.2f}; "
        f"{os.cpu_count()} CPUs; PostgreSQL {pg.bindir.parent.name} (vmlab/pg.py, fsync off)"
    )
    report(results, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
