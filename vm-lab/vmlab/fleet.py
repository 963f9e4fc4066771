"""Several metald instances on one lab: a fleet on one PostgreSQL, each instance in its own
network namespace on the lab's provisioning bridge (the e2e failover test).

    lab namespace  mlab-<name>: bridge, machines' taps, BMC addresses 10.k.0.(2+i)
    mlab-<name>+pg      10.k.0.240  PostgreSQL (Debian's binaries, vmlab.pg)
    mlab-<name>+inst0   10.k.0.241  metald: DHCP/TFTP/HTTP on its veth, API on :8080
    mlab-<name>+inst1   10.k.0.242  ...

Every instance holds the same secrets key, points ``[store] url`` at the one database, has its
own ``instance`` name and ``[api] public_url`` (the others forward to it), and serves the same
``[[boot.networks]]`` (name, subnet, pool) in DHCP load-balancing mode. ``LabFleet`` is a
``LabRack`` whose metalctl calls go to one instance at a time (``use``).
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import random
import select
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from cryptography.fernet import Fernet

from metald.boot.dhcp.packet import DhcpPacket, MalformedPacket, MessageType, Opt, parse, serialize
from metald.tenants.runtime import clear_leftovers

from . import netns
from .pg import PgServer
from .qemu import NIC_ID
from .qmp import QmpClient
from .rack import BIN, LabRack

API_PORT = 8080


@dataclass
class Instance:
    name: str
    netns: str
    address: str
    interface: str
    url: str
    state_dir: Path
    log: Path
    proc: subprocess.Popen | None = None


class LabFleet(LabRack):
    def __init__(
        self,
        name: str,
        workdir: Path,
        *,
        machines: int = 2,
        uefi: int = 0,
        instances: int = 3,
        heartbeat_s: float = 2.0,
        dead_after_s: float = 10.0,
        extra_config: str = "",
    ) -> None:
        """``heartbeat_s`` / ``dead_after_s``: the fleet's ``[fleet]`` timings (defaults are
        metald's)."""
        self.count = instances
        self.heartbeat_s, self.dead_after_s = heartbeat_s, dead_after_s
        self.instances: dict[str, Instance] = {}
        self.pg: PgServer | None = None
        super().__init__(name, workdir, machines=machines, uefi=uefi, extra_config=extra_config)

    # ---- bring-up ------------------------------------------------------------------------------

    def _start_metald(self, extra_config: str) -> None:
        pg_ns = self.lab.add_namespace("pg")
        self.pg = PgServer(
            listen=pg_ns["address"], netns=pg_ns["netns"], clients=self.state["subnet"]
        )
        self.database_url = self.pg.new_database()
        key = Fernet.generate_key()  # every instance on one database holds the same key
        for j in range(self.count):
            name = f"inst{j}"
            ns = self.lab.add_namespace(name)
            inst = Instance(
                name=name,
                netns=ns["netns"],
                address=ns["address"],
                interface=ns["peer"],
                url=f"http://{ns['address']}:{API_PORT}",
                state_dir=self.workdir / name,
                log=self.workdir / f"{name}.log",
            )
            inst.state_dir.mkdir(parents=True, exist_ok=True)
            secrets_key = inst.state_dir / "secrets.key"
            secrets_key.write_bytes(key)
            secrets_key.chmod(0o600)
            self.instances[name] = inst
        first, *others = self.instances.values()
        # The first instance on the empty database writes the admin token and the key check.
        self.use(first.name)
        self._start(first, extra_config)
        for inst in others:
            self._start(inst, extra_config)
        self.wait_fleet(list(self.instances))

    def _config(self, inst: Instance, extra_config: str) -> str:
        st = self.state
        lo, hi = st["dhcp_range"]
        return (
            f'state_dir = "{inst.state_dir}"\ninstance = "{inst.name}"\n'
            f'[store]\nurl = "{self.database_url}"\n'
            f'[api]\nlisten = "{inst.address}:{API_PORT}"\npublic_url = "{inst.url}"\n'
            f"[fleet]\nheartbeat_s = {self.heartbeat_s}\ndead_after_s = {self.dead_after_s}\n"
            "[bmc]\npower_sync_interval_s = 0\nmin_interval_ms = 0\n"
            'networks = ["127.0.0.0/8", "0.0.0.0/0", "::/0"]\n'
            f'[boot]\nenabled = true\ninterfaces = ["{inst.interface}"]\n'
            f'server_address = "{inst.address}"\nassets_dir = "{self.assets}"\n'
            'router_advertisements = true\ndhcp_peers_mode = "load-balancing"\n'
            f'[[boot.networks]]\nname = "lab"\nsubnet = "{st["subnet"]}"\npool_start = "{lo}"\n'
            f'pool_end = "{hi}"\ninterface = "{inst.interface}"\nlease_seconds = 600\n'
            + extra_config
        )

    def _start(self, inst: Instance, extra_config: str) -> None:
        conf = self.workdir / f"{inst.name}.toml"
        conf.write_text(self._config(inst, extra_config))
        argv = netns.exec_argv(inst.netns, [str(BIN / "metald"), "serve", "--config", str(conf)])
        # The whole configuration is the file: metald reads METALD_* variables as settings.
        env = {k: v for k, v in os.environ.items() if not k.startswith("METALD_")}
        inst.proc = self.lab.spawn(argv, role=f"metald-{inst.name}", log=inst.log, env=env)
        deadline = time.monotonic() + 90
        while self.ctl("whoami", check=False, env={"METALD_URL": inst.url})[0] != 0:
            if inst.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{inst.name} did not start:\n{inst.log.read_text()[-3000:]}")
            time.sleep(0.3)

    def wait_fleet(self, alive: list[str], timeout: float = 60) -> None:
        """Until every instance in ``alive`` lists exactly ``alive`` as the live instances."""
        deadline = time.monotonic() + timeout
        while True:
            views = [set(self.alive_instances(n)) for n in alive]
            if all(v == set(alive) for v in views):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"the fleet did not settle on {alive}: {views}")
            time.sleep(0.3)

    # ---- use -----------------------------------------------------------------------------------

    def use(self, name: str) -> None:
        """Send the next metalctl calls to instance ``name`` (the admin token is the first
        instance's file; tokens live in the shared database, so every instance accepts it)."""
        self.url = self.instances[name].url
        self.log = self.instances[name].log
        self.state_dir = next(iter(self.instances.values())).state_dir

    def alive_instances(self, via: str) -> list[str]:
        env = {"METALD_URL": self.instances[via].url}
        rc, out = self.ctl("--json", "instances", check=False, env=env)
        if rc != 0:
            return []

        return [i["name"] for i in json.loads(out)["items"] if i["alive"]]

    def kill(self, name: str) -> float:
        """``kill -9`` one instance; returns the monotonic time it was dead."""
        proc = self.instances[name].proc
        assert proc is not None
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        return time.monotonic()

    def store_rows(self) -> str:
        """The fleet's view in the store: instances and BMC holders (for diagnostics)."""
        assert self.pg is not None
        db = self.database_url.rpartition("/")[2]
        dsn = f"host={self.pg.dir} port={self.pg.port} user=metald dbname={db}"
        with psycopg.connect(dsn) as c:
            rows = c.execute(
                "SELECT name, heartbeat_at, stopped_at, statement_timestamp() FROM instances"
            ).fetchall()
            rows += c.execute(
                "SELECT id, owner, generation, step, step_command, step_done FROM bmcs"
            ).fetchall()
        return "\n".join(str(r) for r in rows)

    def diagnostics(self) -> str:
        parts = [super().diagnostics().rpartition("--- metald\n")[0]]
        try:
            parts.append("--- store\n" + self.store_rows())
        except Exception as e:  # noqa: BLE001 - diagnostics must not hide the failure
            parts.append(f"--- store: {e}")
        for inst in self.instances.values():
            tail = inst.log.read_text()[-2000:] if inst.log.exists() else ""
            parts.append(f"--- {inst.name}\n{tail}")
        return "\n".join(parts)

    def down(self) -> None:
        # The instances first (SIGTERM: each records itself stopped), then their database.
        for inst in self.instances.values():
            if inst.proc is not None and inst.proc.poll() is None:
                inst.proc.terminate()
        for inst in self.instances.values():
            if inst.proc is not None:
                try:
                    inst.proc.wait(20)
                except subprocess.TimeoutExpired:
                    inst.proc.kill()
        try:
            if self.pg is not None:
                self.pg.stop()
        finally:
            self.lab.down(keep_logs=True)
            for inst in self.instances.values():
                clear_leftovers(inst.state_dir)

    def bmc_holders(self) -> dict[str, str | None]:
        """BMC id -> the instance holding it in the store (not the hash's choice)."""
        assert self.pg is not None
        db = self.database_url.rpartition("/")[2]
        dsn = f"host={self.pg.dir} port={self.pg.port} user=metald dbname={db}"
        with psycopg.connect(dsn) as c:
            return dict(c.execute("SELECT id, owner FROM bmcs").fetchall())

    @staticmethod
    def no_network_boot(machine: dict[str, Any]) -> None:
        """Take the NIC out of the machine's boot order (its own QMP socket, not the BMC): from
        its next reset it tries its disk only, as a server whose PXE fallback is off. A BMC's
        boot override puts it back."""

        async def clear() -> None:
            qmp = QmpClient(machine["qmp"])
            await qmp.connect()
            try:
                path = f"/machine/peripheral/{NIC_ID}"
                await qmp.execute("qom-set", {"path": path, "property": "bootindex", "value": -1})
            finally:
                await qmp.close()

        asyncio.run(clear())

    @staticmethod
    def commands(machine: dict[str, Any]) -> list[dict[str, Any]]:
        """The machine's BMC command log: every request either face received, in order."""

        path = Path(machine["bmc_commands"])
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ---- a DHCP probe on the provisioning bridge ---------------------------------------------------

