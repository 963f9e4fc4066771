"""Node reports and BMC readings -> signals, on real captures and copies with a fault put in
(tests/health/fixtures/SOURCES.md)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from metald.health.bmc import log_signals, sensor_signals
from metald.health.classify import DEFAULT_TABLE, Severity
from metald.health.node import NodeReport, ecc_storms, report_signals, silence
from metald.health.signals import OK, Kind, Signal, Witness

TESTS = Path(__file__).resolve().parents[1]
HERE = TESTS / "health" / "fixtures"
GPU = TESTS / "fixtures" / "gpu"
A100 = GPU / "nvidia-smi-q-x_a100-sxm4-80gb_mig_drv535.54.03.xml"
H200 = GPU / "nvgpu-exporter-capture_linux-x86_64__nvidia-h200__590.48.01.txt"
SMART = TESTS / "commissioning" / "fixtures"
AT = datetime(2026, 12, 6, 4, 0, tzinfo=UTC)


def worst(report: NodeReport, gpu_count: int | None = 1) -> tuple[Severity, list[str]]:
    got = report_signals(report, gpu_count=gpu_count)
    assert got.unreadable == []
    cs = [DEFAULT_TABLE.classify(s) for s in got.signals]
    assert all(c.signal.witness == Witness.NODE for c in cs)
    top = max((c.severity for c in cs), key=lambda s: s.rank, default=Severity.OK)
    return top, sorted(c.rule for c in cs if c.severity == top and top != Severity.OK)


def section(bundle: str, command: str) -> str:
    """One ``# $ <command>`` section of a capture bundle."""
    lines = bundle.splitlines()
    start = lines.index(f"# $ {command}") + 2
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("####"))
    return "\n".join(lines[start:end]) + "\n"


def test_the_real_a100_capture_is_healthy() -> None:
    assert worst(NodeReport(AT, nvidia_smi_xml=A100.read_text())) == (Severity.OK, [])


def test_a_gpu_missing_against_the_inventory_is_fatal() -> None:
    got = report_signals(NodeReport(AT, nvidia_smi_xml=A100.read_text()), gpu_count=8)
    (missing,) = [s for s in got.signals if s.kind == Kind.GPU_COUNT]
    assert missing.value == 7 and "attached_gpus 4" in missing.evidence
    assert DEFAULT_TABLE.classify(missing).severity == Severity.FATAL


def test_uncorrectable_ecc_and_remap_failure_are_fatal() -> None:
    xml = (HERE / "nvidia-smi-q-x_a100_derived_uncorrectable-ecc.xml").read_text()
    assert worst(NodeReport(AT, nvidia_smi_xml=xml)) == (
        Severity.FATAL,
        ["gpu-ecc-uncorrectable", "gpu-ecc-uncorrectable"],
    )
    xml = (HERE / "nvidia-smi-q-x_a100_derived_remap-failure.xml").read_text()
    sev, rules = worst(NodeReport(AT, nvidia_smi_xml=xml))
    assert (sev, rules) == (Severity.FATAL, ["gpu-remap-failure"])


def test_throttling_is_degraded_and_a_correctable_storm_needs_a_rate() -> None:
    xml = (HERE / "nvidia-smi-q-x_a100_derived_hw-slowdown_correctable-4000.xml").read_text()
    r = report_signals(NodeReport(AT, nvidia_smi_xml=xml), gpu_count=1)
    assert worst(NodeReport(AT, nvidia_smi_xml=xml)) == (Severity.DEGRADED, ["gpu-throttle"])
    before = report_signals(NodeReport(AT, nvidia_smi_xml=A100.read_text()), gpu_count=1)
    later = [
        Signal(s.kind, s.witness, s.subject, s.code, AT + timedelta(minutes=30), s.evidence,
               s.value)
        for s in r.signals
    ]  # fmt: skip
    now = AT + timedelta(minutes=30)
    (storm,) = ecc_storms([*before.signals, *later], now=now, window_s=3600)
    assert storm.value == 4000 and "rose by 4000" in storm.evidence
    assert DEFAULT_TABLE.classify(storm).severity == Severity.DEGRADED
    # one reading gives no rate; readings older than the window do not count
    assert ecc_storms(later, now=now, window_s=3600) == []
    assert ecc_storms([*before.signals, *later], now=now, window_s=600) == []


