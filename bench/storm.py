"""Power-on storm: N simulated GPU servers power on at once, enroll themselves, are claimed by
an orchestrator in claims of 10 and provisioned, against a real metald (subprocess, generated
config, SQLite by default), without QEMU.

    sudo .venv/bin/python bench/storm.py                      # 1,000 machines
    sudo .venv/bin/python bench/storm.py --machines 1000,5000 # side by side, with ratios
    sudo .venv/bin/python bench/storm.py --quick              # CI smoke: 50 machines, 5 claims
    sudo .venv/bin/python bench/storm.py --db postgresql      # vmlab/pg.py's private cluster
    sudo .venv/bin/python bench/storm.py --commission 30 --machines 250,500,1000
                                     # phase 1 with and without commissioning (30 s of checks)

Two network namespaces joined by a veth (bench/_lab.py, as dhcp_bench.py does): metald serves
DHCP on ``vs`` in one; the simulated machines live in the other and reach it through a
simulated relay (giaddr, option 82), as perfdhcp does. Nothing is routed out of them.

Phase 1 (power-on to ready), per machine: iPXE DORA (user class iPXE, arch 0, option 82) ->
GET the boot file URL from the ACK (/boot/<mac>.ipxe) -> agent token and machine id from the
script's kernel line -> the discovery kernel's DORA (udhcpc) -> POST /api/v1/agent/inventory
(schema v1: 8 x H100, NVSwitches, NICs with its MAC, NVMe, BMC from ``ipmitool lan print``) ->
GET /api/v1/agent/next. Done when GET /api/v1/machines?state=ready counts N.

Phase 2 (claim to provisioned): machines/10 concurrent claims of 10 (orchestrator token scoped
to 10 tenants); each claimed machine is then power-cycled (simulated: see STORM.md) and boots
again: iPXE DORA -> script (provision action, fresh agent token) -> DORA -> GET
/api/v1/agent/provision -> progress posts (write 10..90 %, verify) -> done. Done when
GET /api/v1/machines?state=provisioned counts N and every claim lists 10 provisioned machines,
none in two claims.

Commissioning mode (--commission SECONDS): the enroll rule carries a commissioning profile
(stress-ng for SECONDS, fio for 1 s); after its inventory each machine is ``commissioning``, takes
its plan from the inventory's answer (as the agent does; with --legacy-agent, or from a metald
whose answer has none, it asks /api/v1/agent/next and GETs /api/v1/agent/commissioning, as
agents before it did), "runs" each check (sleeps its duration_s) and
posts its real-format output (stress-ng's log, fio's JSON) as the agent does, one post per check,
the last with done; metald judges them and the machine goes ready. Each size runs phase 1 twice,
without and then with commissioning, and the table says how much later machines are ready than
without, against the configured run time, and metald's CPU per machine in both.

The outer process (root namespace) sets up and always tears down: metald, the namespaces, the
temp dir (also on Ctrl-C). The simulation runs as a child inside the client namespace and hands
back one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from ipaddress import IPv4Address
from pathlib import Path
from typing import Any

from _lab import ROOT, namespaces, table, veth

from vmlab.inventory import h100_server

SRV, CLI = "10.77.0.1", "10.77.0.2"
API_PORT = 8080
POOL = ("10.77.1.0", "10.77.250.255")
TENANTS = 10
#: Times a simulated machine goes round its boot order again after iPXE found no DHCP answer.
MAX_PXE_RESTARTS = 20
GPU_SELECTOR = {"gpu_model": "NVIDIA H100*", "min_gpu_count": 8, "labels": {"pool": "storm"}}


def commissioning_rule(run_s: int) -> str:
    """The profile every storm machine gets in commissioning mode: stress-ng for ``run_s`` and
    fio for 1 s (the simulated run time is the sum of the checks' duration_s)."""
    return f"""[enroll.rules.commissioning]
name = "storm-intake"
gpu_model = "NVIDIA H100*"
gpu_count = 8
checks = [
  {{ name = "stress-ng", duration_s = {max(run_s - 1, 0)}, timeout_s = {run_s + 600} }},
  {{ name = "fio", duration_s = 1, timeout_s = 600 }},
]
"""


def metald_config(state: Path, store_url: str, commission_s: int | None = None) -> str:
    store = f'[store]\nurl = "{store_url}"\n' if store_url else ""
    rule = "" if commission_s is None else commissioning_rule(commission_s)
    return f"""state_dir = "{state}"
instance = "storm"
{store}[api]
listen = "{SRV}:{API_PORT}"
[log]
level = "info"
[boot]
enabled = true
dhcp_mode = "full"
interfaces = ["vs"]
server_address = "{SRV}"
router_advertisements = false
assets_dir = "{state.parent / "assets"}"
# Every simulated machine's HTTP comes from the one simulator address, not from its lease.
script_clients = "any"
[[boot.networks]]
name = "storm"
subnet = "10.77.0.0/16"
pool_start = "{POOL[0]}"
pool_end = "{POOL[1]}"
lease_seconds = 3600
interface = "vs"
[enroll]
after_inspection = "poweroff"
[[enroll.rules]]
match = {{ gpu_model = "NVIDIA H100*" }}
labels = {{ pool = "storm" }}
min_gpu_count = 8
{rule}[provision]
# Store every progress report as an event: a real agent reports every few seconds over minutes,
# so each of its reports is stored; the bench's back-to-back reports would otherwise mostly be
# accepted without an event (the default 2 s dedup) and look cheaper than they are.
progress_event_interval_s = 0
"""


# ======================================================================================
# The simulation (runs inside the client namespace)
# ======================================================================================


def _mac(i: int) -> str:
    return f"b0:7b:25:{i >> 16 & 255:02x}:{i >> 8 & 255:02x}:{i & 255:02x}"


def inventory(sim: Sim, boot_id: str, sequence: int) -> dict[str, Any]:
    return h100_server(
        sim.idx, sim.mac, machine_id=sim.machine_id, boot_id=boot_id, sequence=sequence
    )


class StormError(Exception):
    pass


class Tokenless(StormError):
    """Every script of a boot came without an agent token (``Storm.tokenless_tries`` of them)."""


@dataclass
class Counters:
    dora: int = 0
    dhcp_retransmits: int = 0
    scripts: int = 0
    inventories: int = 0
    next_calls: int = 0
    claims: int = 0
    claim_retries: int = 0
    instructions: int = 0
    progress: int = 0
    http_retries: int = 0
    pxe_restarts: int = 0
    #: 5xx answers (each retried): e.g. SQLite "database is locked" after busy_timeout.
    server_errors: int = 0
    #: Commissioning mode: check results posted, and seconds the simulated checks "ran".
    check_posts: int = 0
    check_sleep_s: float = 0.0
    #: Scripts served without an agent token (no boot armed yet): the machine PXE boots again.
    tokenless_scripts: int = 0
    #: Inventories whose acceptance answer was lost (a 5xx or a dropped connection while the
    #: COMMIT went through, as in a database failover): the retry is refused with 409 "is
    #: ready", and the agent goes on to ``next``, as the real agent does.
    inventory_answers_lost: int = 0
    #: Per machine: inventory accepted -> ready, less the time its checks "ran".
    commission_overhead: list[float] = field(default_factory=list)
    #: Per request kind of the commissioning (next, plan, post, done): seconds each took.
    commission_steps: dict[str, list[float]] = field(default_factory=dict)
    latencies: list[float] = field(default_factory=list)


@dataclass
class Sim:
    idx: int
    mac: str
    machine_id: str | None = None
    token: str | None = None
    ip: str | None = None
    #: DHCP retransmits, HTTP retries and PXE restarts this machine needed.
    setbacks: int = 0


class Relay(asyncio.DatagramProtocol):
    """A DHCP relay (giaddr = our address, port 67) for every simulated machine at once."""

    def __init__(self) -> None:
        self.waiters: dict[int, tuple[asyncio.Future[Any], set[int]]] = {}
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        from metald.boot.dhcp.packet import MalformedPacket, parse

        try:
            pkt = parse(data)
        except MalformedPacket:
            return
        w = self.waiters.get(pkt.xid)
        if w is not None and pkt.message_type in w[1] and not w[0].done():
            w[0].set_result(pkt)


class Storm:
    #: Scripts without a token (2 s apart) one boot tries before it gives up (``Tokenless``).
    tokenless_tries = 60

    def __init__(self, p: dict[str, Any]) -> None:
        self.p = p
        self.n: int = p["machines"]
        self.api = f"http://{SRV}:{API_PORT}"
        self.sims = [Sim(i, _mac(i)) for i in range(self.n)]
        self.by_id: dict[str, Sim] = {}
        self.c = Counters()
        self.metald_pid: int = p["metald_pid"]
        self.rng = random.Random(7)
        self.server_error_samples: set[str] = set()

    # ---- plumbing ---------------------------------------------------------------------

    async def dhcp(self, sim: Sim, *, ipxe: bool) -> Any:
        """One DORA through the relay. Retransmits as iPXE does (1, 2, 4, 8 s) or as busybox
        udhcpc does (every 3 s)."""
        from metald.boot.dhcp.packet import Opt, mac_to_bytes

        chaddr = mac_to_bytes(sim.mac)
        rack, port = divmod(sim.idx, 32)
        relay = b"\x01" + bytes([len(c := f"swp{port + 1}".encode())]) + c
        relay += b"\x02" + bytes([len(r := f"leaf-r{rack + 1:03d}".encode())]) + r
        opts: dict[int, bytes] = {Opt.CLIENT_ID: b"\x01" + chaddr}
        if ipxe:
            opts.update(
                {
                    Opt.MAX_MESSAGE_SIZE: (1472).to_bytes(2, "big"),
                    Opt.CLIENT_ARCH: b"\x00\x00",
                    Opt.CLIENT_NDI: b"\x01\x02\x01",
                    Opt.VENDOR_CLASS: b"PXEClient:Arch:00000:UNDI:002001",
                    Opt.USER_CLASS: b"iPXE",
                    Opt.PARAM_REQUEST: bytes([1, 3, 6, 7, 12, 15, 17, 26, 43, 60, 66, 67, 119]),
                    Opt.CLIENT_UUID: b"\x00" + uuid.UUID(int=(0x4C4C4544 << 96) | sim.idx).bytes,
                }
            )
        else:
            opts.update(
                {
                    Opt.VENDOR_CLASS: b"udhcp 1.35.0",
                    Opt.PARAM_REQUEST: bytes([1, 3, 6, 12, 15, 28, 42]),
                }
            )
        timeouts = (1.0, 2.0, 4.0, 8.0, 16.0) if ipxe else (3.0,) * 10
        base = dict(chaddr=chaddr, giaddr=IPv4Address(CLI), hops=1)
        for restart in range(MAX_PXE_RESTARTS + 1):
            if restart:
                # iPXE gave up ("No configuration methods succeeded"): the firmware moves on
                # through its boot order and comes back to PXE; modelled as a retry after 5 s.
                self.c.pxe_restarts += 1
                sim.setbacks += 1
                await asyncio.sleep(5)
            try:
                return await self._dora(sim, opts, relay, base, timeouts)
            except StormError:
                if restart == MAX_PXE_RESTARTS:
                    raise
        raise AssertionError("unreachable")

    async def _dora(
        self,
        sim: Sim,
        opts: dict[int, bytes],
        relay: bytes,
        base: dict[str, Any],
        timeouts: tuple[float, ...],
    ) -> Any:
        from metald.boot.dhcp.packet import DhcpPacket, MessageType, Opt

        xid = self.rng.getrandbits(32)
        discover = DhcpPacket(
            xid=xid,
            options={Opt.MESSAGE_TYPE: b"\x01", **opts, Opt.RELAY_AGENT: relay},
            **base,
        )
        offer = await self._exchange(discover, {MessageType.OFFER}, timeouts, sim)
        request = DhcpPacket(
            xid=xid,
            options={
                Opt.MESSAGE_TYPE: b"\x03",
                **opts,
                Opt.REQUESTED_IP: offer.yiaddr.packed,
                Opt.SERVER_ID: offer.options[Opt.SERVER_ID],
                Opt.RELAY_AGENT: relay,
            },
            **base,
        )
        ack = await self._exchange(request, {MessageType.ACK, MessageType.NAK}, timeouts, sim)
        if ack.message_type is not MessageType.ACK:
            raise StormError(f"{sim.mac}: DHCP NAK for {offer.yiaddr}")
        self.c.dora += 1
        sim.ip = str(ack.yiaddr)
        return ack

    async def _exchange(
        self, pkt: Any, want: set[int], timeouts: tuple[float, ...], sim: Sim | None = None
    ) -> Any:
        from metald.boot.dhcp.packet import serialize

        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.relay.waiters[pkt.xid] = (fut, want)
        wire = serialize(pkt)
        try:
            for n, t in enumerate(timeouts):
                if n:
                    self.c.dhcp_retransmits += 1
                    if sim is not None:
                        sim.setbacks += 1
                assert self.relay.transport is not None
                self.relay.transport.sendto(wire, (SRV, 67))
                try:
                    return await asyncio.wait_for(asyncio.shield(fut), t)
                except TimeoutError:
                    continue
            raise StormError(f"no DHCP answer after {len(timeouts)} tries (xid {pkt.xid:#x})")
        finally:
            self.relay.waiters.pop(pkt.xid, None)

    async def http(
        self,
        method: str,
        url: str,
        *,
        token: str | None = None,
        body: Any = None,
        ok: tuple[int, ...] = (200, 201),
        text: bool = False,
        tries: int = 8,
        api: bool = False,
    ) -> Any:
        """One request, retried on connection errors and 5xx with 0.5, 1, 2 ... s backoff (the
        agent retries forever; here a bounded number of times: twice as many when the run is
        ``patient``, through a database failover)."""
        import aiohttp

        if tries > 1 and self.p.get("patient"):
            tries *= 2

        headers = {"Authorization": f"Bearer {token}"} if token else {}
        data = None
        if body is not None:
            data = json.dumps(body)
            headers["Content-Type"] = "application/json"
        delay = 0.5
        for attempt in range(tries):
            try:
                session = self.api_session if api else self.session
                async with session.request(method, url, data=data, headers=headers) as r:
                    payload = await r.text()
                    if r.status in ok:
                        return payload if text else json.loads(payload)
                    if r.status < 500 and r.status != 429:
                        raise StormError(f"{method} {url}: {r.status} {payload[:500]}")
                    self.c.server_errors += 1
                    self.server_error_samples.add(payload[:300])
            except (aiohttp.ClientError, TimeoutError, ConnectionError) as e:
                if attempt == tries - 1:
                    raise StormError(f"{method} {url}: {type(e).__name__}: {e}") from None
            self.c.http_retries += 1
            await asyncio.sleep(delay)
            delay = min(delay * 2, 8)
        raise StormError(f"{method} {url}: still failing after {tries} tries")

    async def pxe_boot(self, sim: Sim, expect: str) -> dict[str, str]:
        """iPXE DORA, then the script at the ACK's boot file URL; returns the kernel arguments.
        A script without an agent token (no boot armed for the MAC yet: its enrollment was
        held back by the DHCP enroll limit) cannot post anything: the machine boots from the
        network again (DORA and script) after 2 s, as a failed discovery boot would."""
        from metald.boot.dhcp.packet import Opt

        for _attempt in range(self.tokenless_tries):
            ack = await self.dhcp(sim, ipxe=True)
            url = ack.options.get(Opt.BOOTFILE, b"").decode()
            if not url.endswith(f"/boot/{sim.mac}.ipxe"):
                raise StormError(f"{sim.mac}: boot file {url!r} is not its iPXE script URL")
            script = await self.http("GET", url, text=True)
            self.c.scripts += 1
            m = re.search(r"^kernel (\S+) (.*?) \|\| goto failed$", script, re.M)
            if m is None or f"metald.action={expect}" not in m.group(2):
                raise StormError(f"{sim.mac}: expected a {expect} script, got:\n{script}")
            args = dict(a.partition("=")[::2] for a in m.group(2).split())
            if "metald.token" in args:
                sim.token = args["metald.token"]
                sim.machine_id = args["metald.machine"]
                return args
            self.c.tokenless_scripts += 1
            if _attempt < self.tokenless_tries - 1:
                await asyncio.sleep(2)
        raise Tokenless(f"{sim.mac}: the {expect} script never carried an agent token:\n{script}")

    # ---- phase 1: power-on to ready ---------------------------------------------------

    async def enroll(self, sim: Sim, t0: float) -> None:
        args = await self.pxe_boot(sim, "discovery")
        self.by_id[sim.machine_id] = sim  # type: ignore[index]
        await self.dhcp(sim, ipxe=False)  # the discovery kernel's udhcpc
        base = args["metald.url"]
        boot_id = str(uuid.UUID(int=self.rng.getrandbits(128), version=4))
        # A patient run (a database failover under way) retries for a minute or two, as the
        # real agent (which retries forever) would.
        last = 30 if self.p.get("patient") else 5
        out: dict[str, Any] | None = None
        for seq in range(1, last + 1):
            try:
                out = await self.http(
                    "POST",
                    f"{base}/api/v1/agent/inventory",
                    token=sim.token,
                    body=inventory(sim, boot_id, seq),
                    tries=1,
                )
                break
            except StormError as e:
                if seq > 1 and " 409 " in str(e) and "is ready, not inspecting" in str(e):
                    # An earlier try committed but its answer was lost: already ready.
                    self.c.inventory_answers_lost += 1
                    break
                if seq == last:
                    raise
                self.c.http_retries += 1
                sim.setbacks += 1
                await asyncio.sleep(min(seq, 4))
        self.c.inventories += 1
        if out is None:  # accepted by an earlier try whose answer was lost: ready already
            pass
        elif self.p.get("commission_s") is not None:
            if out["state"] != "commissioning":
                raise StormError(f"{sim.mac}: inventory accepted, machine is {out['state']}")
            t_inv = time.monotonic()
            ran = await self.commission(sim, base, out["next"])
            self.c.commission_overhead.append(time.monotonic() - t_inv - ran)
        elif out["state"] != "ready":
            raise StormError(f"{sim.mac}: inventory accepted but machine is {out['state']}")
        nxt = await self.http("GET", f"{base}/api/v1/agent/next", token=sim.token)
        self.c.next_calls += 1
        if nxt["action"] != "poweroff":
            raise StormError(f"{sim.mac}: agent told {nxt}, expected poweroff")
        self.c.latencies.append(time.monotonic() - t0)

    async def commission(self, sim: Sim, base: str, answered: dict[str, Any]) -> float:
        """The agent's commissioning: the inventory's answer says commission and carries the
        plan (an older agent, --legacy-agent, or an older metald: next says commission, then
        GET the plan); run each check (a sleep of its duration_s) and post its output, the
        last post with done. Returns the seconds the checks "ran"."""
        ran = 0.0
        if answered["action"] != "commission":
            raise StormError(f"{sim.mac}: the inventory's answer said {answered}")
        plan = None if self.p.get("legacy_agent") else answered.get("plan")
        if plan is None:
            t = time.monotonic()
            nxt = await self.http("GET", f"{base}/api/v1/agent/next", token=sim.token)
            self._step("next", t)
            self.c.next_calls += 1
            if nxt["action"] != "commission":
                raise StormError(f"{sim.mac}: agent told {nxt}, expected commission")
            t = time.monotonic()
            plan = await self.http("GET", f"{base}/api/v1/agent/commissioning", token=sim.token)
            self._step("plan", t)
        checks = plan["checks"]
        for i, chk in enumerate(checks):
            t = time.monotonic()
            await asyncio.sleep(chk["duration_s"])
            ran += time.monotonic() - t
            self.c.check_sleep_s += chk["duration_s"]
            rep = {
                "name": chk["name"],
                "outcome": "ran",
                "exit_code": 0,
                "duration_s": round(time.monotonic() - t, 2),
                "raw": _check_output(chk["name"], chk["duration_s"], sim.idx),
            }
            t = time.monotonic()
            out = await self.http(
                "POST",
                f"{base}/api/v1/agent/commissioning",
                token=sim.token,
                body={"done": i == len(checks) - 1, "results": [rep]},
            )
            self._step("done" if i == len(checks) - 1 else "post", t)
            self.c.check_posts += 1
        if out["state"] != "ready":
            raise StormError(f"{sim.mac}: commissioning ended with the machine {out['state']}")
        return ran

    def _step(self, kind: str, t0: float) -> None:
        self.c.commission_steps.setdefault(kind, []).append(time.monotonic() - t0)

    async def count(self, state: str) -> int:
        out = await self.http(
            "GET",
            # count_filter: more query (a label), when other machines share the database
            f"{self.api}/api/v1/machines?state={state}&limit=1{self.p.get('count_filter', '')}",
            token=self.admin,
            api=True,
        )
        return int(out["total"])

    async def api_reader(self, done: asyncio.Event, lat: list[float]) -> None:
        """Lists the machines (100 a page, newest first) until ``done``; each answer's time."""
        url = f"{self.api}/api/v1/machines?limit=100"
        while not done.is_set():
            t = time.monotonic()
            await self.http("GET", url, token=self.admin, api=True)
            lat.append(time.monotonic() - t)

    async def wait_count(self, state: str, want: int, timeout: float = 60) -> int:
        deadline = time.monotonic() + timeout
        while True:
            got = await self.count(state)
            if got >= want or time.monotonic() > deadline:
                return got
            await asyncio.sleep(0.05)

    # ---- phase 2: claims to provisioned -----------------------------------------------

    async def provision(self, machine_id: str, t0: float) -> None:
        sim = self.by_id[machine_id]
        args = await self.pxe_boot(sim, "provision")
        if args.get("metald.mode") != "deploy":
            raise StormError(f"{sim.mac}: provision script without metald.mode=deploy: {args}")
        await self.dhcp(sim, ipxe=False)
        base = args["metald.url"]
        ins = await self.http("GET", f"{base}/api/v1/agent/provision", token=sim.token)
        self.c.instructions += 1
        if ins["action"] != "provision" or ins["machine_id"] != machine_id:
            raise StormError(f"{sim.mac}: provision instruction {ins}")
        size = int(ins["image"].get("size_bytes") or 8 << 30)
        rate = 1.1e9 + (sim.idx % 7) * 5e7
        reports: list[dict[str, Any]] = [
            {"phase": "write", "percent": pct, "bytes": size * pct // 100, "rate_bps": rate}
            for pct in (10, 30, 50, 70, 90)
        ]
        reports += [
            {"phase": "verify", "percent": 100, "bytes": size, "rate_bps": 2.4e9},
            {"phase": "verify", "percent": 100, "bytes": size, "done": True},
        ]
        for rep in reports:
            out = await self.http(
                "POST", f"{base}/api/v1/agent/progress", token=sim.token, body=rep
            )
            self.c.progress += 1
        if out["state"] != "provisioned":
            raise StormError(f"{sim.mac}: done reported, machine is {out['state']}")
        self.c.latencies.append(time.monotonic() - t0)

    async def claim(self, k: int, t0: float) -> str:
        body = {
            "tenant_id": self.tenants[k % len(self.tenants)],
            "count": self.p["claim_size"],
            "selector": GPU_SELECTOR,
            "image_id": self.image,
            "ssh_authorized_keys": [
                "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIStormBenchKeyOnly storm@bench"
            ],
            "idempotency_key": f"storm-{k}",
        }
        for attempt in range(20):
            try:
                # 5xx are retried inside (same idempotency key, so a retry never claims twice).
                c = await self.http(
                    "POST",
                    f"{self.api}/api/v1/claims",
                    token=self.orch,
                    body=body,
                    tries=10,
                    api=True,
                )
                break
            except StormError as e:
                # 409 (a concurrent claim took a machine first) is safe to retry: same key.
                if " 409 " not in str(e) or attempt == 19:
                    raise
                self.c.claim_retries += 1
                await asyncio.sleep(0.1)
        self.c.claims += 1
        ids = [m["id"] for m in c["machines"]]
        if len(ids) != self.p["claim_size"]:
            raise StormError(f"claim {c['id']} got {len(ids)} machines")
        # The machines power-cycle into the provision boot (see STORM.md: no BMCs here).
        await asyncio.gather(*(self.provision(mid, t0) for mid in ids))
        return c["id"]

    # ---- driver -----------------------------------------------------------------------

    def cpu(self) -> float:
        try:
            f = Path(f"/proc/{self.metald_pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0
        return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")

    @staticmethod
    def self_cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    async def run(self) -> dict[str, Any]:
        import aiohttp

        loop = asyncio.get_running_loop()
        _t, self.relay = await loop.create_datagram_endpoint(Relay, local_addr=(CLI, 67))
        # One socket carries every simulated machine's DHCP: with the default receive buffer
        # (about 200 KB) a storm of 10,000 machines answered by four instances overflowed it,
        # and half the answers were dropped before the simulation read them (RcvbufErrors),
        # so every machine retransmitted and every instance parsed each retransmit.
        sock = _t.get_extra_info("socket")
        for opt in (getattr(socket, "SO_RCVBUFFORCE", None), socket.SO_RCVBUF):
            if opt is None:
                continue
            try:
                sock.setsockopt(socket.SOL_SOCKET, opt, 32 << 20)
                break
            except OSError:
                continue
        conn = aiohttp.TCPConnector(limit=self.p["connections"])
        timeout = aiohttp.ClientTimeout(total=900, sock_connect=60)
        # The machines share a pool of --connections; the admin and the orchestrator have their
        # own (unbounded), so 100 claims waiting on metald never hold connections the
        # machines' agents need (as in a real fleet, where they are different hosts).
        self.session = aiohttp.ClientSession(connector=conn, timeout=timeout)
        self.api_session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=timeout
        )
        try:
            return await self._run()
        finally:
            await self.session.close()
            await self.api_session.close()
            _t.close()

    def phase_costs(self, cpu0: float, me0: float, lat: list[float]) -> dict[str, object]:
        """Counters, CPU (metald and this simulation) and latency percentiles of a phase."""
        return {
            "dhcp_retransmits": self.c.dhcp_retransmits,
            "http_retries": self.c.http_retries,
            "pxe_restarts": self.c.pxe_restarts,
            "server_errors": self.c.server_errors,
            "metald_cpu_s": self.cpu() - cpu0,
            "client_cpu_s": self.self_cpu() - me0,
            "p50_s": lat[len(lat) // 2],
            "p99_s": lat[min(len(lat) - 1, int(len(lat) * 0.99))],
            "max_s": lat[-1],
            "machines_held_up": sum(1 for s in self.sims if s.setbacks),
        }

    async def _run(self) -> dict[str, Any]:
        deadline = time.monotonic() + 60
        while True:
            try:
                await self.http("GET", f"{self.api}/healthz", tries=1, api=True)
                break
            except StormError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)
        self.admin = Path(self.p["admin_token"]).read_text().strip()
        res: dict[str, Any] = {"machines": self.n}

        # Phase 1
        log(f"phase 1: {self.n} machines power on")
        cpu0, me0, t0 = self.cpu(), self.self_cpu(), time.monotonic()
        # --api-load K: K API clients list the fleet back to back while the machines enroll
        # (an operator's console, an orchestrator's poller): load on the API and the store.
        done = asyncio.Event()
        api_lat: list[float] = []
        readers = [
            asyncio.create_task(self.api_reader(done, api_lat))
            for _ in range(self.p.get("api_load") or 0)
        ]
        try:
            await asyncio.gather(*(self.enroll(s, t0) for s in self.sims))
        finally:
            done.set()
            await asyncio.gather(*readers, return_exceptions=True)
        t_agents = time.monotonic() - t0
        ready = await self.wait_count("ready", self.n)
        wall = time.monotonic() - t0
        if ready != self.n:
            raise StormError(f"phase 1: the API lists {ready} ready machines, expected {self.n}")
        lat = sorted(self.c.latencies)
        res["phase1"] = {
            "wall_s": wall,
            "agents_done_s": t_agents,
            "ready": ready,
            "dora": self.c.dora,
            "scripts": self.c.scripts,
            "inventories": self.c.inventories,
            "next_calls": self.c.next_calls,
            "commission_s": self.p.get("commission_s"),
            "check_posts": self.c.check_posts,
            "tokenless_scripts": self.c.tokenless_scripts,
            "inventory_answers_lost": self.c.inventory_answers_lost,
            "api_load": self.p.get("api_load") or 0,
            "api_load_requests": len(api_lat),
            "api_load_latency_s": _percentiles(api_lat),
            "commission_overhead_s": _percentiles(self.c.commission_overhead),
            "commission_steps_s": {k: _percentiles(v) for k, v in self.c.commission_steps.items()},
            "check_sleep_s_per_machine": self.c.check_sleep_s / self.n,
            **self.phase_costs(cpu0, me0, lat),
        }
        log(
            f"phase 1: {ready} ready in {wall:.2f} s, metald CPU "
            f"{res['phase1']['metald_cpu_s']:.1f} s, {self.c.dhcp_retransmits} DHCP retransmits"
        )

        if self.p.get("enroll_only"):
            return res

        # Setup for phase 2 (not timed): tenants, an orchestrator token, an image.
        self.c = Counters()
        self.tenants = []
        for t in range(TENANTS):
            out = await self.http(
                "POST",
                f"{self.api}/api/v1/tenants",
                token=self.admin,
                body={"name": f"storm-t{t}"},
                api=True,
            )
            self.tenants.append(out["id"])
        tok = await self.http(
            "POST",
            f"{self.api}/api/v1/tokens",
            token=self.admin,
            body={"name": "storm-orchestrator", "role": "orchestrator", "scope": self.tenants},
            api=True,
        )
        self.orch = tok["token"]
        img = await self.http(
            "POST",
            f"{self.api}/api/v1/images",
            token=self.admin,
            body={
                "name": "ubuntu-22.04-cuda",
                "kind": "disk",
                "url": f"http://{SRV}:{API_PORT}/boot/assets/images/ubuntu-22.04-cuda.raw.gz",
                "sha256": "ab" * 32,
                "format": "raw",
                "size_bytes": 8 << 30,
            },
            api=True,
        )
        self.image = img["id"]

        # Phase 2
        n_claims = self.n // self.p["claim_size"]
        log(f"phase 2: {n_claims} claims of {self.p['claim_size']}")
        cpu0, me0, t0 = self.cpu(), self.self_cpu(), time.monotonic()
        claim_ids = await asyncio.gather(*(self.claim(k, t0) for k in range(n_claims)))
        t_agents = time.monotonic() - t0
        want = n_claims * self.p["claim_size"]
        done = await self.wait_count("provisioned", want)
        wall = time.monotonic() - t0
        lat = sorted(self.c.latencies)
        res["phase2"] = {
            "wall_s": wall,
            "agents_done_s": t_agents,
            "provisioned": done,
            "claims": self.c.claims,
            "claim_retries": self.c.claim_retries,
            "dora": self.c.dora,
            "scripts": self.c.scripts,
            "instructions": self.c.instructions,
            "progress": self.c.progress,
            **self.phase_costs(cpu0, me0, lat),
        }
        log(
            f"phase 2: {done} provisioned in {wall:.2f} s, metald CPU "
            f"{res['phase2']['metald_cpu_s']:.1f} s"
        )
        res["checks"] = await self.check(claim_ids, want)
        res["server_error_samples"] = sorted(self.server_error_samples)[:5]
        return res

    async def check(self, claim_ids: list[str], want: int) -> dict[str, Any]:
        """Correctness from the API alone: every claim fulfilled with provisioned machines, no
        machine in two claims, the provisioned count."""
        out = await self.http(
            "GET", f"{self.api}/api/v1/claims?limit=1000", token=self.orch, api=True
        )
        claims = list(out["items"])
        while len(claims) < out["total"]:
            more = await self.http(
                "GET",
                f"{self.api}/api/v1/claims?limit=1000&offset={len(claims)}",
                token=self.orch,
                api=True,
            )
            claims += more["items"]
        seen: dict[str, str] = {}
        dup = 0
        unfulfilled = 0
        not_provisioned = 0
        for c in claims:
            ms = c["machines"]
            if c["state"] != "allocated" or len(ms) != c["count"]:
                unfulfilled += 1
            for m in ms:
                if m["id"] in seen:
                    dup += 1
                seen[m["id"]] = c["id"]
                if m["state"] != "provisioned":
                    not_provisioned += 1
        return {
            "claims_listed": len(claims),
            "claims_made": len(set(claim_ids)),
            "unfulfilled": unfulfilled,
            "machines_in_two_claims": dup,
            "claimed_not_provisioned": not_provisioned,
            "distinct_claimed": len(seen),
            "provisioned_api": await self.count("provisioned"),
            "ready_api": await self.count("ready"),
            "want": want,
        }


def _percentiles(xs: list[float]) -> dict[str, float] | None:
    if not xs:
        return None
    xs = sorted(xs)
    return {
        "p50": xs[len(xs) // 2],
        "p99": xs[min(len(xs) - 1, int(len(xs) * 0.99))],
        "max": xs[-1],
    }


def _check_output(name: str, duration_s: int, idx: int) -> str:
    """What the real tools print, in the formats metald's parsers read (stress-ng 0.15's log
    with --metrics-brief; fio 3.33's JSON, abridged to what is judged)."""
    if name == "fio":
        bw = 3_400_000 + (idx % 13) * 10_000  # KiB/s
        return json.dumps(
            {"jobs": [{"jobname": "read", "error": 0, "read": {"bw": bw, "iops": bw / 1024}}]}
        )
    return (
        f"stress-ng: info:  [812] setting to a {duration_s} second run per stressor\n"
        "stress-ng: info:  [812] dispatching hogs: 224 cpu, 1 vm\n"
        "stress-ng: info:  [812] stressor       bogo ops real time  usr time  sys time   "
        "bogo ops/s     bogo ops/s\n"
        f"stress-ng: info:  [812] cpu           {4_000_000 + idx} {duration_s:.2f} "
        f"{duration_s * 224:.2f} 0.50 {(4_000_000 + idx) / max(duration_s, 1):.2f} 80.00\n"
        "stress-ng: info:  [812] successful run completed in "
        f"{duration_s:.2f}s\n"
    )


def log(msg: str) -> None:
    print(f"storm: {msg}", file=sys.stderr, flush=True)


def client_main(params_json: str) -> int:
    p = json.loads(params_json)
    try:
        res = asyncio.run(Storm(p).run())
    except StormError as e:
        print("RESULT " + json.dumps({"error": str(e)}), flush=True)
        return 1
    print("RESULT " + json.dumps(res), flush=True)
    return 0


# ======================================================================================
# The outer process: namespaces, metald, teardown, tables
# ======================================================================================


#: metald under cProfile (--profile): the event loop thread and every store worker thread, each
#: call profiled in its own thread, merged into one pstats file when metald stops (SIGTERM).
PROFILED_METALD = """
import cProfile, pstats, sys, threading, time
from metald.store import db
profiles, local = [], threading.local()
def profiled(fn):  # fn run under its store thread's own profiler
    def prof_fn(s, *a, **kw):
        p = getattr(local, "p", None)
        if p is None:
            p = local.p = cProfile.Profile(time.thread_time)
            profiles.append(p)
        p.enable()
        try:
            return fn(s, *a, **kw)
        finally:
            p.disable()
    return prof_fn
orig_run, orig_read = db.Store.run, db.Store._read
async def run(self, fn, *args, **kwargs):
    return await orig_run(self, profiled(fn), *args, **kwargs)
async def read(self, pool, fn, *args, **kwargs):
    return await orig_read(self, pool, profiled(fn), *args, **kwargs)
db.Store.run, db.Store._read = run, read
from metald.__main__ import main
main_p = cProfile.Profile(time.thread_time)
profiles.append(main_p)
main_p.enable()
try:
    rc = main(sys.argv[1:])
finally:
    main_p.disable()
    st = pstats.Stats(profiles[0])
    for p in profiles[1:]:
        st.add(p)
    st.dump_stats(OUT)
sys.exit(rc)
"""


def cpu_of(pid: int) -> float:
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def _child_setup() -> None:
    """In metald and the simulation: more file descriptors, and SIGTERM if the bench dies
    (even by SIGKILL), so neither outlives it. ``ip netns exec`` execs, keeping both."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 65536)), hard))
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def _on_sigterm(_sig: int, _frame: object) -> None:
    raise KeyboardInterrupt  # unwind through every finally: processes, namespaces, temp dir


def stop(proc: subprocess.Popen[Any] | None, grace: float = 15) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def host_speed() -> float:
    """CPU seconds of a fixed pure-Python loop (5M additions): these shared machines' speed
    moves by 2-3x over a day, so the per-machine CPU figures are read against this."""
    best = float("inf")
    for _ in range(3):
        t0, acc = time.process_time(), 0
        for i in range(5_000_000):
            acc += i
        best = min(best, time.process_time() - t0)
    return best


def run_one(n: int, args: argparse.Namespace, commission_s: int | None = None) -> dict[str, Any]:
    speed_before = host_speed()
    load_before = os.getloadavg()
    pg = None
    metald = client = None
    with (
        namespaces("srv", "cli") as ns,
        tempfile.TemporaryDirectory(prefix="metald-storm-") as tmp,
    ):
        try:
            veth(ns["srv"], "vs", f"{SRV}/16", ns["cli"], "vc", f"{CLI}/16")
            state = Path(tmp) / "state"
            state.mkdir()
            (state.parent / "assets").mkdir()  # never the state folder: it holds the secrets
            store_url = ""
            if args.db == "postgresql":
                from vmlab.pg import PgServer

                pg = PgServer()
                name = pg.new_database().rsplit("/", 1)[1]
                # metald runs in the namespace: reach PostgreSQL over its Unix socket.
                store_url = f"postgresql+psycopg://metald@/{name}?host={pg.dir}&port={pg.port}"
            cfg = Path(tmp) / "metald.toml"
            cfg.write_text(metald_config(state, store_url, commission_s))
            logs = Path(args.log_dir or tmp)
            logs.mkdir(parents=True, exist_ok=True)
            mlog = logs / f"metald-{n}-{args.db}.log"
            with open(mlog, "w") as logf:
                code = "import sys; from metald.__main__ import main; sys.exit(main())"
                if args.profile:
                    out = Path(args.profile).resolve() / f"metald-{n}-{args.db}.prof"
                    out.parent.mkdir(parents=True, exist_ok=True)
                    code = f"OUT = {str(out)!r}\n" + PROFILED_METALD
                metald = ns["srv"].popen(
                    sys.executable,
                    "-c",
                    code,
                    "serve",
                    "--config",
                    str(cfg),
                    stdout=logf,
                    stderr=subprocess.STDOUT,
                    cwd=str(ROOT),
                    preexec_fn=_child_setup,
                )
            t_start = time.monotonic()
            while not (state / "admin.token").exists():
                if metald.poll() is not None or time.monotonic() - t_start > 60:
                    raise RuntimeError(f"metald did not start; log:\n{mlog.read_text()[-3000:]}")
                time.sleep(0.1)
            params = {
                "machines": n,
                "claim_size": args.claim_size,
                "enroll_only": args.enroll_only or commission_s is not None,
                "commission_s": commission_s,
                "legacy_agent": args.legacy_agent,
                "api_load": args.api_load,
                "connections": args.connections,
                "metald_pid": metald.pid,
                "admin_token": str(state / "admin.token"),
            }
            client = ns["cli"].popen(
                sys.executable,
                str(Path(__file__).resolve()),
                "--_client",
                json.dumps(params),
                stdout=subprocess.PIPE,
                cwd=str(ROOT),
                preexec_fn=_child_setup,
            )
            out, _ = client.communicate(timeout=args.timeout)
            line = next((ln for ln in out.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                raise RuntimeError(f"the simulation gave no result (exit {client.returncode})")
            res = json.loads(line[len("RESULT ") :])
            if "error" in res:
                raise RuntimeError(
                    f"storm failed: {res['error']}\nmetald log tail:\n{mlog.read_text()[-3000:]}"
                )
            res["db"] = args.db
            res["metald_pid"] = metald.pid
            res["bench_pid"] = os.getpid()
            res["metald_cpu_total_s"] = cpu_of(metald.pid)
            res["host_speed_s"] = [speed_before, host_speed()]
            # The 1-minute load average before and after (this box is shared).
            res["loadavg_1m"] = [load_before[0], os.getloadavg()[0]]
            if metald.poll() is not None:
                raise RuntimeError(
                    f"metald exited during the run; log:\n{mlog.read_text()[-3000:]}"
                )
            return res
        finally:
            stop(client, grace=2)
            stop(metald)
            if pg is not None:
                pg.stop()


def rates(r: dict[str, Any]) -> list[list[object]]:
    p1, p2 = r["phase1"], r.get("phase2")
    w1 = p1["wall_s"]
    n = r["machines"]

    def f(x: float, d: int = 1) -> str:
        return f"{x:.{d}f}"

    row1 = [
        "1 power-on -> ready",
        f(w1, 2),
        f(n / w1),
        f(p1["dora"] / w1),
        f(p1["scripts"] / w1),
        f(p1["inventories"] / w1),
        "",
        "",
        f(p1["metald_cpu_s"], 1),
        f(p1["metald_cpu_s"] / n * 1000, 2),
        f(p1["client_cpu_s"], 1),
        f"{p1['p50_s']:.1f}/{p1['p99_s']:.1f}",
        f"{p1['dhcp_retransmits']}/{p1['pxe_restarts']}/{p1['http_retries']}/{p1['server_errors']}",
    ]
    if p2 is None:
        return [row1]
    w2 = p2["wall_s"]
    return [row1,
        ["2 claim -> provisioned", f(w2, 2), f(p2["provisioned"] / w2), f(p2["dora"] / w2),
         f(p2["scripts"] / w2), "", f(p2["claims"] / w2), f(p2["progress"] / w2),
         f(p2["metald_cpu_s"], 1), f(p2["metald_cpu_s"] / n * 1000, 2), f(p2["client_cpu_s"], 1),
         f"{p2['p50_s']:.1f}/{p2['p99_s']:.1f}", f"{p2['dhcp_retransmits']}/{p2['pxe_restarts']}/{p2['http_retries']}/{p2['server_errors']}"],
    ]  # fmt: skip


HEADERS = [
    "phase",
    "wall s",
    "machines/s",
    "DORA/s",
    "scripts/s",
    "inventories/s",
    "claims/s",
    "progress posts/s",
    "metald CPU s",
    "metald CPU ms/machine",
    "client CPU s",
    "machine p50/p99 s",
    "DHCP retx / PXE restarts / HTTP retries / 5xx",
]


def report(results: list[dict[str, Any]]) -> None:
    for r in results:
        c = r.get("checks")
        print(
            f"\n{r['machines']} machines, "
            + (
                ""
                if c is None
                else f"{r['machines'] // r['claim_size']} claims of {r['claim_size']}, "
            )
            + f"database {r['db']}, metald CPU over the whole run "
            f"{r['metald_cpu_total_s']:.1f} s; host speed before/after "
            f"{'/'.join(f'{x:.2f}' for x in r.get('host_speed_s', []))} s "
            "(a 5M-addition Python loop, best of 3; lower is faster)"
        )
        print(table(HEADERS, rates(r)))
        p1 = r["phase1"]
        if p1.get("api_load"):
            q = p1.get("api_load_latency_s") or {}
            print(
                f"API load beside phase 1: {p1['api_load']} clients listing machines, "
                f"{p1['api_load_requests']} answers, p50/p99 {q.get('p50', 0):.3f}/"
                f"{q.get('p99', 0):.3f} s; DHCP retransmits per machine "
                f"{p1['dhcp_retransmits'] / r['machines']:.2f}, PXE restarts {p1['pxe_restarts']}, "
                f"scripts without a token {p1.get('tokenless_scripts', 0)}"
            )
        if c is None:
            print(f"checks (from the API): ready {r['phase1']['ready']}/{r['machines']}")
            continue
        print(
            f"checks (from the API): ready {r['phase1']['ready']}/{r['machines']}, claims listed "
            f"{c['claims_listed']}, unfulfilled {c['unfulfilled']}, machines in two claims "
            f"{c['machines_in_two_claims']}, provisioned {c['provisioned_api']}/{c['want']}"
        )
        for sample in r.get("server_error_samples", []):
            print(f"  a 5xx answer (retried): {sample}")
    if len(results) > 1:
        base = results[0]
        rows = []
        for r in results[1:]:
            k = r["machines"] / base["machines"]
            for ph in [ph for ph in ("phase1", "phase2") if ph in r]:
                rows.append(
                    [
                        f"{ph[-1]}: {r['machines']} vs {base['machines']}",
                        f"{k:.1f}",
                        f"{r[ph]['wall_s'] / base[ph]['wall_s']:.2f}",
                        f"{r[ph]['metald_cpu_s'] / base[ph]['metald_cpu_s']:.2f}",
                        f"{r[ph]['wall_s'] / base[ph]['wall_s'] / k:.2f}",
                        f"{r[ph]['metald_cpu_s'] / base[ph]['metald_cpu_s'] / k:.2f}",
                    ]
                )
        print("\nScaling (1.00 in the last two columns = cost grows linearly with machines):")
        print(
            table(
                [
                    "phase",
                    "machines ratio",
                    "wall ratio",
                    "metald CPU ratio",
                    "wall per machine ratio",
                    "CPU per machine ratio",
                ],
                rows,
            )
        )


def commission_report(pairs: list[tuple[dict[str, Any], dict[str, Any]]]) -> None:
    """Phase 1 without and with commissioning, per size: how much later the machines are
    ready, against the profile's run time, and metald's CPU per machine. "overhead" is per
    machine: inventory accepted -> ready, less the time its checks ran (what commissioning
    costs beyond its configured run time, free of the enrollment's own spread)."""
    rows = []
    for base, com in pairs:
        c, n = com["phase1"], com["machines"]
        # --with-only: no run without; the "without" columns read 0.
        b = base.get("phase1") or {"p50_s": 0.0, "p99_s": 0.0, "wall_s": 0.0, "metald_cpu_s": 0.0}
        steps = c.get("commission_steps_s") or {}
        step_p50 = " / ".join(
            f"{(steps.get(k) or {}).get('p50', 0.0):.1f}" for k in ("next", "plan", "post", "done")
        )
        run_s = c["check_sleep_s_per_machine"]
        ov = c.get("commission_overhead_s") or {"p50": 0.0, "p99": 0.0, "max": 0.0}
        rows.append(
            [
                n,
                f"{run_s:.1f}",
                f"{b['p50_s']:.1f} / {c['p50_s']:.1f}",
                f"{b['p99_s']:.1f} / {c['p99_s']:.1f}",
                f"{c['p50_s'] - b['p50_s']:.1f}",
                f"{c['p99_s'] - b['p99_s']:.1f}",
                f"{c['p99_s'] - b['p99_s'] - run_s:+.1f}",
                f"{ov['p50']:.2f} / {ov['p99']:.2f} / {ov['max']:.2f}",
                f"{b['wall_s']:.1f} / {c['wall_s']:.1f}",
                f"{b['metald_cpu_s'] / n * 1000:.2f} / {c['metald_cpu_s'] / n * 1000:.2f}",
                f"{(c['metald_cpu_s'] - b['metald_cpu_s']) / n * 1000:.2f}",
                step_p50,
                c["check_posts"],
                f"{c['http_retries']}/{c['server_errors']}",
                " / ".join(f"{x:.1f}" for x in com.get("loadavg_1m", [])),
            ]
        )
    print("\nCommissioning (phase 1 without / with; the checks' simulated run time per machine):")
    print(
        table(
            [
                "machines",
                "run time s",
                "ready p50 s",
                "ready p99 s",
                "added p50 s",
                "added p99 s",
                "added p99 - run time s",
                "overhead p50/p99/max s",
                "wall s",
                "metald CPU ms/machine",
                "commissioning CPU ms/machine",
                "next / plan / post / last post p50 s",
                "check posts",
                "HTTP retries / 5xx",
                "load 1m before / after",
            ],
            rows,
        )
    )


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--_client":
        return client_main(sys.argv[2])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--machines", default="1000", help="machines, or several comma-separated (1000,5000)"
    )
    ap.add_argument("--claim-size", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="CI smoke: 50 machines, 5 claims of 10")
    ap.add_argument("--db", choices=["sqlite", "postgresql"], default="sqlite")
    ap.add_argument(
        "--connections", type=int, default=256, help="most HTTP connections open at once"
    )
    ap.add_argument("--enroll-only", action="store_true", help="phase 1 only (power-on -> ready)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per run before giving up")
    ap.add_argument("--json", help="also write the results as JSON to this file")
    ap.add_argument(
        "--profile", metavar="DIR", help="run metald under cProfile, write DIR/metald-N-DB.prof"
    )
    ap.add_argument("--log-dir", help="keep metald's log here (default: removed with the temp dir)")
    ap.add_argument(
        "--commission",
        type=int,
        metavar="SECONDS",
        help="phase 1 without, then with a commissioning profile whose checks run SECONDS",
    )
    ap.add_argument(
        "--with-only",
        action="store_true",
        help="with --commission: skip the run without commissioning (the overhead and the "
        "step times come from the run with it alone)",
    )
    ap.add_argument(
        "--api-load",
        type=int,
        default=0,
        metavar="K",
        help="phase 1 with K API clients listing the machines back to back (API and store load "
        "beside the storm: does the boot plane still answer?)",
    )
    ap.add_argument(
        "--legacy-agent",
        action="store_true",
        help="with --commission: the simulated agents ask next and then the plan after their "
        "inventory, as agents did before the inventory's answer carried the plan",
    )
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("storm.py needs root (it creates network namespaces)", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _on_sigterm)
    sizes = [50] if args.quick else [int(x) for x in args.machines.split(",")]
    if args.commission is not None:
        args.enroll_only = True  # phase 1 is what commissioning changes
        pairs = []
        for n in sizes:
            print(f"== {n} machines, {args.db}, without and with commissioning", flush=True)
            base = {} if args.with_only else run_one(n, args)
            pair = (base, run_one(n, args, commission_s=args.commission))
            pairs.append(pair)
            if args.json:
                Path(args.json).write_text(json.dumps(pairs, indent=2))
            commission_report([pair])
        if len(pairs) > 1:
            commission_report(pairs)
        return 0
    results = []
    for n in sizes:
        print(f"== {n} machines, {args.db}", flush=True)
        r = run_one(n, args)
        r["claim_size"] = args.claim_size
        results.append(r)
        if args.json:  # after each size, so a later failure keeps the earlier results
            Path(args.json).write_text(json.dumps(results, indent=2))
        if len(sizes) > 1:
            report([r])
    report(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
