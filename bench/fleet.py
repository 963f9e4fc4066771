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
#: Machines per claim (one HGX node group of 8 servers).
CLAIM_SIZE = 8
MAX_REBOOTS = 12


def server_addr(i: int) -> str:
    return f"{SUBNET_PREFIX}.{10 + i}"


def system_uuid(i: int) -> str:
    """The system UUID vmlab.inventory.h100_server reports for machine ``i``."""
    return str(uuid.UUID(int=(0x4C4C4544 << 96) | i))


# ======================================================================================
# The simulated BMCs (own process, in the simulation's namespace)
# ======================================================================================


#: Where the simulated machines listen for their BMC's power-on (the simulation's namespace).
BOOT_PORT = 6999
#: Chassis Control's byte -> the command's name in the BMC's log.
CONTROL = {0x00: "off", 0x01: "on", 0x02: "cycle", 0x03: "reset", 0x05: "soft"}


class _CountingBmc(sim_bmc._SimBmc):
    """Remembers, per BMC, the source addresses (instances) that read its power state, and
    every power and boot-device command it executed (a retransmission the session answers
    from its cache is not executed again), with the instance that sent it. A power-on of a
    machine that is off (or a cycle or reset) boots it: the simulated machines are told."""

    readers: dict[int, set[str]] = {}
    #: (BMC index, command, instance address) in the order executed; drained by "commands".
    commands: list[tuple[int, str, str]] = []
    boot_to: Any = None

    def __init__(self, fleet: Any, idx: int) -> None:
        super().__init__(fleet, idx)
        # Get System GUID answers the machine's system UUID (least significant byte first, as
        # the IPMI spec orders it): the instance that verifies the BMC records it, and the
        # machine's inventory (the same UUID) links the two. bmc_fanout's placeholder GUID
        # would overwrite the seeded UUID with one no machine reports: nothing would link.
        self.guid = uuid.UUID(system_uuid(idx)).bytes[::-1]

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self._peer = addr[0]
        super().datagram_received(data, addr)

    def _command(self, sid: int, sess: Any, req: Any) -> bytes:
        f, i = self.fleet, self.idx
        key = (req.rq_seq, req.netfn, req.cmd)
        if (req.netfn, req.cmd) == (0x00, 0x01):
            self.readers.setdefault(i, set()).add(self._peer)
        elif key not in sess.cache and (req.netfn, req.cmd) == (0x00, 0x02):
            what = CONTROL.get(req.data[0] if req.data else -1, "?")
            self.commands.append((i, what, self._peer))
            now_on = f.pending[i][0] if i in f.pending else f.power[i]
            if what in ("cycle", "reset") or (what == "on" and not now_on):
                delay = f.rng.uniform(*f.settle)
                asyncio.get_running_loop().call_later(delay, self._boot)
        elif key not in sess.cache and (req.netfn, req.cmd) == (0x0A, 0x40):
            # Get SEL Info (the health watch's look at the event log): empty, never erased.
            data = bytes([0x51, 0, 0, 0xFF, 0xFF, 0, 0, 0, 0, 0, 0, 0, 0, 0x02])
            sess.cache[key] = sim_bmc.rmcp.encode_response(req, 0, data)
        elif key not in sess.cache and (req.netfn, req.cmd) == (0x00, 0x08):
            # Set System Boot Options, parameter 5 (boot flags): device 0x04 is PXE.
            dev = "pxe" if len(req.data) > 2 and req.data[0] == 5 and req.data[2] == 4 else "disk"
            self.commands.append((i, f"boot:{dev}", self._peer))
            msg = sim_bmc.rmcp.encode_response(req, 0, b"")
            sess.cache[key] = msg
        return super()._command(sid, sess, req)

    def _boot(self) -> None:
        if self.boot_to is not None:
            self.boot_to.sendto(str(self.idx).encode(), (RELAY, BOOT_PORT))


