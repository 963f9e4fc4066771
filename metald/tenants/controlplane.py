"""A tenant's Slurm control plane on this host: slurmctld + munged in the hub's namespace.

The control plane is a "machine" of its own: the hub's network namespace plus private mount and
UTS namespaces (its own hostname, a tmpfs /run and /var/spool: munged's socket path and Slurm's
spool are fixed paths that would collide between tenants). It is entered with ``nsenter
--net`` and ``unshare``, not ``ip netns exec``, which remounts /sys and makes Slurm 22.05 fail
on cgroups (LAB-NOTES). slurmctld listens on the hub's overlay address (configless, dynamic
nodes: ``metald.tenants.slurm``). Everything it needs sits in one folder per tenant, with a
``control-plane.json`` naming the process so tools (tests, ``make demo``) can run ``sinfo`` or
``srun`` inside it with :func:`exec_in`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from metald.tenants import elastic, elasticspool, slurm
from netconfig import netns

#: Runs as the control plane's PID-holder: hostname, private /run and /var/spool, munged, then
#: the given daemon; TERM stops both.
MACHINE = """set -e
hostname "$HOST"
mount -t tmpfs -o mode=0755 tmpfs /run
mount -t tmpfs -o mode=0755 tmpfs /var/spool
mkdir -p /run/munge /run/slurm /var/spool/slurmd /var/spool/slurmctld /var/spool/log
munged -F --force --key-file="$DIR/munge.key" --log-file="$DIR/munged.log" \\
  --seed-file="$DIR/munged.seed" --origin=127.0.0.1 &
