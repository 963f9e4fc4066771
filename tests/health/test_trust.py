"""The trust rule: a node's word can make a machine look worse, never better."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from hypothesis import given, settings
from hypothesis import strategies as st

from metald.health.classify import DEFAULT_TABLE, Severity
from metald.health.signals import OK, Kind, Signal, Witness
from metald.health.trust import Health, expire, fold, fold_one, repaired

T0 = datetime(2026, 12, 6, 4, 0, tzinfo=UTC)
#: Codes per kind that the table classifies across all severities, and the clear.
CODES = {
    Kind.XID: ["79", "92", "13"],
    Kind.GPU_ECC: ["uncorrectable-volatile", "correctable-rate"],
    Kind.NVLINK: ["inactive"],
    Kind.SENSOR: ["power:critical", "fan:critical", "temperature:warning"],
    Kind.SEL: ["critical: Memory Uncorrectable ECC", "critical: Chassis intrusion"],
    Kind.SILENCE: ["heartbeat"],
    Kind.SCHEDULER_STATE: ["down", "not-responding"],
    Kind.TIMEOUT: ["read"],
}


@st.composite
def signals(draw: st.DrawFn, witnesses: list[Witness]) -> Signal:
    kind = draw(st.sampled_from(sorted(CODES)))
    code = draw(st.sampled_from([*CODES[kind], OK]))
    return Signal(
        kind,
        draw(st.sampled_from(witnesses)),
        draw(st.sampled_from(["node", "0000:3b:00", "PSU1"])),
        code,
        T0 + timedelta(seconds=draw(st.integers(0, 3600))),
        f"{kind} {code}",
        float(draw(st.integers(0, 5000))),
    )


def health_of(sigs: list[Signal]) -> Health:
    return fold(Health(), (DEFAULT_TABLE.classify(s) for s in sigs))


ALL = list(Witness)


@settings(max_examples=300, deadline=None)
@given(
    before=st.lists(signals(ALL), max_size=12),
    node=st.lists(signals([Witness.NODE]), max_size=12),
)
def test_node_signals_never_make_a_machine_look_better(
    before: list[Signal], node: list[Signal]
) -> None:
    h = health_of(before)
    after = fold(h, (DEFAULT_TABLE.classify(s) for s in node))
    assert after.severity.rank >= h.severity.rank
    for key, fault in h.faults.items():
        assert key in after.faults, "a node signal removed a fault"
        if fault.witness != Witness.NODE:
            assert after.faults[key] == fault, "a node signal changed another witness's fault"
        assert after.faults[key].severity.rank >= fault.severity.rank


@settings(max_examples=200, deadline=None)
@given(before=st.lists(signals(ALL), max_size=12), more=st.lists(signals(ALL), max_size=12))
def test_fatal_faults_are_never_cleared_by_a_signal(
    before: list[Signal], more: list[Signal]
) -> None:
    h = health_of(before)
    after = fold(h, (DEFAULT_TABLE.classify(s) for s in more))
    for key, fault in h.faults.items():
        if fault.severity == Severity.FATAL:
            assert key in after.faults


def bmc(code: str, kind: Kind = Kind.SEL, subject: str = "bmc") -> Signal:
    return Signal(kind, Witness.BMC, subject, code, T0, f"#1 {code}")


def test_a_healthy_node_report_does_not_clear_a_bmc_fault() -> None:
    h = health_of([bmc("critical: Memory #0x01 Uncorrectable ECC | Asserted")])
    assert h.severity == Severity.FATAL
    healthy = [Signal(k, Witness.NODE, "bmc", OK, T0, "all fine") for k in Kind]
    assert fold(h, (DEFAULT_TABLE.classify(s) for s in healthy)) == h


def test_a_witness_clears_its_own_degraded_fault_never_the_nodes() -> None:
    fan = bmc("fan:critical", Kind.SENSOR, "FAN2")
    h = health_of([fan, Signal(Kind.NVLINK, Witness.NODE, "GPU 0 link 3", "inactive", T0)])
    assert h.severity == Severity.DEGRADED and len(h.faults) == 2
    cleared = fold_one(h, DEFAULT_TABLE.classify(bmc(OK, Kind.SENSOR, "FAN2")))
    assert [f.kind for f in cleared.faults.values()] == [Kind.NVLINK]
    # the node saying its link is fine again changes nothing; the BMC saying so neither
    # (it did not witness it)
    for w in (Witness.NODE, Witness.BMC):
        s = Signal(Kind.NVLINK, w, "GPU 0 link 3", OK, T0)
        assert fold_one(cleared, DEFAULT_TABLE.classify(s)) == cleared


def test_transients_expire_by_the_clock() -> None:
    late = Signal(Kind.SILENCE, Witness.METALD, "node", "heartbeat", T0, "30 s", 30)
    h = health_of([late, bmc("critical: Chassis intrusion")])
    assert {f.severity for f in h.faults.values()} == {Severity.TRANSIENT, Severity.DEGRADED}
    assert expire(h, T0 + timedelta(seconds=60), timedelta(seconds=600)) == h
    gone = expire(h, T0 + timedelta(seconds=601), timedelta(seconds=600))
    assert [f.severity for f in gone.faults.values()] == [Severity.DEGRADED]
    assert repaired().severity == Severity.OK


def test_a_repeated_fault_keeps_its_first_evidence_and_counts_the_last_time() -> None:
    a = Signal(Kind.XID, Witness.NODE, "0000:3b:00", "79", T0, "first line")
    b = Signal(Kind.XID, Witness.NODE, "0000:3b:00", "79", T0 + timedelta(1), "second")
    (f,) = health_of([a, b]).faults.values()
    assert (f.evidence, f.first_at, f.last_at) == ("first line", T0, T0 + timedelta(1))