def bmcs_main(params_json: str) -> int:
    """Serve N simulated BMCs; commands on stdin (reset, counts, commands, stop), answers on
    stdout."""
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
        _CountingBmc.boot_to = (
            await loop.create_datagram_endpoint(asyncio.DatagramProtocol, local_addr=(RELAY, 0))
        )[0]
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
            elif cmd == "commands":
                print(json.dumps(_CountingBmc.commands), flush=True)
                _CountingBmc.commands = []
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
        self.acks: list[tuple[float, int, str, str]] = []
        #: Per DHCP transaction (xid): transmissions so far (``--ipxe-secs``).
        self._tx: dict[int, int] = {}
        #: Per machine index: deploys and wipes its agent finished, boots the BMC started.
        self.deploys: dict[int, int] = {}
        self.wipes: dict[int, int] = {}
        self.bmc_boots: dict[int, int] = {}
        self.boot_tasks: dict[int, asyncio.Task[None]] = {}
        self.boot_errors: list[str] = []
        self.lifecycle_started = False

    async def _exchange(
        self, pkt: Any, want: set[int], timeouts: tuple[float, ...], sim: Any = None
    ) -> Any:
        """As storm.Storm._exchange, but every packet goes to every instance."""
        from metald.boot.dhcp.packet import Opt, serialize

        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.relay.waiters[pkt.xid] = (fut, want)
        wire = serialize(pkt)
        ipxe = self.p.get("ipxe_secs") and pkt.options.get(Opt.USER_CLASS) == b"iPXE"
        try:
            for n, t in enumerate(timeouts):
                if n:
                    self.c.dhcp_retransmits += 1
                    if sim is not None:
                        sim.setbacks += 1
                if ipxe:
                    # iPXE (src/net/udp/dhcp.c) puts its transmission count in ``secs``:
                    # count << 2, | 0x02 once it holds an offer (its REQUESTs).
                    count = self._tx.get(pkt.xid, 0) + 1
                    self._tx[pkt.xid] = count
                    request = pkt.options.get(Opt.MESSAGE_TYPE) == b"\x03"
                    pkt.secs = min(0xFFFF, count << 2 | (0x02 if request else 0))
                    wire = serialize(pkt)
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
        self.acks.append((time.monotonic(), sim.idx, str(ack.server_id), str(ack.yiaddr)))
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

    # ---- claims, deploys, releases, wipes across the instances -------------------------

    def status(self, phase: str) -> None:
        """Tell the outer process which phase runs (it kills an instance in each)."""
        Path(self.p["status"]).write_text(json.dumps({"phase": phase}))
        storm.log(f"phase {phase}")

    async def api_call(self, method: str, path: str, k: int, **kw: Any) -> Any:
        """An orchestrator's call to instance ``k`` (modulo), or the next one when that one
        does not answer (connection refused, 5xx: a dead or fenced instance)."""
        last: Exception | None = None
        for hop in range(2 * len(self.servers)):
            srv = self.servers[(k + hop) % len(self.servers)]
            try:
                return await super().http(
                    method, f"http://{srv}:{API_PORT}{path}", api=True, tries=3, **kw
                )
            except storm.StormError as e:
                if re.search(r": [1-4]\d\d ", str(e)):
                    raise
                last = e
                self.failovers += 1
                await asyncio.sleep(1)
        raise storm.StormError(f"{method} {path}: no instance answered: {last}")

    def on_power_on(self, idx: int) -> None:
        """The machine's BMC powered it on (or cycled it): it boots from the network (its
        one-time boot device), whatever it was doing."""
        if not self.lifecycle_started:
            return  # phase 1's machines boot by themselves
        self.bmc_boots[idx] = self.bmc_boots.get(idx, 0) + 1
        old = self.boot_tasks.get(idx)
        if old is not None and not old.done():
            old.cancel()
        self.boot_tasks[idx] = asyncio.create_task(self.netboot(self.sims[idx]))

    async def netboot(self, sim: Any) -> None:
        """One boot: DORA, script, then what the script says (deploy or wipe), as the agent
        does. A failure reboots (the agent's give-up) a few times; a boot without a token
        waits for metald to start another (its next power-on cancels this one)."""
        for attempt in range(8):
            try:
                args = await self.boot_script(sim)
                mode = args.get("metald.mode")
                if mode == "deploy":
                    await self.deploy(sim, args)
                elif mode == "wipe":
                    await self.wipe(sim, args)
                else:
                    self.boot_errors.append(f"{sim.mac}: a BMC boot got {args}")
                return
            except storm.Tokenless:
                await asyncio.sleep(8)
            except storm.StormError as e:
                self.boot_errors.append(f"{sim.mac} (try {attempt + 1}): {str(e)[:300]}")
                await asyncio.sleep(2)
        self.boot_errors.append(f"{sim.mac}: gave up after 8 boots")

    async def boot_script(self, sim: Any) -> dict[str, str]:
        from metald.boot.dhcp.packet import Opt

        ack = await self.dhcp(sim, ipxe=True)
        url = ack.options.get(Opt.BOOTFILE, b"").decode()
        script = await self.http("GET", url, text=True)
        self.c.scripts += 1
        m = re.search(r"^kernel (\S+) (.*?) \|\| goto failed$", script, re.M)
        if m is None:
            raise storm.StormError(f"{sim.mac}: no kernel in its script:\n{script[:500]}")
        args = dict(a.partition("=")[::2] for a in m.group(2).split())
        if "metald.token" not in args:
            self.tokenless += 1
            self.c.tokenless_scripts += 1
            raise storm.Tokenless(f"{sim.mac}: script without a token")
        sim.token = args["metald.token"]
        await self.dhcp(sim, ipxe=False)  # the agent image's udhcpc
        return args

    async def _report(self, sim: Any, base: str, reps: list[dict[str, Any]], end: str) -> None:
        """Progress reports; the last one's answer may be lost with its instance: the retry
        at a survivor then finds the machine already ``end`` (409), which is done."""
        for rep in reps:
            try:
                out = await self.http(
                    "POST", f"{base}/api/v1/agent/progress", token=sim.token, body=rep
                )
            except (storm.StormError, AlreadyReady):
                if not rep.get("done"):
                    raise
                m = await self.api_call(
                    "GET", f"/api/v1/machines/{sim.machine_id}", sim.idx, token=self.admin
                )
                if m["state"] == end:
                    return
                raise
            self.c.progress += 1
        if out["state"] != end:
            raise storm.StormError(f"{sim.mac}: done reported, machine is {out['state']}")

    async def deploy(self, sim: Any, args: dict[str, str]) -> None:
        base = args["metald.url"]
        ins = await self.http("GET", f"{base}/api/v1/agent/provision", token=sim.token)
        self.c.instructions += 1
        if ins["action"] != "provision" or ins["machine_id"] != sim.machine_id:
            raise storm.StormError(f"{sim.mac}: provision instruction {ins}")
        size = int(ins["image"].get("size_bytes") or 8 << 30)
        reps: list[dict[str, Any]] = [
            {"phase": "write", "percent": pct, "bytes": size * pct // 100, "rate_bps": 1.2e9}
            for pct in (10, 50, 90)
        ]
        reps.append({"phase": "verify", "percent": 100, "bytes": size, "done": True})
        await self._report(sim, base, reps, "provisioned")
        self.deploys[sim.idx] = self.deploys.get(sim.idx, 0) + 1

    async def wipe(self, sim: Any, args: dict[str, str]) -> None:
        disks = storm.inventory(sim, "x", 1)["disks"]
        mib = 1 << 20
        evidence = [
            {
                "device": f"/dev/{d['name']}",
                "size_bytes": d["size_bytes"],
                "method": "discard+zero-ends",
                "reads": [
                    {"offset": 0, "length": mib, "zero": True},
                    {"offset": d["size_bytes"] - mib, "length": mib, "zero": True},
                ],
            }
            for d in disks
        ]
        reps: list[dict[str, Any]] = [
            {"phase": "wipe", "percent": (j + 1) * 100 // len(disks), "bytes": d["size_bytes"]}
            for j, d in enumerate(disks)
        ]
        reps.append({"phase": "wipe", "done": True, "disks": evidence})
        await self._report(sim, args["metald.url"], reps, "ready")
        self.wipes[sim.idx] = self.wipes.get(sim.idx, 0) + 1

    async def count_any(self, state: str) -> int:
        out = await self.api_call(
            "GET", f"/api/v1/machines?state={state}&limit=1", 0, token=self.admin
        )
        return int(out["total"])

    async def by_state(self) -> dict[str, int]:
        """Machines per state and the claims (a refused claim's evidence: where they were)."""
        out: dict[str, int] = {}
        for st in ("ready", "claimed", "provisioning", "provisioned", "inspecting",
                   "discovered", "releasing", "wiping", "wipe-failed", "provision-failed"):  # fmt: skip
            n = await self.count_any(st)
            if n:
                out[st] = n
        page = await self.api_call("GET", "/api/v1/claims?limit=1", 0, token=self.orch)
        out["claims"] = int(page["total"])
        return out

    async def wait_any(self, state: str, want: int, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while True:
            got = await self.count_any(state)
            if got >= want or time.monotonic() > deadline:
                return got
            await asyncio.sleep(1)

    async def claim8(self, k: int) -> dict[str, Any]:
        body = {
            "tenant_id": self.tenants[k % len(self.tenants)],
            "count": self.p["claim_size"],
            "selector": storm.GPU_SELECTOR,
            "image_id": self.image,
            "ssh_authorized_keys": ["ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIFleetBenchKey x@bench"],
            "idempotency_key": f"fleet-{k}",
        }
        for attempt in range(30):
            try:
                c = await self.api_call("POST", "/api/v1/claims", k, token=self.orch, body=body)
                break
            except storm.StormError as e:
                # 409: a concurrent claim took a machine first; the same key never claims twice.
                if " 409 " not in str(e) or attempt == 29:
                    raise storm.StormError(
                        f"{e}; machines by state: {await self.by_state()}"
                    ) from e
                self.c.claim_retries += 1
                await asyncio.sleep(0.2)
        self.c.claims += 1
        return c

    async def release(self, k: int, claim_id: str) -> None:
        try:
            await self.api_call(
                "POST", f"/api/v1/claims/{claim_id}/release", k, token=self.orch, ok=(200,)
            )
        except storm.StormError as e:
            if " 409 " not in str(e):  # released already (an answer lost with its instance)
                raise

    async def lifecycle(self, res: dict[str, Any]) -> None:
        """Claims of ``claim_size`` until ``claims`` are made, every claimed machine deployed
        through its BMC's boot; then every claim released and its machines wiped (another BMC
        boot) back to ready. The outer process kills an instance in the middle of each."""
        loop = asyncio.get_running_loop()

        class Boots(asyncio.DatagramProtocol):
            def datagram_received(p, data: bytes, addr: Any) -> None:  # noqa: N805
                self.on_power_on(int(data))

        tr, _p = await loop.create_datagram_endpoint(Boots, local_addr=(RELAY, BOOT_PORT))
        self.lifecycle_started = True
        try:
            await self._lifecycle(res)
        finally:
            tr.close()
            for t in self.boot_tasks.values():
                t.cancel()

    async def _lifecycle(self, res: dict[str, Any]) -> None:
        self.tenants = []
        for t in range(storm.TENANTS):
            out = await self.api_call(
                "POST", "/api/v1/tenants", t, token=self.admin, body={"name": f"fleet-t{t}"}
            )
            self.tenants.append(out["id"])
        tok = await self.api_call(
            "POST", "/api/v1/tokens", 0, token=self.admin,
            body={"name": "fleet-orchestrator", "role": "orchestrator", "scope": self.tenants},
        )  # fmt: skip
        self.orch = tok["token"]
        img = await self.api_call(
            "POST", "/api/v1/images", 0, token=self.admin,
            body={
                "name": "ubuntu-22.04-cuda", "kind": "disk", "format": "raw",
                "url": f"http://{self.servers[0]}:{API_PORT}/boot/assets/images/u.raw.gz",
                "sha256": "ab" * 32, "size_bytes": 8 << 30,
            },
        )  # fmt: skip
        self.image = img["id"]
        n_claims, size = self.p["claims"], self.p["claim_size"]
        want = n_claims * size
        stranded = len(self.stranded)

        self.status("claims")
        self.c = storm.Counters()
        t0 = time.monotonic()
        claims = await asyncio.gather(*(self.claim8(k) for k in range(n_claims)))
        t_claimed = time.monotonic() - t0
        got = await self.wait_any("provisioned", want, self.p["phase_timeout"])
        wall = time.monotonic() - t0
        res["claims"] = {
            "claims": len(claims), "size": size, "claimed_s": t_claimed, "wall_s": wall,
            "provisioned": got, "claim_retries": self.c.claim_retries,
            "deploys": sum(self.deploys.values()), "dhcp_retransmits": self.c.dhcp_retransmits,
            "tokenless": self.c.tokenless_scripts,
        }  # fmt: skip
        storm.log(f"claims: {got} of {want} provisioned in {wall:.1f} s")
        res["claims_check"] = await self.check_claims([c["id"] for c in claims], want)
        if got < want:
            res["claims"]["error"] = f"only {got} of {want} provisioned"
            return

        self.status("release")
        self.c = storm.Counters()
        t0 = time.monotonic()
        await asyncio.gather(*(self.release(k, c["id"]) for k, c in enumerate(claims)))
        t_released = time.monotonic() - t0
        got = await self.wait_any("ready", self.n - stranded, self.p["phase_timeout"])
        wall = time.monotonic() - t0
        res["release"] = {
            "released_s": t_released, "wall_s": wall, "ready": got,
            "wipes": sum(self.wipes.values()), "dhcp_retransmits": self.c.dhcp_retransmits,
            "tokenless": self.c.tokenless_scripts,
        }  # fmt: skip
        storm.log(f"release: {got} ready in {wall:.1f} s")
        self.status("done")

    async def check_claims(self, claim_ids: list[str], want: int) -> dict[str, Any]:
        """From the API: every claim allocated with its machines provisioned, no machine in
        two claims; from the machines: each claimed one deployed once."""
        claims: list[dict[str, Any]] = []
        while True:
            page = await self.api_call(
                "GET", f"/api/v1/claims?limit=500&offset={len(claims)}", 0, token=self.orch
            )
            claims += page["items"]
            if len(claims) >= page["total"] or not page["items"]:
                break
        seen: dict[str, str] = {}
        dup = unfulfilled = not_provisioned = 0
        for c in claims:
            ms = c["machines"]
            if c["state"] != "allocated" or len(ms) != c["count"]:
                unfulfilled += 1
            for m in ms:
                dup += m["id"] in seen
                seen[m["id"]] = c["id"]
                not_provisioned += m["state"] != "provisioned"
        return {
            "claims_listed": len(claims),
            "claims_made": len(set(claim_ids)),
            "unfulfilled": unfulfilled,
            "machines_in_two_claims": dup,
            "claimed_not_provisioned": not_provisioned,
            "distinct_claimed": len(seen),
            "want": want,
        }

    async def _run(self) -> dict[str, Any]:
        res = await super()._run()
        if self.p.get("claims"):
            await self.lifecycle(res)
        return res

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
        res["deploys"] = self.deploys
        res["wipes"] = self.wipes
        res["bmc_boots"] = self.bmc_boots
        res["boot_errors"] = self.boot_errors[:20]
        res["boot_error_count"] = len(self.boot_errors)
        res["machine_ids"] = {s.idx: s.machine_id for s in self.sims}
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
        return self.count("ready")

    def count(self, state: str) -> int:
        return int(self.one("SELECT count(*) FROM machines WHERE state = %s", state)[0])

    def lease_check(self) -> dict[str, int]:
        """Bound leases in the store, and MACs or addresses holding more than one."""
        bound, macs, ips = self.one(
            "SELECT count(*), count(DISTINCT (network, mac)), count(DISTINCT (network, ip)) "
            "FROM leases WHERE state = 'bound'"
        )
        return {
            "bound_leases": int(bound),
            "macs_with_two_bound_leases": int(bound) - int(macs),
            "addresses_bound_twice": int(bound) - int(ips),
        }

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
    state.mkdir(exist_ok=True)
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
        self.claims = args.claims if args.claims >= 0 else self.n // 10
        self.names = [f"rack{i}" for i in range(k)]
        self.procs: dict[str, subprocess.Popen[Any]] = {}
        self.bmcs: subprocess.Popen[str] | None = None
        self.res: dict[str, Any] = {"instances": k, "machines": self.n}
        #: CPU seconds of each instance's earlier (killed) processes, and of the running one
        #: at its start (0: a restarted process counts from its start).
        self.cpu_acc: dict[str, float] = {n: 0.0 for n in self.names}
        self.cpu_base: dict[str, float] = {n: 0.0 for n in self.names}

    def cpu_now(self, name: str) -> float:
        p = self.procs.get(name)
        live = cpu_of(p.pid) - self.cpu_base[name] if p is not None and p.poll() is None else 0
        return self.cpu_acc[name] + live

    def sim_cpu(self) -> float:
        """CPU seconds of the simulation (its machines' process and its BMCs' process): it
        shares the cores with metald and PostgreSQL, so its cost is part of the picture."""
        return sum(
            cpu_of(p.pid)
            for p in (getattr(self, "client", None), self.bmcs)
            if p is not None and p.poll() is None
        )

    def mark(self, phase: str, pg: float, sample: tuple[float, int, int], load: float) -> dict:
        return {
            "phase": phase,
            "t": time.monotonic(),
            "cpu": {n: self.cpu_now(n) for n in self.names},
            "sim": self.sim_cpu(),
            "pg": pg,
            "commits": sample[1],
            "rows": sample[2],
            "load": load,
        }

    def phases(self, marks: list[dict], sim: dict[str, Any], want: int) -> list[dict[str, Any]]:
        """Per phase (enroll, claims, release): wall time, metald and PostgreSQL CPU, commits
        and rows written, and the machines it moved (per-machine figures divide by those)."""
        out = []
        for m0, m1 in zip(marks, marks[1:], strict=False):
            if m0["phase"] not in ("enroll", "claims", "release"):
                continue
            moved = self.n if m0["phase"] == "enroll" else want
            out.append({
                "phase": m0["phase"], "machines": moved, "wall_s": m1["t"] - m0["t"],
                "metald_cpu_s": {n: m1["cpu"][n] - m0["cpu"][n] for n in self.names},
                "pg_cpu_s": m1["pg"] - m0["pg"], "commits": m1["commits"] - m0["commits"],
                "sim_cpu_s": m1.get("sim", 0.0) - m0.get("sim", 0.0),
                "rows_written": m1["rows"] - m0["rows"],
                "load": [m0["load"], m1["load"]],
            })  # fmt: skip
        return out

    def checks(self, marks: list[dict], sim: dict[str, Any], db: Pg) -> dict[str, Any]:
        """Nothing lost or doubled: every BMC command of a phase once per machine (power on,
        one-time PXE, power off at most once: counted at the BMCs), every claimed machine
        deployed once and wiped once (counted at the machines), every address leased to one
        machine (the machines' ACKs and the store's bound leases)."""
        out: dict[str, Any] = {}
        for m in marks:
            if "commands" not in m:
                continue
            per: dict[int, dict[str, int]] = {}
            senders: dict[int, set[str]] = {}
            for idx, what, peer in m["commands"]:
                c = per.setdefault(idx, {})
                c[what] = c.get(what, 0) + 1
                senders.setdefault(idx, set()).add(peer)
            done = {"claims": sim.get("deploys", {}), "release": sim.get("wipes", {})}.get(
                m["phase"], {}
            )
            bad = []
            pxe_again = 0
            for idx in sorted(set(per) | {int(i) for i in done}):
                c = per.get(idx, {})
                # Power commands exactly once; the one-time PXE at least once, and again only
                # where the BMC moved mid-step (a step resumed from a journaled boot device
                # sets it again: it may not have been sent, and a one-time override cannot
                # act twice).
                if (
                    c.get("on", 0) != 1
                    or c.get("boot:pxe", 0) < 1
                    or (c.get("boot:pxe", 0) > 1 and len(senders.get(idx, ())) < 2)
                    or c.get("off", 0) > 1
                    or c.get("cycle", 0) + c.get("reset", 0) + c.get("boot:disk", 0)
                    or (done and done.get(str(idx), 0) != 1)
                ):
                    bad.append({"machine": idx, "commands": c, "done": done.get(str(idx), 0)})
                pxe_again += c.get("boot:pxe", 0) > 1
            out[m["phase"]] = {
                "machines_commanded": len(per),
                "commands": len(m["commands"]),
                "by_kind": {
                    k: sum(c.get(k, 0) for c in per.values())
                    for k in ("off", "on", "boot:pxe", "cycle", "reset", "soft", "boot:disk")
                },
                "machines_done_once": sum(1 for v in done.values() if v == 1),
                "machines_done_twice": sum(1 for v in done.values() if v > 1),
                "bmcs_commanded_by_two_instances": sum(1 for v in senders.values() if len(v) > 1),
                "pxe_set_again_after_a_move": pxe_again,
                "not_once": len(bad),
                "not_once_samples": bad[:5],
            }
        by_ip: dict[str, set[int]] = {}
        for _t, ix, _srv, ip in sim["acks"]:
            by_ip.setdefault(ip, set()).add(ix)
        out["leases"] = {
            "addresses_acked": len(by_ip),
            "addresses_acked_to_two_machines": sum(1 for v in by_ip.values() if len(v) > 1),
            **db.lease_check(),
        }
        return out

    def takeover(self, k: dict[str, Any], acks: list[list[Any]], t0: float) -> dict[str, Any]:
        """A kill's figures: the victim's BMCs held by the survivors (the store), the first and
        last DHCP answer by a survivor to a machine the victim had answered."""
        from metald.boot.dhcp.balance import bucket_owners, rfc3074_hash
        from metald.boot.dhcp.packet import mac_to_bytes

        addr, at = k["addr"], k["killed_at"]
        # Its clients: the machines whose DHCP bucket it owned when it was killed (every
        # instance alive then), which only a survivor can answer after the kill.
        owners = bucket_owners("storm", self.names)
        theirs = {
            ix
            for _t, ix, _s, _ip in acks
            if owners[rfc3074_hash(mac_to_bytes(storm._mac(ix)))] == k["victim"]
        }
        later = sorted(t for t, ix, s, _ip in acks if ix in theirs and t > at and s != addr)
        return {
            "phase": k["phase"],
            "victim": k["victim"],
            "killed_after_s": at - t0,
            "victim_bmcs": k["victim_bmcs"],
            "bmcs_s": k["took_over_at"] - at,
            "victim_clients": len(theirs),
            "first_dhcp_s": later[0] - at if later else None,
            "last_dhcp_s": later[-1] - at if later else None,
            "restarted_after_s": k["restarted_at"] - at if "restarted_at" in k else None,
        }

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
        return json.loads(line) if cmd in ("counts", "commands") else line.strip()

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
        log = open(self.tmp / f"{name}.log", "a")  # noqa: SIM115 - lives as long as metald
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

    def liveness(self) -> dict[str, dict[str, float]]:
        """Per instance, from its log: the DHCP split changes, and the worst event-loop lag it
        reported (metald warns at most every 10 s with the worst lag past 1 s)."""
        out = {}
        for n in self.names:
            text = (self.tmp / f"{n}.log").read_text()
            lags = [float(x) for x in re.findall(r"event loop ran ([0-9.]+) s late", text)]
            out[n] = {
                "dhcp_split_changes": text.count("DHCP split:"),
                "loop_lag_warnings": len(lags),
                "worst_loop_lag_s": max(lags, default=0.0),
            }
        return out

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

        self._wait(settled, max(120, self.n / 20), "the instances never shared every BMC")
        res["bmcs_held_before"] = db.owners()
        res["window_before"] = self.window()

        # The storm.
        params = {
            "machines": self.n,
            "claim_size": CLAIM_SIZE,
            "claims": self.claims,
            "phase_timeout": args.phase_timeout,
            "ipxe_secs": args.ipxe_secs,
            "status": str(self.tmp / "status.json"),
            "enroll_only": True,
            "connections": args.connections,
            "metald_pid": self.procs["rack0"].pid,
            "admin_token": str(token),
            "servers": [server_addr(i) for i in range(self.k)],
            "result": str(self.tmp / "storm.json"),
        }
        samples = [db.stats()]
        t0 = time.monotonic()
        client = ns["cli"].popen(
            sys.executable, str(Path(__file__).resolve()), "--_machines", json.dumps(params),
            cwd=str(ROOT), preexec_fn=storm._child_setup,
        )  # fmt: skip
        self.client = client
        want = self.claims * CLAIM_SIZE
        # (phase, victim, when): one kill -9 in the middle of each phase, each instance but
        # the first in turn; the victim is started again (as its supervisor would) once the
        # survivors hold its BMCs.
        plan: dict[str, tuple[int, Any]] = {}
        if self.k > 1:
            plan["enroll"] = (1, lambda: db.ready() >= args.kill_at * self.n)
            plan["claims"] = (
                2 % self.k or 1,
                lambda: db.count("provisioned") >= want // 2,
            )
            plan["release"] = (
                3 % self.k or 1,
                lambda: db.ready() >= self.n - want // 2,
            )
        kills: list[dict[str, Any]] = []
        phase = "enroll"
        load = [os.getloadavg()[0]]
        marks = [self.mark("enroll", pg_cpu(postmaster), samples[-1], load[-1])]
        status = self.tmp / "status.json"
        while client.poll() is None:
            time.sleep(args.sample)
            samples.append(db.stats())
            load.append(os.getloadavg()[0])
            try:
                now_phase = json.loads(status.read_text())["phase"]
            except (OSError, ValueError):
                now_phase = phase
            if now_phase != phase:
                marks.append(self.mark(now_phase, pg_cpu(postmaster), samples[-1], load[-1]))
                marks[-2]["commands"] = self.bmc("commands")
                phase = now_phase
            k = kills[-1] if kills else None
            if phase in plan and (k is None or k["phase"] != phase) and plan[phase][1]():
                victim = self.names[plan[phase][0]]
                k = {"phase": phase, "victim": victim, "addr": server_addr(plan[phase][0])}
                k["victim_bmcs"] = db.owners().get(victim, 0)
                self.cpu_acc[victim] = self.cpu_now(victim)
                os.kill(self.procs[victim].pid, signal.SIGKILL)
                k["killed_at"] = time.monotonic()
                self.procs[victim].wait()
                self.cpu_base[victim] = 0.0
                kills.append(k)
                log(
                    f"{phase}: kill -9 {victim} at {k['killed_at'] - t0:.1f} s "
                    f"({k['victim_bmcs']} BMCs held)"
                )
            if k is not None and "took_over_at" not in k and not db.owners().get(k["victim"]):
                k["took_over_at"] = time.monotonic()
                log(
                    f"{k['victim']}'s BMCs held by the survivors "
                    f"{k['took_over_at'] - k['killed_at']:.1f} s on"
                )
            if (
                k is not None
                and "took_over_at" in k
                and "restarted_at" not in k
                and time.monotonic() - k["took_over_at"] > args.restart_after
            ):
                self._start(ns, self.names.index(k["victim"]), url)
                k["restarted_at"] = time.monotonic()
                log(f"{k['victim']} started again")
            if time.monotonic() - t0 > args.timeout:
                raise RuntimeError(f"the run took longer than {args.timeout} s")
        t_end = time.monotonic()
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
        marks.append(self.mark("end", pg_cpu(postmaster), samples[-1], load[-1]))
        marks[-2]["commands"] = self.bmc("commands")
        for k in kills:
            while "took_over_at" not in k:
                if not db.owners().get(k["victim"]):
                    k["took_over_at"] = time.monotonic()
                elif time.monotonic() - k["killed_at"] > 120:
                    raise RuntimeError(f"{k['victim']}'s BMCs were never taken over")
                time.sleep(0.05)
        p1 = sim["phase1"]
        served = self.served(sim["acks"])
        # Phase 1's figures (the storm) run to the first mark after it.
        m0, m1 = marks[0], marks[1]
        phase1_samples = [x for x in samples if x[0] <= m1["t"]]
        res.update(
            ready_api=p1["ready"] - len(sim["stranded"]),
            fenced_episodes=self.fenced_episodes(),
            liveness=self.liveness(),
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
            metald_cpu_s={n: m1["cpu"][n] - m0["cpu"][n] for n in self.names},
            served=served,
            pg_cpu_s=m1["pg"] - m0["pg"],
            commits=m1["commits"] - m0["commits"],
            rows_written=m1["rows"] - m0["rows"],
            peak_commits_per_s=peak(phase1_samples, args.peak_window, 1),
            peak_rows_per_s=peak(phase1_samples, args.peak_window, 2),
            bmcs_held_after=db.owners(),
            recovered=sim["recovered"],
            load_avg={"start": load[0], "max": max(load), "end": load[-1]},
            store=db.store(),
            phases=self.phases(marks, sim, want),
            checks=self.checks(marks, sim, db),
            claims=sim.get("claims"),
            release=sim.get("release"),
            claims_check=sim.get("claims_check"),
            boot_errors=sim.get("boot_errors"),
            boot_error_count=sim.get("boot_error_count", 0),
        )
        log(
            f"run: {res['ready_store']} ready, load average {load[0]:.1f} -> max "
            f"{max(load):.1f} -> {load[-1]:.1f}, store {res['store']['bytes'] / 1e6:.1f} MB, "
            f"boot events {res['store']['boot_events']}"
        )
        res["kills"] = [self.takeover(k, sim["acks"], t0) for k in kills]
        if kills and kills[0]["phase"] == "enroll":
            t = res["takeover"] = res["kills"][0]
            t["ready_at_kill"] = int(args.kill_at * self.n)
            t["kill_to_all_ready_s"] = t0 + p1["wall_s"] - kills[0]["killed_at"]
        res["window_after"] = self.window()
        return res

    def served(self, acks: list[list[Any]]) -> dict[str, int]:
        """Machines per instance by the server of each machine's last DHCP answer."""
        last: dict[int, str] = {}
        for _t, ix, s, _ip in acks:
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
                    [
                        "DHCP split changes / worst event-loop lag, per instance (its log)",
                        " ".join(
                            f"{k}:{v['dhcp_split_changes']}/{v['worst_loop_lag_s']:.1f}s"
                            for k, v in sorted((r.get("liveness") or {}).items())
                        ),
                    ],
                ],
            )  # fmt: skip
        )
    for r in results:
        lifecycle_report(r)
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


