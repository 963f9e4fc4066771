"""The classification table: each signal -> fatal, degraded, transient or ok, with the rule
that decided and the evidence kept. One versioned table; the first rule that matches decides.

``docs/health.md`` is drawn from ``DEFAULT_RULES`` (scripts/health_table.py). Operators put
rules ahead of it, replace a rule by its id, or turn one off (``[health]`` in the
configuration, ``metald.health.config``); the version of a table they changed carries a hash
of the change, so every classification names the table that made it.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

from metald.commissioning.parsers.gpu_text import HARDWARE_XIDS
from metald.health.signals import Kind, Signal

#: Bumped whenever a built-in rule changes what it matches or the severity it gives.
TABLE_VERSION = "2"


class Severity(StrEnum):
    OK = "ok"
    TRANSIENT = "transient"
    DEGRADED = "degraded"
    FATAL = "fatal"

    @property
    def rank(self) -> int:
        return _RANK[self]


_RANK = {Severity.OK: 0, Severity.TRANSIENT: 1, Severity.DEGRADED: 2, Severity.FATAL: 3}


def worst(severities: Iterable[Severity]) -> Severity:
    return max(severities, key=lambda s: s.rank, default=Severity.OK)


@dataclass(frozen=True)
class Rule:
    id: str
    kind: Kind
    #: A regular expression over the whole code, case-insensitive.
    match: str
    severity: Severity
    why: str = ""
    #: The signal's value must be at least this (a count, a rate, seconds of silence).
    min_value: float | None = None
    #: The part a technician looks at.
    part: str = ""

    def matches(self, s: Signal) -> bool:
        if s.kind != self.kind or not re.fullmatch(self.match, s.code, re.IGNORECASE | re.S):
            return False
        return self.min_value is None or (s.value is not None and s.value >= self.min_value)


@dataclass(frozen=True)
class Classified:
    signal: Signal
    severity: Severity
    rule: str
    why: str
    part: str
    table_version: str


#: The rule id of a signal no rule matched (ok), and of a witness's clear.
UNMATCHED, CLEAR = "unmatched", "clear"

_FATAL_XIDS = (48, 63, 64, 74, 79, 94, 95)
_OTHER_HW_XIDS = sorted(HARDWARE_XIDS - set(_FATAL_XIDS))
_THROTTLE = "hw_slowdown|hw_thermal_slowdown|hw_power_brake_slowdown|sw_thermal_slowdown"
F, D, T, N = Severity.FATAL, Severity.DEGRADED, Severity.TRANSIENT, Severity.OK  # N: no fault


def _bmc_log_rules(kind: Kind, p: str) -> list[Rule]:
    """The same rules for IPMI SEL records and Redfish log entries: the code is
    ``<severity>: <message>`` as the BMC gave them."""
    return [
        Rule(f"{p}-deasserted", kind, r".*(deassert|recovered|no longer|restored).*", N,
             "the event ended (a deassertion is no fault)"),
        # pyghmi names an IPMI memory record "Memory Sensor ... Uncorrectable error"
        Rule(f"{p}-memory-uncorrectable", kind, r".*(uncorrectable ecc|memory.*uncorrectable).*", F,
             "uncorrectable memory ECC", part="dimm"),
        Rule(f"{p}-cpu-fatal", kind,
             r".*(\bierr\b|uncorrectable machine check|machine check exception|\bfrb[123]\b).*",
             F, "processor internal error or uncorrectable machine check", part="cpu"),
        Rule(f"{p}-psu-fatal", kind,
             r".*(power supply|\bpsu\d*\b|\bps\d\b).*(fail|lost|predictive).*", F,
             "power supply failure or input lost", part="psu"),
        Rule(f"{p}-thermal-fatal", kind,
             r".*(thermal trip|critical over temperature|non-recoverable).*", F,
             "thermal trip or a non-recoverable threshold crossed", part="thermal"),
        Rule(f"{p}-memory-correctable-limit", kind, r".*correctable ecc.*limit.*", D,
             "correctable memory ECC past the BMC's logging limit", part="dimm"),
        Rule(f"{p}-critical-other", kind, r"(critical|fatal|failed): .*", D,
             "a critical entry no other rule names: drained for a person to look"),
    ]  # fmt: skip


DEFAULT_RULES: tuple[Rule, ...] = (
    Rule("xid-fatal", Kind.XID, "|".join(map(str, _FATAL_XIDS)), F,
         "XID 48 double-bit ECC, 63/64 row remapping event/failure, 74 NVLink error, "
         "79 GPU fallen off the bus, 94/95 contained/uncontained ECC", part="gpu"),
    Rule("xid-hardware", Kind.XID, "|".join(map(str, _OTHER_HW_XIDS)), D,
         "other XIDs that blame the GPU (92 high single-bit ECC rate, 119/120 GSP, 140 "
         "unrecovered ECC, 61/62 internal micro-controller)", part="gpu"),
    Rule("xid-application", Kind.XID, r"\d+", N,
         "application XIDs (13, 31, 43 ...) are the program's fault, not the machine's"),
    Rule("gpu-ecc-uncorrectable", Kind.GPU_ECC, "uncorrectable-(volatile|aggregate)", F,
         "uncorrectable GPU memory ECC errors", min_value=1, part="gpu"),
    Rule("gpu-ecc-correctable-storm", Kind.GPU_ECC, "correctable-rate", D,
         "correctable GPU ECC errors per hour over the window ([health] "
         "correctable_ecc_per_hour)", min_value=1000, part="gpu"),
    Rule("gpu-remap-failure", Kind.GPU_PAGES, "remap-failure", F,
         "the GPU failed to remap a row: replace it", part="gpu"),
    Rule("gpu-reset-pending", Kind.GPU_PAGES, "remap-pending|retire-pending", D,
         "a row remapping or page retirement waits for a GPU reset", part="gpu"),
    Rule("gpu-missing", Kind.GPU_COUNT, "missing", F,
         "fewer GPUs than the inventory holds", min_value=1, part="gpu"),
    Rule("gpu-throttle", Kind.GPU_THROTTLE, _THROTTLE, D,
         "clocks slowed down by the hardware (thermal, power brake, HW slowdown)", part="gpu"),
    Rule("nvlink-down", Kind.NVLINK, "inactive|down", D, "an NVLink link is down",
         part="gpu"),
    Rule("dcgm-failure", Kind.DCGM_HEALTH, "failure|fail", F, "dcgmi health reports a failure",
         part="gpu"),
    Rule("dcgm-warning", Kind.DCGM_HEALTH, "warning|warn", D, "dcgmi health reports a warning",
         part="gpu"),
    Rule("smart-failed", Kind.SMART, "failed", F, "the disk's SMART overall health failed",
         part="disk"),
    Rule("smart-warning", Kind.SMART, "critical-warning|media-errors", D,
         "an NVMe critical warning or media errors", part="disk"),
    Rule("ib-port-down", Kind.IB_PORT, "(?!active$).+", D,
         "an InfiniBand port is not ACTIVE", part="nic"),
    Rule("sensor-psu-critical", Kind.SENSOR, "(power|voltage|current):critical", F,
         "a power supply sensor is critical", part="psu"),
    Rule("sensor-thermal-critical", Kind.SENSOR, "temperature:critical", F,
         "a temperature sensor is critical", part="thermal"),
    Rule("sensor-fan-critical", Kind.SENSOR, "fan:critical", D, "a fan sensor is critical",
         part="fan"),
    Rule("sensor-warning", Kind.SENSOR, r"\w+:warning", T, "a sensor is past its warning"),
    *_bmc_log_rules(Kind.SEL, "sel"),
    *_bmc_log_rules(Kind.REDFISH_LOG, "redfish"),
    Rule("node-silent", Kind.SILENCE, "heartbeat", F,
         "the node sent no report for node_silence_s seconds", min_value=60, part="node"),
    Rule("node-late", Kind.SILENCE, "heartbeat", T, "a node report came late"),
    Rule("scheduler-down", Kind.SCHEDULER_STATE, "down|not-responding", D,
         "the tenant's scheduler reports the node DOWN or NOT_RESPONDING", part="node"),
    Rule("timeout", Kind.TIMEOUT, ".*", T, "one read that did not answer in time"),
)  # fmt: skip


@dataclass(frozen=True)
class Table:
    rules: tuple[Rule, ...]
    version: str

    def classify(self, s: Signal) -> Classified:
        if s.is_clear:
            return Classified(s, Severity.OK, CLEAR, "the witness reports the part fine", "",
                              self.version)  # fmt: skip
        for r in self.rules:
            if r.matches(s):
                return Classified(s, r.severity, r.id, r.why, r.part, self.version)
        return Classified(s, Severity.OK, UNMATCHED, "no rule matches", "", self.version)


def build_table(
    overrides: Sequence[Rule] = (),
    *,
    disable: Iterable[str] = (),
    node_silence_s: float = 60,
    correctable_ecc_per_hour: float = 1000,
) -> Table:
    """The built-in rules with the thresholds set, ``disable`` left out, and ``overrides``
    replacing rules of the same id in place or going first."""
    thresholds = {
        "node-silent": node_silence_s,
        "gpu-ecc-correctable-storm": correctable_ecc_per_hour,
    }
    off = set(disable)
    by_id = {r.id: r for r in overrides}
    rules = [
        by_id.get(r.id) or (replace(r, min_value=thresholds[r.id]) if r.id in thresholds else r)
        for r in DEFAULT_RULES
        if r.id not in off
    ]
    builtin = {r.id for r in DEFAULT_RULES}
    rules = [r for r in overrides if r.id not in builtin] + rules
    out = tuple(rules)
    if out == DEFAULT_RULES:
        return Table(out, TABLE_VERSION)
    digest = hashlib.sha256(repr(out).encode()).hexdigest()[:8]
    return Table(out, f"{TABLE_VERSION}+{digest}")


DEFAULT_TABLE = build_table()
