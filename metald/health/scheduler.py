"""The tenant's scheduler, as remediation sees it: one small interface (Slurm now:
``metald.tenants.scheduler``; Kubernetes cordon/drain can sit on the same one), and what its
node states say as a health signal (witness: the scheduler)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Protocol

from metald.health.signals import OK, Kind, Signal, Witness


class NodeState(StrEnum):
    ABSENT = "absent"  # the scheduler has no such node
    NOT_RESPONDING = "not-responding"
    DOWN = "down"
    DRAINING = "draining"  # drained, jobs still running
    DRAINED = "drained"  # drained, no job left
    ALLOCATED = "allocated"  # running jobs (all or part of the node)
    IDLE = "idle"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class NodeStatus:
    state: NodeState
    #: The reason the scheduler holds (a drain's or a down's).
    reason: str | None = None
    #: The scheduler's own words (``MIXED+DRAIN+DYNAMIC_NORM``).
    raw: str = ""


class SchedulerError(Exception):
    """The scheduler refused or could not be asked; the message says which and why."""


class TenantScheduler(Protocol):
    def drain(self, node: str, reason: str) -> None:
        """No new job lands on ``node``; running jobs go on. Idempotent."""

    def undrain(self, node: str) -> None:
        """``node`` takes jobs again. Idempotent."""

    def node_state(self, node: str) -> NodeStatus: ...

    def running_jobs(self, node: str) -> list[str]:
        """Ids of the jobs running (or completing) on ``node``."""

    def remove_node(self, node: str, reason: str) -> None:
        """Out of the cluster now: jobs still on it are ended. Idempotent (absent is done)."""


#: Node states the scheduler reports as a fault, and those it reports as fine (a clear).
_FAULTS = {NodeState.DOWN: "down", NodeState.NOT_RESPONDING: "not-responding"}
_FINE = frozenset({NodeState.IDLE, NodeState.ALLOCATED})


def state_signal(node: str, status: NodeStatus, at: datetime) -> Signal | None:
    """The scheduler's word on a node: DOWN / NOT_RESPONDING are a finding, IDLE / ALLOCATED
    a clear, anything else (drained by remediation itself, absent, unknown) says nothing."""
    evidence = f"scheduler: node {node} {status.raw or status.state}"
    if status.reason:
        evidence += f" (reason: {status.reason})"
    if status.state in _FAULTS:
        return Signal(Kind.SCHEDULER_STATE, Witness.SCHEDULER, "node", _FAULTS[status.state],
                      at, evidence)  # fmt: skip
    if status.state in _FINE:
        return Signal(Kind.SCHEDULER_STATE, Witness.SCHEDULER, "node", OK, at, evidence)
    return None