def lifecycle_report(r: dict[str, Any]) -> None:
    """Per phase: time, CPU, writes per machine moved; each kill's takeover; the checks."""
    n = r["machines"]
    rows = []
    for ph in r.get("phases", []):
        m = ph["machines"]
        cpu = sum(ph["metald_cpu_s"].values())
        rows.append([
            ph["phase"], m, f"{ph['wall_s']:.1f}", f"{1000 * cpu / m:.1f}",
            f"{1000 * ph['pg_cpu_s'] / m:.1f}", f"{1000 * ph.get('sim_cpu_s', 0) / m:.1f}",
            f"{ph['commits'] / m:.1f}",
            f"{ph['rows_written'] / m:.1f}", f"{ph['load'][0]:.1f} -> {ph['load'][1]:.1f}",
        ])  # fmt: skip
    st = r.get("store") or {}
    print(
        f"\nPhases of {n} machines on {r['instances']} instances (claims of {CLAIM_SIZE}; "
        f"per machine: the machines the phase moved); store {st.get('bytes', 0) / 1e6:.1f} MB "
        f"({st.get('bytes', 0) / n / 1e3:.1f} kB a machine)"
    )
    print(
        table(
            [
                "phase",
                "machines",
                "wall s",
                "metald CPU ms/machine",
                "PostgreSQL CPU ms/machine",
                "simulation CPU ms/machine",
                "commits/machine",
                "rows written/machine",
                "load average (1 min) start -> end",
            ],
            rows,
        )  # fmt: skip
    )
    if r.get("kills"):
        print("\nkill -9 in each phase (the victim started again once its BMCs had moved):")
        print(
            table(
                [
                    "phase",
                    "victim",
                    "at s",
                    "its BMCs",
                    "BMCs held by survivors s",
                    "first / last DHCP answer by a survivor s",
                    "its clients",
                    "restarted s",
                ],
                [
                    [
                        k["phase"],
                        k["victim"],
                        f"{k['killed_after_s']:.1f}",
                        k["victim_bmcs"],
                        f"{k['bmcs_s']:.1f}",
                        f"{_s(k['first_dhcp_s'])} / {_s(k['last_dhcp_s'])}",
                        k["victim_clients"],
                        _s(k["restarted_after_s"]),
                    ]
                    for k in r["kills"]
                ],
            )  # fmt: skip
        )
    c = r.get("checks") or {}
    rows = []
    for ph in ("enroll", "claims", "release"):
        x = c.get(ph)
        if x is None:
            continue
        rows.append([
            ph, x["machines_commanded"],
            " ".join(f"{k}:{v}" for k, v in x["by_kind"].items() if v),
            x["machines_done_once"], x["machines_done_twice"], x["not_once"],
            x["bmcs_commanded_by_two_instances"], x.get("pxe_set_again_after_a_move", "-"),
        ])  # fmt: skip
    if rows:
        print("\nNothing lost or doubled: BMC commands counted at the BMCs, deploys and wipes "
              "at the machines (a machine is 'not once' unless it got exactly one power-on, "
              "at most one power-off, its one-time PXE (again only if its BMC moved mid-step), "
              "and its deploy or wipe once)")  # fmt: skip
        print(
            table(
                [
                    "phase",
                    "BMCs commanded",
                    "commands",
                    "machines done once",
                    "twice",
                    "not once",
                    "BMCs commanded by two instances (moved mid-step)",
                    "one-time PXE set again after a move",
                ],
                rows,
            )  # fmt: skip
        )
        for ph in ("claims", "release"):
            for b in (c.get(ph) or {}).get("not_once_samples", []):
                print(f"  {ph} not once: {b}")
    cc = r.get("claims_check")
    if cc:
        print(
            f"claims: {cc['claims_made']} made, {cc['claims_listed']} listed, "
            f"{cc['unfulfilled']} unfulfilled, {cc['machines_in_two_claims']} machines in two "
            f"claims, {cc['distinct_claimed']} distinct machines claimed (want {cc['want']}), "
            f"{cc['claimed_not_provisioned']} claimed but not provisioned"
        )
    le = c.get("leases")
    if le:
        print(
            f"leases: {le['addresses_acked']} addresses ACKed, "
            f"{le['addresses_acked_to_two_machines']} to two machines; store: "
            f"{le['bound_leases']} bound, {le['macs_with_two_bound_leases']} MACs with two, "
            f"{le['addresses_bound_twice']} addresses bound twice"
        )
    if r.get("boot_error_count"):
        print(f"boot errors at the machines: {r['boot_error_count']}: {r['boot_errors'][:3]}")