CLONE_NEWNET = 0x40000000


def socket_in_namespace(ns: str, family: int, kind: int) -> socket.socket:
    """A socket that lives in network namespace ``ns`` (made there, used from here): the
    calling thread enters ``ns`` only for the ``socket()`` call."""
    libc = ctypes.CDLL(None, use_errno=True)
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    try:
        if libc.setns(target, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns {ns}")
        try:
            return socket.socket(family, kind)
        finally:
            if libc.setns(home, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns back")
    finally:
        os.close(home)
        os.close(target)


class DhcpProbe:
    """A PXE-like DHCP client on the lab bridge (from the lab's namespace): broadcasts a
    DISCOVER per MAC and collects the OFFERs, with the answering server (option 54)."""

    def __init__(self, lab_netns: str, bridge: str) -> None:
        self.sock = socket_in_namespace(lab_netns, socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, bridge.encode())
        self.sock.bind(("0.0.0.0", 68))
        self._xid = random.getrandbits(24) << 8

    def discover(
        self, macs: list[str], timeout: float = 1.0, linger: float | None = None
    ) -> dict[str, list[tuple[str, str]]]:
        """One DISCOVER per MAC (broadcast flag set, secs 0: no peer takes over by age); returns
        MAC -> [(server id, offered address)] of the OFFERs that came within ``timeout``, or,
        with ``linger``, until ``linger`` seconds after every MAC had one (a second answer to a
        client comes with the first)."""
        xids = {}
        for mac in macs:
            self._xid += 1
            xids[self._xid] = mac
            pkt = DhcpPacket(
                xid=self._xid,
                flags=0x8000,
                chaddr=bytes.fromhex(mac.replace(":", "")),
                options={Opt.MESSAGE_TYPE: bytes((MessageType.DISCOVER,)), **PXE_BIOS_OPTIONS},
            )
            self.sock.sendto(serialize(pkt), ("255.255.255.255", 67))
        got: dict[str, list[tuple[str, str]]] = {m: [] for m in macs}
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select([self.sock], [], [], left)
            if not ready:
                break
            data = self.sock.recv(4096)
            try:
                reply = parse(data)
            except MalformedPacket:
                continue
            mac = xids.get(reply.xid)
            if mac is not None and reply.message_type == MessageType.OFFER:
                got[mac].append((str(reply.server_id), str(reply.yiaddr)))
                if linger is not None and all(got.values()):
                    deadline = min(deadline, time.monotonic() + linger)
        return got

    def close(self) -> None:
        self.sock.close()


PXE_BIOS_OPTIONS = {Opt.VENDOR_CLASS: b"PXEClient:Arch:00000:UNDI:002001", Opt.CLIENT_ARCH: b"\0\0"}
