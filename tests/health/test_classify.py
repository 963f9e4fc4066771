"""The classification table: the issue's fatal, degraded and transient cases, the evidence
kept, and operators' rules over it (replace by id, go first, turn off, thresholds)."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest
from pydantic import ValidationError

from metald.config import Config
from metald.health.classify import (
    CLEAR,
    DEFAULT_RULES,
    DEFAULT_TABLE,
    TABLE_VERSION,
    UNMATCHED,
    Severity,
)
from metald.health.config import HealthConfig
from metald.health.signals import MAX_EVIDENCE, OK, Kind, Signal, Witness

AT = datetime(2026, 12, 6, 4, 0, tzinfo=UTC)
MCE = (
    Path(__file__).resolve().parents[1]
    / "commissioning"
    / "fixtures"
    / "ipmitool-sel-elist-v_processor-mce_moxspec.txt"
)


def sig(kind: Kind, code: str, value: float | None = None, w: Witness = Witness.NODE) -> Signal:
    return Signal(kind, w, "0000:3b:00", code, AT, f"evidence of {code}", value)


def sev(kind: Kind, code: str, value: float | None = None) -> Severity:
    return DEFAULT_TABLE.classify(sig(kind, code, value)).severity


@pytest.mark.parametrize("xid", [48, 63, 64, 74, 79, 94, 95])
def test_the_issues_fatal_xids(xid: int) -> None:
    c = DEFAULT_TABLE.classify(sig(Kind.XID, str(xid)))
    assert (c.severity, c.rule, c.part) == (Severity.FATAL, "xid-fatal", "gpu")
    assert c.signal.evidence == f"evidence of {xid}" and c.table_version == TABLE_VERSION


def test_other_xids() -> None:
    assert sev(Kind.XID, "92") == Severity.DEGRADED  # high single-bit ECC rate
    assert sev(Kind.XID, "13") == Severity.OK  # the program's fault
    assert sev(Kind.XID, "790") == Severity.OK  # whole-code match: 790 is not 79


@pytest.mark.parametrize(
    ("kind", "code", "value", "expected"),
    [
        (Kind.GPU_ECC, "uncorrectable-volatile", 1, Severity.FATAL),
        (Kind.GPU_ECC, "uncorrectable-aggregate", 3, Severity.FATAL),
        (Kind.GPU_ECC, "uncorrectable-volatile", 0, Severity.OK),
        (Kind.GPU_ECC, "correctable-rate", 999, Severity.OK),
        (Kind.GPU_ECC, "correctable-rate", 1000, Severity.DEGRADED),
        (Kind.GPU_ECC, "correctable-aggregate", 10**6, Severity.OK),  # a count is no rate
        (Kind.GPU_PAGES, "remap-failure", None, Severity.FATAL),
        (Kind.GPU_PAGES, "remap-pending", None, Severity.DEGRADED),
        (Kind.GPU_COUNT, "missing", 1, Severity.FATAL),
        (Kind.GPU_THROTTLE, "hw_slowdown", None, Severity.DEGRADED),
        (Kind.GPU_THROTTLE, "sw_power_cap", None, Severity.OK),
        (Kind.NVLINK, "inactive", None, Severity.DEGRADED),
        (Kind.SMART, "failed", None, Severity.FATAL),
        (Kind.SMART, "media-errors", 7, Severity.DEGRADED),
        (Kind.IB_PORT, "down", None, Severity.DEGRADED),
        (Kind.IB_PORT, "init", None, Severity.DEGRADED),
        (Kind.IB_PORT, "active", None, Severity.OK),
        (Kind.SENSOR, "power:critical", 0, Severity.FATAL),
        (Kind.SENSOR, "temperature:critical", 101, Severity.FATAL),
        (Kind.SENSOR, "fan:critical", 0, Severity.DEGRADED),
        (Kind.SENSOR, "temperature:warning", 85, Severity.TRANSIENT),
        (Kind.SILENCE, "heartbeat", 59, Severity.TRANSIENT),
        (Kind.SILENCE, "heartbeat", 60, Severity.FATAL),
        (Kind.SCHEDULER_STATE, "not-responding", None, Severity.DEGRADED),
        (Kind.TIMEOUT, "sel read", None, Severity.TRANSIENT),
    ],
)
def test_table(kind: Kind, code: str, value: float | None, expected: Severity) -> None:
    assert sev(kind, code, value) == expected


@pytest.mark.parametrize(
    ("code", "expected", "part"),
    [
        ("critical: Memory #0x01 Uncorrectable ECC | Asserted", Severity.FATAL, "dimm"),
        ("ok: Memory #0x01 Uncorrectable ECC | Deasserted", Severity.OK, ""),
        ("warning: Memory Correctable ECC logging limit reached", Severity.DEGRADED, "dimm"),
        ("critical: Power Supply PS1 Failure detected", Severity.FATAL, "psu"),
        ("ok: Power Supply PS2 Power Supply AC lost", Severity.FATAL, "psu"),
        ("critical: Temperature CPU1 Upper Non-recoverable going high", Severity.FATAL, "thermal"),
        ("critical: Chassis intrusion", Severity.DEGRADED, ""),
        ("ok: System Event Log cleared", Severity.OK, ""),
    ],
)
def test_bmc_log_entries(code: str, expected: Severity, part: str) -> None:
    for kind in (Kind.SEL, Kind.REDFISH_LOG):
        c = DEFAULT_TABLE.classify(sig(kind, code, w=Witness.BMC))
        assert (c.severity, c.part) == (expected, part), (kind, code, c.rule)


def test_the_real_sel_record_of_a_machine_check_is_fatal() -> None:
    """The production SEL record (moxspec fixture): 'Uncorrectable machine check exception'."""
    text = MCE.read_text()
    line = next(x for x in text.splitlines() if "machine check" in x.lower())
    message = line.split(":", 1)[1].strip() if ":" in line else line
    c = DEFAULT_TABLE.classify(sig(Kind.SEL, f"unknown: {message}", w=Witness.BMC))
    assert (c.severity, c.part) == (Severity.FATAL, "cpu"), (message, c.rule)


def test_a_clear_and_an_unmatched_code_are_ok() -> None:
    assert DEFAULT_TABLE.classify(sig(Kind.NVLINK, OK)).rule == CLEAR
    assert DEFAULT_TABLE.classify(sig(Kind.NVLINK, "training")).rule == UNMATCHED


def test_every_kind_has_a_rule_and_ids_are_unique() -> None:
    ids = [r.id for r in DEFAULT_RULES]
    assert len(ids) == len(set(ids))
    assert {r.kind for r in DEFAULT_RULES} == set(Kind)


def test_evidence_is_bounded() -> None:
    s = Signal(Kind.XID, Witness.NODE, "x", "79", AT, "A" * 10_000)
    assert len(s.evidence) == MAX_EVIDENCE


def test_operators_replace_prepend_and_disable_rules() -> None:
    cfg = HealthConfig.model_validate(
        {
            "rules": [
                {"id": "xid-application", "kind": "xid", "match": "13", "severity": "degraded"},
                {"id": "site-xid-31", "kind": "xid", "match": "31", "severity": "fatal",
                 "why": "our site", "part": "gpu"},
            ],
            "disable": ["gpu-throttle"],
            "node_silence_s": 120,
            "correctable_ecc_per_hour": 10,
        }
    )  # fmt: skip
    t = cfg.table()
    assert t.version.startswith(f"{TABLE_VERSION}+") and t.version != DEFAULT_TABLE.version
    assert t.classify(sig(Kind.XID, "31")).rule == "site-xid-31"
    assert t.classify(sig(Kind.XID, "13")).severity == Severity.DEGRADED
    # replaced in place: what it does not match falls to the rules after it
    assert t.classify(sig(Kind.XID, "43")).rule == UNMATCHED
    assert t.classify(sig(Kind.GPU_THROTTLE, "hw_slowdown")).severity == Severity.OK
    assert t.classify(sig(Kind.SILENCE, "heartbeat", 60)).severity == Severity.TRANSIENT
    assert t.classify(sig(Kind.SILENCE, "heartbeat", 120)).severity == Severity.FATAL
    assert t.classify(sig(Kind.GPU_ECC, "correctable-rate", 10)).severity == Severity.DEGRADED
    assert HealthConfig().table() == DEFAULT_TABLE


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"disable": ["no-such-rule"]}, "names no built-in rule: no-such-rule"),
        ({"rules": [{"id": "a", "kind": "xid", "match": "(", "severity": "fatal"}]},
         "not a regular expression"),
        ({"rules": [{"id": "a", "kind": "xid", "match": "1", "severity": "bad"}]}, "severity"),
        ({"rules": [{"id": "a", "kind": "nope", "match": "1", "severity": "fatal"}]}, "kind"),
        ({"rules": [{"id": "a", "kind": "xid", "match": "1", "severity": "fatal"}] * 2},
         "given twice"),
        ({"policy": {"fatal": "explode"}}, "fatal"),
        ({"limits": {"per_claim": 0}}, "per_claim"),
    ],
)  # fmt: skip
def test_bad_health_config_names_the_problem(body: dict, says: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ValidationError, match=says):
        HealthConfig.model_validate(body)


def test_the_daemon_config_holds_a_health_section() -> None:
    cfg = Config.model_validate({"health": {"limits": {"per_claim": 2}}})
    assert cfg.health.limits.per_claim == 2


def test_policy_precedence() -> None:
    cfg = HealthConfig.model_validate(
        {
            "policy": {"fatal": "replace"},
            "sku_policies": {"h100": {"fatal": "remove"}},
            "tenant_policies": {"acme": {"fatal": "drain", "job_wait_s": 0}},
        }
    )
    assert cfg.policy_for(tenant="acme", sku="h100").fatal == "drain"
    assert cfg.policy_for(tenant="other", sku="h100").fatal == "remove"
    assert cfg.policy_for(tenant=None, sku=None).fatal == "replace"