def flatness(paths: list[str]) -> None:
    """Side by side: the same phases at two sizes (each file: a --json result), per machine."""
    runs = [json.loads(Path(p).read_text())[-1] for p in paths]
    hdr = ["per machine moved"] + [
        f"{r['instances']} x {r['machines'] // r['instances']} = {r['machines']:,}" for r in runs
    ]
    rows: list[list[Any]] = []
    for ph in ("enroll", "claims", "release"):
        got = [next((x for x in r.get("phases", []) if x["phase"] == ph), None) for r in runs]
        if not any(got):
            continue
        for label, f in (
            ("metald CPU ms", lambda x: 1000 * sum(x["metald_cpu_s"].values()) / x["machines"]),
            ("PostgreSQL CPU ms", lambda x: 1000 * x["pg_cpu_s"] / x["machines"]),
            ("simulation CPU ms", lambda x: 1000 * x.get("sim_cpu_s", 0) / x["machines"]),
            ("commits", lambda x: x["commits"] / x["machines"]),
            ("rows written", lambda x: x["rows_written"] / x["machines"]),
            ("wall s (whole phase)", lambda x: x["wall_s"]),
        ):
            rows.append([f"{ph}: {label}"] + [("-" if g is None else f"{f(g):.1f}") for g in got])
        rows.append(
            [f"{ph}: load average start -> end"]
            + ["-" if g is None else f"{g['load'][0]:.1f} -> {g['load'][1]:.1f}" for g in got]
        )
    rows.append(
        ["store kB per machine"]
        + [f"{(r.get('store') or {}).get('bytes', 0) / r['machines'] / 1e3:.1f}" for r in runs]
    )
    print(table(hdr, rows))


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
        "--claims", type=int, default=-1,
        help=f"claims of {CLAIM_SIZE} after the storm, then all released and wiped "
        "(default: one per 10 machines; 0: enroll only)",
    )  # fmt: skip
    ap.add_argument("--phase-timeout", type=float, default=2400, help="claims / release, s")
    ap.add_argument(
        "--ipxe-secs", action="store_true",
        help="the simulated iPXE fills DHCP secs as iPXE does (its transmission count << 2); "
        "default 0, so only the fencing takeover counts",
    )  # fmt: skip
    ap.add_argument("--restart-after", type=float, default=5.0,
                    help="a killed instance starts again this long after its BMCs moved")  # fmt: skip
    ap.add_argument("--flatness", nargs=2, metavar="JSON",
                    help="print the side-by-side table of two --json results, run nothing")  # fmt: skip
    ap.add_argument(
        "--fleet-only",
        action="store_true",
        help="skip the one-instance run: only the run with --instances (and its kill)",
    )
    args = ap.parse_args()
    if args.quick:
        args.machines, args.interval, args.heartbeat, args.dead_after = 40, 2.0, 0.5, 3.0
    if args.flatness:
        flatness(args.flatness)
        return 0
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