MUNGED=$!
for i in $(seq 100); do [ -S /run/munge/munge.socket.2 ] && break; sleep 0.05; done
"$@" &
MAIN=$!
trap 'kill $MAIN $MUNGED 2>/dev/null || true; wait' TERM INT
wait $MAIN || true
kill $MUNGED 2>/dev/null || true
wait
"""

INFO = "control-plane.json"
#: sinfo's compact states in which a node is up and registered (a trailing * means it stopped
#: answering).
UP_STATES = {"idle", "alloc", "mix", "comp", "resv", "plnd"}


class ControlPlaneError(Exception):
    pass


def host_name(tenant_name: str) -> str:
    return ("ctl-" + re.sub(r"[^a-z0-9-]+", "-", tenant_name.lower())).strip("-")[:63]


def start_machine(
    ns: str, host: str, workdir: Path, munge_key: bytes, *argv: str, log_name: str = "out.log"
) -> subprocess.Popen[bytes]:
    """Start ``argv`` as a simulated machine in namespace ``ns`` (see MACHINE); the munge key
    is written 0400 into ``workdir`` first."""
    workdir.mkdir(mode=0o700, parents=True, exist_ok=True)
    key = workdir / "munge.key"
    key.unlink(missing_ok=True)
    fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
    with os.fdopen(fd, "wb") as f:
        f.write(munge_key)
    env = dict(os.environ, HOST=host, DIR=str(workdir))
    with open(workdir / log_name, "ab") as out:
        return subprocess.Popen(
            netns.exec_argv(ns, ["unshare", "--mount", "--uts", "--propagation", "private",
                                 "bash", "-c", MACHINE, "machine", *argv]),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: stopped as one
        )  # fmt: skip


def stop_process(p: subprocess.Popen[bytes] | None, *, wait: float = 10.0) -> None:
    if p is None or p.poll() is not None:
        return
    p.terminate()
    try:
        p.wait(wait)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def exec_argv(pid: int, argv: list[str]) -> list[str]:
    """The command that runs ``argv`` inside the control plane whose PID-holder is ``pid``."""
    return netns.pid_exec_argv(pid, argv)


@dataclass
class SlurmControlPlane:
    tenant_id: str
    tenant_name: str
    ns: str
    workdir: Path
    hub_address: str
    munge_key: bytes
    max_nodes: int = 1024
    proc: subprocess.Popen[bytes] | None = None
    #: The tenant's elastic pools: CLOUD nodes whose Resume/SuspendProgram write into the
    #: spool (``metald.tenants.elasticspool``).
    pools: list[elastic.ElasticPool] = field(default_factory=list)
    #: topology.conf (``slurm.render_topology_tree``), used when ``topology_plugin`` is set:
    #: then always written, so a later change is a ``scontrol reconfigure`` and not a restart
    #: (the plugin cannot change while running).
    topology: str = ""
    #: ``topology/tree`` to have slurmctld read it. Off by default: Slurm 22.05 cannot put
    #: dynamic nodes (``slurmd -Z``) in topology.conf's switches and then refuses every job on
    #: them ("Requested node configuration is not available"); nodes carry their place as
    #: features instead (``slurm.topology_features``). docs/claims.md.
    topology_plugin: str | None = None

    @property
    def conf(self) -> Path:
        return self.workdir / "slurm.conf"

    def render(self) -> str:
        extra: list[str] = (
            [f"TopologyPlugin={self.topology_plugin}"] if self.topology_plugin else []
        )
        params: list[str] = []
        if self.pools:
            extra += elastic.slurm_conf_lines(self.pools, elasticspool.install(self.workdir))
            params = list(elastic.CLOUD_PARAMETERS)
        return slurm.render_slurm_conf(
            slurm.ControlPlane(
                cluster_name=re.sub(r"[^a-z0-9]", "", self.tenant_name.lower())[:40] or "t",
                host_name=host_name(self.tenant_name),
                address=self.hub_address,
                # On disk, not the private tmpfs: a restarted control plane (metald
                # restarted) keeps its dynamic nodes and jobs.
                state_dir=str(self.workdir / "state"),
                spool_dir="/var/spool/slurmd",
                run_dir="/run/slurm",
                log_dir="/var/spool/log",
                max_nodes=self.max_nodes,
                extra=extra,
                slurmctld_parameters=params,
            )
        )

    def write_conf(self) -> bool:
        """Write slurm.conf; True if it changed."""
        text = self.render()
        try:
            if self.conf.read_text() == text:
                return False
        except OSError:
            pass
        tmp = self.workdir / ".slurm.conf.tmp"
        tmp.write_text(text)
        tmp.replace(self.conf)
        return True

    def set_pools(self, pools: list[elastic.ElasticPool]) -> bool:
        """The pools changed (API): rewrite slurm.conf and ``scontrol reconfigure`` a running
        control plane. Node definitions are read at start only in 22.05 for some changes, so
        a changed node list restarts slurmctld (its state is on disk: jobs survive)."""
        self.pools = list(pools)
        if not self.write_conf() or not self.alive():
            return False
        self.stop()
        self.start()
        return True

    def elastic_requests(self) -> list[Path]:
        return elasticspool.pending(self.workdir)

    def keep_min(self) -> list[str]:
        """Power up the pools' first ``min`` nodes that are powered down (``idle~``): slurmctld
        runs ResumeProgram for them like for a job. The names asked for."""
        nodes = self.nodes() or {}
        want = [n for p in self.pools for n in p.kept() if nodes.get(n, "").rstrip("*") == "idle~"]
        if want:
            self.run("scontrol", "update", f"nodename={','.join(want)}", "state=power_up")
        return want

    def set_down(self, names: list[str], reason: str) -> bool:
        """Mark pool nodes down with a reason (``sinfo -R`` shows it); the job stays queued."""
        if not names:
            return True
        r = self.run(
            "scontrol", "update", f"nodename={','.join(names)}", "state=down",
            f"reason={reason}", timeout=10,
        )  # fmt: skip
        return r.returncode == 0

    def node_states(self) -> dict[str, elastic.NodeState] | None:
        """Node name -> compact state (``down#``, ``idle~``) and reason; None if slurmctld
        cannot be asked."""
        if not self.alive():
            return None
        try:
            r = self.run("sinfo", "-h", "-N", "-o", "%N|%T|%E", timeout=10)
        except subprocess.TimeoutExpired:
            return None
        if r.returncode != 0:
            return None
        out = {}
        for line in r.stdout.splitlines():
            parts = line.split("|", 2)
            if len(parts) == 3:
                reason = "" if parts[2] == "none" else parts[2]
                out[parts[0]] = elastic.NodeState(state=parts[1], reason=reason)
        return out

    def return_to_service(self, names: list[str]) -> bool:
        """Clear pool nodes metald set down (``state=resume``): one slurmctld still powers up
        waits for its machine to register (``idle#``), one it gave up on is powered down and
        available again (``idle~``: resumed through ResumeProgram for the queued job)."""
        if not names:
            return True
        r = self.run(
            "scontrol", "update", f"nodename={','.join(names)}", "state=resume", timeout=10
        )
        return r.returncode == 0

    @property
    def topology_conf(self) -> Path:
        # configless: slurmctld hands topology.conf (beside slurm.conf) to every slurmd
        return self.workdir / "topology.conf"

    def _write_topology(self) -> None:
        # topology/tree refuses a switch with neither nodes nor switches (fatal), but only
        # warns of node names it does not know: a placeholder until the first nodes come.
        self.topology_conf.write_text(self.topology or "SwitchName=root Nodes=metald-none\n")

    def set_topology(self, text: str) -> bool:
        """Write a new topology.conf and have slurmctld read it again; False when unchanged,
        not running, or no topology plugin is on."""
        if text == self.topology:
            return False
        self.topology = text
        if not self.topology_plugin:
            return False
        self._write_topology()
        if not self.alive():
            return False
        r = self.run("scontrol", "reconfigure", timeout=30)
        if r.returncode != 0:
            raise ControlPlaneError(f"scontrol reconfigure failed: {r.stderr.strip()}")
        return True

    def start(self) -> None:
        kill_stale(self.workdir)
        host = host_name(self.tenant_name)
        self.workdir.mkdir(mode=0o700, parents=True, exist_ok=True)
        (self.workdir / "state").mkdir(mode=0o700, exist_ok=True)
        self.write_conf()
        if self.topology_plugin:
            self._write_topology()
        self.proc = start_machine(
            self.ns, host, self.workdir, self.munge_key, "slurmctld", "-D", "-f", str(self.conf)
        )
        (self.workdir / INFO).write_text(
            json.dumps({"pid": self.proc.pid, "slurm_conf": str(self.conf), "ns": self.ns})
        )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def run(self, *argv: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        if self.proc is None:
            raise ControlPlaneError(f"the control plane of {self.tenant_name} is not running")
        return subprocess.run(
            exec_argv(self.proc.pid, list(argv)),
            capture_output=True,
            text=True,
            timeout=timeout,
            env=dict(os.environ, SLURM_CONF=str(self.conf)),
        )

    def nodes(self) -> dict[str, str] | None:
        """Node name -> compact state as slurmctld reports it; None if it cannot be asked."""
        if not self.alive():
            return None
        try:
            r = self.run("sinfo", "-h", "-N", "-o", "%N %t", timeout=10)
        except subprocess.TimeoutExpired:
            return None
        if r.returncode != 0:
            return None
        out = {}
        for line in r.stdout.splitlines():
            parts = line.split()
            if len(parts) == 2:
                out[parts[0]] = parts[1]
        return out

    def delete_node(self, name: str) -> bool:
        """Remove a dynamic node (released machine) from the cluster."""
        r = self.run("scontrol", "delete", f"nodename={name}", timeout=10)
        return r.returncode == 0

    def stop(self) -> None:
        stop_process(self.proc)
        self.proc = None
        (self.workdir / INFO).unlink(missing_ok=True)


def kill_stale(workdir: Path) -> None:
    """A control plane left by a metald that was killed: stop its process group."""
    info = workdir / INFO
    try:
        pid = int(json.loads(info.read_text())["pid"])
    except (OSError, ValueError, KeyError):
        return
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        cmdline = b""
    if b"slurmctld" in cmdline:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGTERM)
        for _ in range(100):
            if not Path(f"/proc/{pid}").exists():
                break
            time.sleep(0.05)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
    info.unlink(missing_ok=True)


def exec_in(
    state_dir: str | Path, tenant_id: str, argv: list[str], **kw
) -> subprocess.CompletedProcess[str]:  # type: ignore[no-untyped-def]
    """Run ``argv`` (sinfo, srun, scontrol ...) inside a running tenant control plane."""
    info = json.loads((Path(state_dir) / "tenants" / tenant_id / "slurm" / INFO).read_text())
    return subprocess.run(
        exec_argv(int(info["pid"]), argv),
        capture_output=True,
        text=True,
        env=dict(os.environ, SLURM_CONF=info["slurm_conf"]),
        **kw,
    )


def up_nodes(nodes: dict[str, str] | None) -> set[str]:
    return {n for n, st in (nodes or {}).items() if st in UP_STATES}
