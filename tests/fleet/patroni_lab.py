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

    def __init__(self, nodes: int = 2, password: str = "lab") -> None:
        self.root = Path(tempfile.mkdtemp(prefix="metald-patroni-"))
        os.chmod(self.root, 0o755)
        (self.root / "pids").mkdir()
        self.password = password
        self._watchdog = subprocess.Popen(
            [sys.executable, "-c", _WATCHDOG, str(self.root)],
            stdin=subprocess.PIPE,
            start_new_session=True,  # a ^C to the caller's group must not end it first
        )
        self.etcd_ports = [(free_port(), free_port()) for _ in range(3)]
        self.etcd: list[subprocess.Popen[bytes]] = []
        self.nodes = [
            Node(f"pg{i + 1}", free_port(), free_port(), self.root / f"pg{i + 1}")
            for i in range(nodes)
        ]
        self.user = "postgres" if os.geteuid() == 0 else pwd.getpwuid(os.geteuid()).pw_name

    # -- processes --------------------------------------------------------------------------

    def _spawn(self, tag: str, argv: list[str], *, as_pg: bool = False) -> subprocess.Popen[bytes]:
        log = open(self.root / f"{tag}.log", "ab")  # noqa: SIM115 - the process owns it
        kw: dict[str, Any] = {}
        if as_pg and os.geteuid() == 0:
            kw = {"user": "postgres", "group": "postgres", "extra_groups": []}
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, cwd=self.root, start_new_session=True, **kw
        )
        (self.root / "pids" / tag).write_text(str(proc.pid))
        return proc

    def start(self) -> PatroniLab:
        cluster = ",".join(
            f"etcd{i + 1}=http://127.0.0.1:{p}" for i, (_, p) in enumerate(self.etcd_ports)
        )
        for i, (client, peer) in enumerate(self.etcd_ports):
            name = f"etcd{i + 1}"
            self.etcd.append(
                self._spawn(
                    name,
                    [
                        "etcd",
                        f"--name={name}",
                        f"--data-dir={self.root / name}",
                        f"--listen-client-urls=http://127.0.0.1:{client}",
                        f"--advertise-client-urls=http://127.0.0.1:{client}",
                        f"--listen-peer-urls=http://127.0.0.1:{peer}",
                        f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
                        f"--initial-cluster={cluster}",
                        "--initial-cluster-token=metald-lab",
                        "--initial-cluster-state=new",
                        "--heartbeat-interval=100",
                        "--election-timeout=1000",
                    ],
                )
            )
        for node in self.nodes:
            self._start_patroni(node)
        return self

    def _config(self, node: Node) -> dict[str, Any]:
        conf = yaml.safe_load((DEPLOY / "patroni.yml").read_text())
        conf["name"] = node.name
        conf["restapi"] = {
            "listen": f"127.0.0.1:{node.api_port}",
            "connect_address": f"127.0.0.1:{node.api_port}",
        }
        conf["etcd3"] = {"hosts": ",".join(f"127.0.0.1:{c}" for c, _ in self.etcd_ports)}
        boot = conf["bootstrap"]
        boot["pg_hba"] = [
            "local all all trust",
            "host replication replicator 127.0.0.1/32 trust",
            "host all all 127.0.0.1/32 trust",
        ]
        pg = conf["postgresql"]
        pg["listen"] = pg["connect_address"] = f"127.0.0.1:{node.pg_port}"
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
        node.proc = self._spawn(node.name, ["patroni", str(conf)], as_pg=True)

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

    def __enter__(self) -> PatroniLab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- state ------------------------------------------------------------------------------

    def cluster(self) -> dict[str, Any] | None:
        """Patroni's ``GET /cluster`` from the first node that answers."""
        for node in self.nodes:
            try:
                with urllib.request.urlopen(
                    f"http://127.0.0.1:{node.api_port}/cluster", timeout=1
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
        return f"host=127.0.0.1 port={node.pg_port} user=postgres dbname={database}"

    def create_database(self, name: str) -> None:
        import psycopg

        leader = self.leader()
        assert leader is not None
        with psycopg.connect(self.conninfo(leader, "postgres"), autocommit=True) as c:
            c.execute(f'CREATE DATABASE "{name}"')

    def url(self, database: str) -> str:
        """metald's ``[store] url``: every node, and only the primary accepted."""
        hosts = "&".join(f"host=127.0.0.1:{n.pg_port}" for n in self.nodes)
        return f"postgresql+psycopg://postgres@/{database}?{hosts}&target_session_attrs=read-write"

    def kill_postmaster(self, node: Node) -> int:
        """``kill -9`` the node's postmaster (Patroni lives on); its pid."""
        pid = node.postmaster_pid()
        assert pid is not None, f"{node.name} has no postmaster"
        os.kill(pid, signal.SIGKILL)
        return pid

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
