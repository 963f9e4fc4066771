"""The tenant's Slurm as a ``metald.health.scheduler.TenantScheduler``: ``scontrol``,
``squeue`` and ``sinfo`` run inside the tenant's control plane through its runner
(``SlurmControlPlane.run``), their output parsed by ``metald.tenants.slurmstate``."""

from __future__ import annotations

import subprocess
from collections.abc import Callable

from metald.health.scheduler import NodeState, NodeStatus, SchedulerError
from metald.tenants import slurmstate

#: Runs argv inside the control plane (``SlurmControlPlane.run``).
Runner = Callable[..., subprocess.CompletedProcess[str]]
#: Job states that still occupy a node.
_ON_NODE = "RUNNING,COMPLETING,SUSPENDED,STOPPED"


def _one_line(text: str, limit: int = 200) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


class SlurmScheduler:
    def __init__(self, run: Runner, *, timeout: float = 10.0) -> None:
        self._run = run
        self._timeout = timeout

    def _call(self, *argv: str) -> subprocess.CompletedProcess[str]:
        try:
            return self._run(*argv, timeout=self._timeout)
        except subprocess.TimeoutExpired:
            raise SchedulerError(f"{argv[0]} did not answer within {self._timeout:g} s") from None

    def _ok(self, *argv: str) -> str:
        r = self._call(*argv)
        if r.returncode != 0:
            why = _one_line(r.stderr or r.stdout or f"exit status {r.returncode}")
            raise SchedulerError(f"{' '.join(argv[:3])} failed: {why}")
        return r.stdout

    def drain(self, node: str, reason: str) -> None:
        self._ok("scontrol", "update", f"nodename={node}", "state=drain",
                 f"reason={_one_line(reason)}")  # fmt: skip

    def undrain(self, node: str) -> None:
        st = self.node_state(node)
        # a drained node that also stopped answering reads NOT_RESPONDING: the flag decides
        if st.state in (NodeState.DRAINED, NodeState.DRAINING) or "DRAIN" in st.raw.split("+"):
            self._ok("scontrol", "update", f"nodename={node}", "state=resume")

    def node_state(self, node: str) -> NodeStatus:
        r = self._call("scontrol", "show", "node", "-o", node)
        if r.returncode != 0 and slurmstate.NOT_FOUND.search(r.stdout + r.stderr):
            return NodeStatus(NodeState.ABSENT)
        if r.returncode != 0:
            raise SchedulerError(f"scontrol show node {node} failed: {_one_line(r.stderr)}")
        return slurmstate.node_status(slurmstate.parse_show_node(r.stdout))

    def node_states(self) -> dict[str, NodeStatus]:
        """Every node's state in one call (what the health watch reads each interval)."""
        out = {}
        for line in self._ok("scontrol", "show", "node", "-o").splitlines():
            fields = slurmstate.parse_show_node(line)
            if fields.get("NodeName"):
                out[fields["NodeName"]] = slurmstate.node_status(fields)
        return out

    def running_jobs(self, node: str) -> list[str]:
        """Ids of the jobs on ``node``; none when the scheduler has no such node."""
        r = self._call("squeue", "-h", "-w", node, "-t", _ON_NODE, "-o", "%i")
        if r.returncode != 0 and slurmstate.INVALID_NODE.search(r.stderr):
            return []
        if r.returncode != 0:
            raise SchedulerError(f"squeue -w {node} failed: {_one_line(r.stderr)}")
        return slurmstate.parse_jobs(r.stdout)

    def remove_node(self, node: str, reason: str) -> None:
        """Down first (Slurm ends the jobs still on it; deleting a node in use is refused),
        then delete."""
        if self.node_state(node).state == NodeState.ABSENT:
            return
        self._ok("scontrol", "update", f"nodename={node}", "state=down",
                 f"reason={_one_line(reason)}")  # fmt: skip
        r = self._call("scontrol", "delete", f"nodename={node}")
        if r.returncode != 0 and self.node_state(node).state != NodeState.ABSENT:
            # Slurm refuses while the jobs it ended are still completing: the caller retries
            raise SchedulerError(
                f"scontrol delete {node} failed (jobs may still be ending; try again): "
                f"{_one_line(r.stderr)}"
            )

    def drain_reasons(self) -> dict[str, str]:
        """Node -> reason, as ``sinfo -R`` lists them."""
        return slurmstate.parse_reasons(self._ok("sinfo", "-R", "-h", "-N", "-o", "%N|%E"))
