"""A PostgreSQL that fails over, for tests and ``bench/pg_failover.py``: three etcd members and
two Patroni-managed PostgreSQL nodes (a primary and a synchronous standby) on loopback ports,
from the configuration shipped in ``deploy/patroni/`` (addresses, ports and directories
replaced; nothing else).

Real parts: Debian's ``etcd`` (3.4) and ``patroni`` (3.0) and PostgreSQL's binaries. Every
directory is under one private temporary folder. Cleanup survives the caller being killed: a
watchdog process (started first, as the caller's child) holds a pipe from the caller; when the
pipe closes (``stop()``, a normal exit, an exception, or ``kill -9`` of the caller) it kills
every etcd, every Patroni and every postmaster (read from each ``postmaster.pid`` at that
moment, so one Patroni restarted is killed too) and removes the folder.

``PatroniLab(netns=True)``: every database host in a network namespace of its own on one bridge
(tests/fleet/netcut.py's ``DbNet``): host 1 runs etcd1 and pg1, host 2 etcd2 and pg2, host 3
etcd3 alone (a witness; the layout that shows Patroni 3.0's split brain at a heal:
docs/fleet.md), each on its own address with the
shipped ports (2379/2380, 5432, 8008); ``etcd_apart=True`` puts the three etcd members on three
hosts of their own instead, as ``deploy/patroni/`` ships them (a cut database host then
takes no etcd member with it). The test process reaches them over a veth; a host can
be cut off with nftables (``cut``/``heal``) instead of killed. The watchdog deletes the
namespaces too.

``dcs``: settings laid over the shipped ``bootstrap.dcs`` (say ``{"failsafe_mode": true}``, to
show what a setting the shipped file leaves out does to a partition).
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from netconfig import netns as nsutil
from tests.fleet.netcut import DbNet, cut, heal
from vmlab.labnet import free_port
from vmlab.pg import pg_bindir

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "patroni"
SCOPE = "metald"

_WATCHDOG = r"""
import os, shutil, signal, sys, time
root = sys.argv[1]
sys.stdin.buffer.read()  # returns when the caller's end closes, however the caller ended
def kill(pid):
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
pids = os.path.join(root, "pids")
for _ in range(3):  # a Patroni killed last may have started a postmaster meanwhile
    for name in os.listdir(pids) if os.path.isdir(pids) else []:
        kill(int(open(os.path.join(pids, name)).read()))
    for node in os.listdir(root):
        pid_file = os.path.join(root, node, "data", "postmaster.pid")
        try:
            kill(int(open(pid_file).readline()))
        except (OSError, ValueError):
            pass
    time.sleep(0.3)
try:  # the namespaces, once what ran in them is dead (nsenter execs: same pids)
    names = open(os.path.join(root, "netns")).read().split()
except OSError:
    names = []
import subprocess
for name in reversed(names):
    subprocess.run(["ip", "netns", "delete", name], capture_output=True)