def test_xid_lines_from_dmesg_and_the_journal() -> None:
    log = (
        "[  912.104] NVRM: Xid (PCI:0000:3b:00): 79, pid=0, GPU has fallen off the bus.\n"
        "Dec 06 04:01:07 gpu-a1 kernel: NVRM: Xid (PCI:0000:b9:00): 74, pid=<unknown>, "
        "name=<unknown>, NVLink: fatal error detected on link 6(0x10000, 0x0, 0x0)\n"
        "[  915.000] NVRM: Xid (PCI:0000:3c:00): 13, pid=4242, name=python3, Graphics "
        "Exception\n"
        "[  916.000] nvidia-nvlink: unrelated\n"
    )
    got = report_signals(NodeReport(AT, kernel_log=log), gpu_count=None)
    assert [(s.subject, s.code) for s in got.signals] == [
        ("0000:3b:00", "79"), ("0000:b9:00", "74"), ("0000:3c:00", "13"),
    ]  # fmt: skip
    assert "GPU has fallen off the bus" in got.signals[0].evidence
    assert worst(NodeReport(AT, kernel_log=log), None) == (
        Severity.FATAL,
        ["xid-fatal", "xid-fatal"],
    )


def test_nvlink_real_capture_is_up_and_a_derived_inactive_link_is_degraded() -> None:
    real = section(H200.read_text(), "nvidia-smi nvlink -s")
    assert "Link 17" in real
    assert worst(NodeReport(AT, nvlink=real), None) == (Severity.OK, [])
    down = (HERE / "nvidia-smi-nvlink-s_h200_derived_link3-inactive.txt").read_text()
    got = report_signals(NodeReport(AT, nvlink=down), gpu_count=None).signals
    assert [(s.subject, s.code) for s in got] == [("GPU 0 link 3", "inactive")]
    assert worst(NodeReport(AT, nvlink=down), None) == (Severity.DEGRADED, ["nvlink-down"])


def test_smart() -> None:
    ok = (SMART / "smartctl-j_nvme-intel-ssdpeknw010t8_pass.json").read_text()
    assert worst(NodeReport(AT, smart=ok), None) == (Severity.OK, [])
    media = (SMART / "smartctl-x-j_nvme-samsung-970evo_media-errors.json").read_text()
    assert worst(NodeReport(AT, smart=media), None) == (Severity.DEGRADED, ["smart-warning"])
    failed = (HERE / "smartctl-j_nvme-intel_derived_failed.json").read_text()
    assert worst(NodeReport(AT, smart=failed), None) == (Severity.FATAL, ["smart-failed"])


def test_ib_ports() -> None:
    text = "mlx5_0/1 4: ACTIVE 400 Gb/sec (4X NDR)\nmlx5_1/1 1: DOWN 10 Gb/sec (4X SDR)\n"
    got = report_signals(NodeReport(AT, ib_ports=text), gpu_count=None).signals
    assert [(s.subject, s.code) for s in got] == [("mlx5_1/1", "down")]
    assert worst(NodeReport(AT, ib_ports=text), None) == (Severity.DEGRADED, ["ib-port-down"])


def test_unreadable_parts_are_named_not_trusted() -> None:
    got = report_signals(NodeReport(AT, nvidia_smi_xml="<html/>", smart="nonsense"), gpu_count=8)
    assert got.signals == []
    assert [u.split(":")[0] for u in got.unreadable] == ["nvidia-smi -q -x", "smartctl"]
    assert report_signals(NodeReport(AT), gpu_count=8).unreadable == [
        "the report holds no nvidia-smi output on a machine with GPUs"
    ]


def test_a_report_cannot_flood() -> None:
    log = "NVRM: Xid (PCI:0000:3b:00): 13, pid=1, x\n" * 5000
    got = report_signals(NodeReport(AT, kernel_log=log), gpu_count=None)
    assert len(got.signals) == 512 and "5000 signals" in got.unreadable[0]


def test_silence_is_metalds_observation() -> None:
    s = silence(AT, AT - timedelta(hours=1), AT + timedelta(seconds=61))
    assert (s.witness, s.value) == (Witness.METALD, 61)
    assert DEFAULT_TABLE.classify(s).severity == Severity.FATAL
    never = silence(None, AT, AT + timedelta(seconds=5))
    assert DEFAULT_TABLE.classify(never).severity == Severity.TRANSIENT


def test_the_bmc_log_is_read_incrementally() -> None:
    entries = [
        {"id": "1", "at": None, "severity": "ok", "message": "System Event Log cleared"},
        {"id": "2", "at": AT, "severity": "critical",
         "message": "Memory #0x01   Uncorrectable ECC | Asserted"},
    ]  # fmt: skip
    first, keys = log_signals(entries, seen=[], at=AT)
    assert [s.code for s in first] == ["ok: System Event Log cleared",
                                       "critical: Memory #0x01 Uncorrectable ECC | Asserted"]  # fmt: skip
    assert first[1].evidence.startswith("#2 2026-12-06T04:00:00+00:00 critical")
    assert DEFAULT_TABLE.classify(first[1]).severity == Severity.FATAL
    more = [*entries, {"id": "3", "severity": "warning", "message": "Fan FAN2 Lower Critical"}]
    again, _ = log_signals(more, seen=keys, at=AT)
    assert [s.evidence.split()[0] for s in again] == ["#3"]
    assert all(s.witness == Witness.BMC for s in first + again)


