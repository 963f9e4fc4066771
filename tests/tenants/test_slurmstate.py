"""Slurm's node and job output, parsed: real captures from a real slurmctld
(tests/tenants/fixtures/slurm/SOURCES.md)."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest

from metald.health.scheduler import NodeState, state_signal
from metald.health.signals import OK, Witness
from metald.tenants import slurmstate

HERE = Path(__file__).resolve().parent / "fixtures" / "slurm"
AT = datetime(2026, 12, 6, 4, 0, tzinfo=UTC)
XID = "metald: XID 79 on GPU 0000:3b:00 (GPU has fallen off the bus.) pid=12"


def status(name: str):  # type: ignore[no-untyped-def]
    fields = slurmstate.parse_show_node((HERE / f"scontrol-show-node-o_{name}.txt").read_text())
    return fields, slurmstate.node_status(fields)


@pytest.mark.parametrize(
    ("name", "state", "reason"),
    [
        ("idle", NodeState.IDLE, None),
        ("allocated", NodeState.ALLOCATED, None),
        ("mixed-drain", NodeState.DRAINING, XID),
        ("idle-drain", NodeState.DRAINED, XID),
        ("not-responding", NodeState.NOT_RESPONDING, None),
        ("down", NodeState.NOT_RESPONDING, "metald: node silent for 61 s"),
    ],
)
def test_node_states(name: str, state: NodeState, reason: str | None) -> None:
    fields, st = status(name)
    assert (st.state, st.reason) == (state, reason)
    assert fields["NodeName"] == "gpu-a1" and fields["NodeAddr"] == "10.99.0.2"
    assert fields["OS"] == "Linux" and fields["Partitions"] == "main"


def test_a_reason_that_looks_like_fields_stays_whole() -> None:
    fields, _ = status("mixed-drain")
    assert fields["Reason"].startswith(XID + " [root@")
    assert "pid" not in fields


def test_down_without_not_responding() -> None:
    st = slurmstate.node_status({"State": "DOWN+DYNAMIC_NORM", "Reason": "x [root@t]"})
    assert (st.state, st.reason) == (NodeState.DOWN, "x")
    assert slurmstate.node_status({"State": "FUTURE"}).state == NodeState.UNKNOWN
    assert slurmstate.node_status({"State": "COMPLETING"}).state == NodeState.ALLOCATED


def test_jobs_reasons_and_not_found() -> None:
    assert slurmstate.parse_jobs((HERE / "squeue-h-o-i_running.txt").read_text()) == ["1"]
    assert slurmstate.parse_reasons((HERE / "sinfo-R-h-N-o_reasons.txt").read_text()) == {
        "gpu-a1": XID
    }
    assert "metald: XID 79 on GP" in (HERE / "sinfo-R.txt").read_text()
    assert slurmstate.NOT_FOUND.search((HERE / "scontrol-show-node-o_not-found.txt").read_text())


def test_the_schedulers_word_as_a_signal() -> None:
    _, down = status("not-responding")
    s = state_signal("gpu-a1", down, AT)
    assert s is not None and (s.witness, s.code) == (Witness.SCHEDULER, "not-responding")
    assert "IDLE+DYNAMIC_NORM+NOT_RESPONDING" in s.evidence
    _, idle = status("idle")
    fine = state_signal("gpu-a1", idle, AT)
    assert fine is not None and fine.code == OK
    _, drained = status("idle-drain")
    assert state_signal("gpu-a1", drained, AT) is None  # remediation's own drain says nothing