shutil.rmtree(root, ignore_errors=True)
"""


def available() -> str | None:
    """Why the lab cannot run here, or None."""
    for exe in ("etcd", "patroni"):
        if shutil.which(exe) is None:
            return (
                f"{exe} not installed (Debian packages etcd-server and patroni: scripts/bootstrap)"
            )
    if pg_bindir() is None:
        return "PostgreSQL binaries not found"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "no postgres user"
    return None


@dataclass
class Node:
    name: str
    pg_port: int
    api_port: int
    dir: Path
    proc: subprocess.Popen[bytes] | None = None
    host: str = "127.0.0.1"  # its address (netns: its host's on the bridge)
    ns: str | None = None  # its host's network namespace (netns mode)

    @property
    def data(self) -> Path:
        return self.dir / "data"

    def postmaster_pid(self) -> int | None:
        try:
            return int((self.data / "postmaster.pid").read_text().split("\n", 1)[0])
        except (OSError, ValueError):
            return None


class PatroniLab:
    """``start()`` then ``wait_ready()``; ``stop()`` (or the watchdog) cleans everything."""

    def __init__(
        self,
        nodes: int = 2,
        password: str = "lab",
        netns: bool = False,
        etcd_apart: bool = False,
        dcs: dict[str, Any] | None = None,
    ) -> None:
        self.dcs = dict(dcs or {})
        self.root = Path(tempfile.mkdtemp(prefix="metald-patroni-"))
        os.chmod(self.root, 0o755)
        (self.root / "pids").mkdir()
        self.password = password
        self._watchdog = subprocess.Popen(
            [sys.executable, "-c", _WATCHDOG, str(self.root)],
            stdin=subprocess.PIPE,
            start_new_session=True,  # a ^C to the caller's group must not end it first
        )
        self.net: DbNet | None = None
        self.cut_nodes: set[str] = set()
        self.etcd: list[subprocess.Popen[bytes]] = []
        if netns:
            self.net = DbNet(record=self.root / "netns")
            if etcd_apart:  # etcd on three hosts of its own (.21-.23), PostgreSQL on .11, .12
                hosts = [self.net.add(f"h{i + 1}", 11 + i) for i in range(nodes)]
                etcd = [self.net.add(f"e{i + 1}", 21 + i) for i in range(3)]
            else:  # as deploy/patroni/: etcd1 beside pg1, etcd2 beside pg2, etcd3 alone
                hosts = [self.net.add(f"h{i + 1}", 11 + i) for i in range(max(3, nodes))]
                etcd = hosts[:3]
            self.etcd_hosts = [(ns, str(ip)) for ns, ip in etcd]
            self.etcd_ports = [(2379, 2380)] * 3
            self.nodes = [
                Node(f"pg{i + 1}", 5432, 8008, self.root / f"pg{i + 1}", None, str(ip), ns)
                for i, (ns, ip) in enumerate(hosts[:nodes])
            ]
        else:
            self.etcd_hosts = [(None, "127.0.0.1")] * 3  # type: ignore[list-item]
            self.etcd_ports = [(free_port(), free_port()) for _ in range(3)]
            self.nodes = [
                Node(f"pg{i + 1}", free_port(), free_port(), self.root / f"pg{i + 1}")
                for i in range(nodes)
            ]
        self.user = "postgres" if os.geteuid() == 0 else pwd.getpwuid(os.geteuid()).pw_name

    # -- processes --------------------------------------------------------------------------

    def _spawn(
        self, tag: str, argv: list[str], *, as_pg: bool = False, ns: str | None = None
    ) -> subprocess.Popen[bytes]:
        log = open(self.root / f"{tag}.log", "ab")  # noqa: SIM115 - the process owns it
        kw: dict[str, Any] = {}
        if ns is not None:  # nsenter, then setpriv: each execs, so the pid is the daemon's
            if as_pg:
                argv = ["setpriv", "--reuid=postgres", "--regid=postgres", "--clear-groups", *argv]
            argv = nsutil.exec_argv(ns, argv)
        elif as_pg and os.geteuid() == 0:
            kw = {"user": "postgres", "group": "postgres", "extra_groups": []}
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, cwd=self.root, start_new_session=True, **kw
        )
        (self.root / "pids" / tag).write_text(str(proc.pid))
        return proc

    def track(self, tag: str, pid: int) -> None:
        """Have the watchdog kill ``pid`` too (a process the caller started in the lab)."""
        (self.root / "pids" / tag).write_text(str(pid))

    def start(self) -> PatroniLab:
        cluster = ",".join(
            f"etcd{i + 1}=http://{self.etcd_hosts[i][1]}:{p}"
            for i, (_, p) in enumerate(self.etcd_ports)
        )
        for i, (client, peer) in enumerate(self.etcd_ports):
            name = f"etcd{i + 1}"
            ns, ip = self.etcd_hosts[i]
            self.etcd.append(
                self._spawn(
                    name,
                    [
                        "etcd",
                        f"--name={name}",
                        f"--data-dir={self.root / name}",
                        f"--listen-client-urls=http://{ip}:{client}",
                        f"--advertise-client-urls=http://{ip}:{client}",
                        f"--listen-peer-urls=http://{ip}:{peer}",
                        f"--initial-advertise-peer-urls=http://{ip}:{peer}",
                        f"--initial-cluster={cluster}",
                        "--initial-cluster-token=metald-lab",
                        "--initial-cluster-state=new",
                        "--heartbeat-interval=100",
                        "--election-timeout=1000",
                    ],
                    ns=ns,
                )
            )
        for node in self.nodes:
            self._start_patroni(node)
        return self

    def _config(self, node: Node) -> dict[str, Any]:
        conf = yaml.safe_load((DEPLOY / "patroni.yml").read_text())
        conf["name"] = node.name
        conf["restapi"] = {
            "listen": f"{node.host}:{node.api_port}",
            "connect_address": f"{node.host}:{node.api_port}",
        }
        conf["etcd3"] = {
            "hosts": ",".join(
                f"{ip}:{c}"
                for (_, ip), (c, _) in zip(self.etcd_hosts, self.etcd_ports, strict=True)
            )
        }
        boot = conf["bootstrap"]
        boot["dcs"].update(self.dcs)
        subnet = "127.0.0.1/32" if self.net is None else str(self.net.net)
        boot["pg_hba"] = [
            "local all all trust",
            f"host replication replicator {subnet} trust",
            f"host all all {subnet} trust",
        ]
        pg = conf["postgresql"]
        pg["listen"] = pg["connect_address"] = f"{node.host}:{node.pg_port}"
        pg["data_dir"] = str(node.data)
        pg["bin_dir"] = str(pg_bindir())
        pg["pgpass"] = str(node.dir / "pgpass")
        for role in pg["authentication"].values():
            role["password"] = self.password
        pg["parameters"] = {
            "unix_socket_directories": str(node.dir),
            # The other lab PostgreSQLs' setting (vmlab.pg): this box is not the point.
            "fsync": "off",
        }
        return conf

    def _start_patroni(self, node: Node) -> None:
        node.dir.mkdir(exist_ok=True)
        conf = node.dir / "patroni.yml"
        conf.write_text(yaml.safe_dump(self._config(node)))
        if os.geteuid() == 0:
            pw = pwd.getpwnam("postgres")
            os.chown(node.dir, pw.pw_uid, pw.pw_gid)
            os.chown(conf, pw.pw_uid, pw.pw_gid)
        node.proc = self._spawn(node.name, ["patroni", str(conf)], as_pg=True, ns=node.ns)

    def stop(self) -> None:
        """Kill everything and remove the folder (the watchdog does it; this waits for it)."""
        if self._watchdog.stdin is not None and not self._watchdog.stdin.closed:
            self._watchdog.stdin.close()
        try:
            self._watchdog.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._watchdog.kill()
        for p in [*self.etcd, *(n.proc for n in self.nodes if n.proc)]:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=5)
        if self.net is not None:  # the watchdog deleted them; this is for a watchdog killed
            self.net.close()

    def __enter__(self) -> PatroniLab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- state ------------------------------------------------------------------------------

    def cluster(self) -> dict[str, Any] | None:
        """Patroni's ``GET /cluster`` from the first node that answers (a cut one last)."""
        for node in sorted(self.nodes, key=lambda n: n.name in self.cut_nodes):
            try:
                with urllib.request.urlopen(
                    f"http://{node.host}:{node.api_port}/cluster", timeout=1
                ) as r:
                    return json.loads(r.read())
            except OSError:
                continue
        return None

    def roles(self) -> dict[str, str]:
        """Member name -> role (``leader``, ``sync_standby``, ``replica``), running ones only."""
        c = self.cluster() or {}
        return {
            m["name"]: m["role"]
            for m in c.get("members", [])
            if m.get("state") in ("running", "streaming")
        }

    def leader(self) -> Node | None:
        for name, role in self.roles().items():
            if role == "leader":
                return self.node(name)
        return None

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    def wait_ready(self, timeout: float = 120) -> Node:
        """Wait for a leader that accepts writes and a synchronous standby; the leader."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            roles = self.roles()
            leader = self.leader()
            if leader is not None and "sync_standby" in roles.values() and self._writable(leader):
                return leader
            for n in self.nodes:
                if n.proc is not None and n.proc.poll() is not None:
                    raise RuntimeError(f"patroni {n.name} exited: {self.log(n.name)[-3000:]}")
            time.sleep(0.2)
        raise TimeoutError(f"no leader with a sync standby in {timeout} s: {self.cluster()}")

    def _writable(self, node: Node) -> bool:
        import psycopg

        try:
            with psycopg.connect(self.conninfo(node, "postgres"), connect_timeout=2) as c:
                return not c.execute("SELECT pg_is_in_recovery()").fetchone()[0]  # type: ignore[index]
        except psycopg.Error:
            return False

    def conninfo(self, node: Node, database: str) -> str:
        return f"host={node.host} port={node.pg_port} user=postgres dbname={database}"

    def local_conninfo(self, node: Node, database: str) -> str:
        """Over the node's Unix socket: reaches it from here even while its host is cut."""
        return f"host={node.dir} port={node.pg_port} user=postgres dbname={database}"

    def create_database(self, name: str) -> None:
        import psycopg

        leader = self.leader()
        assert leader is not None
        with psycopg.connect(self.conninfo(leader, "postgres"), autocommit=True) as c:
            c.execute(f'CREATE DATABASE "{name}"')

    def url(self, database: str) -> str:
        """metald's ``[store] url``: every node, and only the primary accepted."""
        hosts = "&".join(f"host={n.host}:{n.pg_port}" for n in self.nodes)
        return f"postgresql+psycopg://postgres@/{database}?{hosts}&target_session_attrs=read-write"

    def kill_postmaster(self, node: Node) -> int:
        """``kill -9`` the node's postmaster (Patroni lives on); its pid."""
        pid = node.postmaster_pid()
        assert pid is not None, f"{node.name} has no postmaster"
        os.kill(pid, signal.SIGKILL)
        return pid

    def cut(self, node: Node, allow: list[str] | None = None) -> None:
        """Cut the node's host off the network (nftables drops all but loopback and
        ``allow``): its processes live on, unreachable."""
        assert node.ns is not None, "cut needs PatroniLab(netns=True)"
        cut(node.ns, allow or ())
        self.cut_nodes.add(node.name)

    def heal(self, node: Node) -> None:
        assert node.ns is not None
        heal(node.ns)
        self.cut_nodes.discard(node.name)

    def log(self, tag: str) -> str:
        try:
            return (self.root / f"{tag}.log").read_text(errors="replace")
        except OSError:
            return ""


if __name__ == "__main__":  # a manual check: start, report, stop
    why = available()
    if why:
        sys.exit(why)
    with PatroniLab() as lab:
        t0 = time.monotonic()
        lab.start()
        leader = lab.wait_ready()
        print(f"ready in {time.monotonic() - t0:.1f} s: leader {leader.name}, {lab.roles()}")
        print(lab.url("postgres"))