def test_bmc_sensors() -> None:
    got = sensor_signals(
        [
            {"name": "PSU1", "kind": "power", "value": 0, "unit": "W", "health": "critical"},
            {"name": "FAN2", "kind": "fan", "value": 9000, "unit": "RPM", "health": "ok"},
            {"name": "X", "kind": "other", "value": None, "unit": None, "health": "unknown"},
        ],
        at=AT,
    )
    assert [(s.subject, s.code) for s in got] == [("PSU1", "power:critical"), ("FAN2", OK)]
    assert DEFAULT_TABLE.classify(got[0]).severity == Severity.FATAL


DCGM_HEALTHY = HERE / "dcgmi-health-c-j_healthy_virtualclient.json"
DCGM_FAILED = HERE / "dcgmi-health-c-j_derived_gpu1-dbe-failure_gpu0-pcie-warning.json"


def test_dcgmi_health_check_json_is_read_into_signals() -> None:
    now = datetime(2026, 12, 6, tzinfo=UTC)
    healthy = report_signals(NodeReport(at=now, dcgm_health=DCGM_HEALTHY.read_text()),
                             gpu_count=None)  # fmt: skip
    assert healthy.signals == [] and healthy.unreadable == []
    got = report_signals(NodeReport(at=now, dcgm_health=DCGM_FAILED.read_text()), gpu_count=None)
    assert got.unreadable == []
    by_subject = {s.subject: s for s in got.signals}
    assert sorted(by_subject) == ["GPU 0", "GPU 1"]
    dbe, pcie = by_subject["GPU 1"], by_subject["GPU 0"]
    assert (dbe.kind, dbe.witness, dbe.code) == ("dcgm-health", "node", "failure")
    assert dbe.evidence == (
        "dcgmi health -c: GPU 1 Memory system Failure: Detected 2 volatile double-bit ECC "
        "error(s) in GPU 1."
    )
    assert "Detected more than 8 PCIe replays per minute for GPU 0 : 13" in pcie.evidence
    assert DEFAULT_TABLE.classify(dbe).severity is Severity.FATAL
    assert DEFAULT_TABLE.classify(pcie).severity is Severity.DEGRADED


@pytest.mark.parametrize("text", ["", "not json", "[]", '{"body": {}}', '{"body": {"Overall '
                                  'Health": {"value": 3}}}'])  # fmt: skip
def test_unreadable_dcgmi_health_output_is_said_not_guessed(text: str) -> None:
    got = report_signals(NodeReport(at=datetime.now(UTC), dcgm_health=text), gpu_count=None)
    assert got.signals == [] and len(got.unreadable) == 1
    assert got.unreadable[0].startswith("dcgmi health output ")


def test_carry_ecc_keeps_only_the_window_and_bounds_what_a_node_sends() -> None:
    from metald.health.node import MAX_ECC_READINGS, carry_ecc

    now = datetime(2026, 12, 6, 12, tzinfo=UTC)

    def reading(value: float, ago_s: float, gpu: str = "0000:01:00.0") -> Signal:
        return Signal(Kind.GPU_ECC, Witness.NODE, gpu, "correctable-aggregate",
                      now - timedelta(seconds=ago_s), "", value)  # fmt: skip

    storms, kept = carry_ecc(None, [reading(0, 0)], now=now, window_s=600)
    assert storms == [] and kept == {"0000:01:00.0": [[now.isoformat(), 0]]}
    # an old reading (out of the window) is dropped: no rate from it
    old = {"0000:01:00.0": [[(now - timedelta(seconds=700)).isoformat(), 0]]}
    storms, kept = carry_ecc(old, [reading(5000, 0)], now=now, window_s=600)
    assert storms == [] and kept == {"0000:01:00.0": [[now.isoformat(), 5000]]}
    # garbage kept rows are skipped, never an error
    storms, _ = carry_ecc({"x": "nope", "y": [[1], ["bad", "x"]]}, [reading(1, 0)], now=now,
                          window_s=600)  # fmt: skip
    assert storms == []
    # a rise within the window is a rate per hour of the window
    within = {"0000:01:00.0": [[(now - timedelta(seconds=60)).isoformat(), 100]]}
    (storm,), _ = carry_ecc(within, [reading(400, 0)], now=now, window_s=600)
    assert (storm.code, storm.value) == ("correctable-rate", 300 * 3600 / 600)
    # bounded: a node sending a new count every report keeps the newest MAX_ECC_READINGS
    kept = None
    for i in range(100):
        _, kept = carry_ecc(kept, [reading(i, 0)], now=now, window_s=600)
    assert kept is not None and len(kept["0000:01:00.0"]) == MAX_ECC_READINGS
