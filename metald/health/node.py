"""The node agent's health report -> signals (witness: the node).

The report carries the tools' raw output; metald parses it with the commissioning parsers
(``metald.commissioning.parsers``), never trusting a verdict the node computed. Everything
here is the tenant's word: it can only add faults (``metald.health.trust``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from metald.commissioning.parsers import dcgm, gpu_text, host, ib, nvidia_smi
from metald.health.signals import Kind, Signal, Witness

#: Signals kept from one report (a hostile node cannot flood the classifier).
MAX_SIGNALS = 512


@dataclass(frozen=True)
class NodeReport:
    at: datetime
    #: Kernel lines since the last report (dmesg or the journal's kernel lines).
    kernel_log: str = ""
    #: ``nvidia-smi -q -x``.
    nvidia_smi_xml: str | None = None
    #: ``nvidia-smi nvlink -s``.
    nvlink: str | None = None
    #: ``smartctl -j -a`` of each disk.
    smart: str | None = None
    #: InfiniBand ports as the agent prints them (``metald.commissioning.parsers.ib``).
    ib_ports: str | None = None
    #: ``dcgmi health --check --json`` (where DCGM runs with health watches set).
    dcgm_health: str | None = None


@dataclass(frozen=True)
class NodeSignals:
    signals: list[Signal]
    #: Parts of the report that could not be read, in a sentence each.
    unreadable: list[str]


def _gpu_signals(xml: str, at: datetime, gpu_count: int | None) -> list[Signal]:
    head, gpus = nvidia_smi.parse(xml)
    out: list[Signal] = []

    def add(kind: Kind, bus: str, code: str, evidence: str, value: float | None = None) -> None:
        out.append(Signal(kind, Witness.NODE, bus, code, at, f"nvidia-smi -q -x: GPU {bus} "
                          f"{evidence}", value))  # fmt: skip

    for g in gpus:
        bus = str(g["bus_id"])
        for scope in ("volatile", "aggregate"):
            counts = g[f"ecc_{scope}"]
            if counts["uncorrectable"]:
                add(Kind.GPU_ECC, bus, f"uncorrectable-{scope}",
                    f"ecc_errors/{scope} uncorrectable={counts['uncorrectable']}",
                    counts["uncorrectable"])  # fmt: skip
        corr = g["ecc_aggregate"]["correctable"]
        add(Kind.GPU_ECC, bus, "correctable-aggregate",
            f"ecc_errors/aggregate correctable={corr}", corr)  # fmt: skip
        if g["remap_failure"]:
            add(Kind.GPU_PAGES, bus, "remap-failure", "remapped_rows/remapped_row_failure=Yes")
        if g["remap_pending"]:
            add(Kind.GPU_PAGES, bus, "remap-pending", "remapped_rows/remapped_row_pending=Yes")
        if g["retired_pending"]:
            add(Kind.GPU_PAGES, bus, "retire-pending", "retired_pages/pending_retirement=Yes")
        for reason in g["slowdowns"]:
            add(Kind.GPU_THROTTLE, bus, reason, f"clocks event reason {reason}=Active")
    if gpu_count is not None and len(gpus) < gpu_count:
        seen = ", ".join(str(g["bus_id"]) for g in gpus) or "none"
        out.append(
            Signal(
                Kind.GPU_COUNT,
                Witness.NODE,
                "node",
                "missing",
                at,
                f"nvidia-smi -q -x describes {len(gpus)} GPU(s) (attached_gpus "
                f"{head['attached_gpus']}; seen: {seen}), the inventory holds {gpu_count}",
                gpu_count - len(gpus),
            )  # fmt: skip
        )
    return out


def report_signals(report: NodeReport, *, gpu_count: int | None) -> NodeSignals:
    """The signals of one node report; ``gpu_count`` is what the inventory holds."""
    at, out, bad = report.at, [], []
    for e in gpu_text.parse_xid(report.kernel_log):
        out.append(Signal(Kind.XID, Witness.NODE, e["pci"], str(e["xid"]), at, e["line"]))
    if report.nvidia_smi_xml is not None:
        try:
            out += _gpu_signals(report.nvidia_smi_xml, at, gpu_count)
        except ValueError as e:
            bad.append(f"nvidia-smi -q -x: {e}")
    elif gpu_count:
        bad.append("the report holds no nvidia-smi output on a machine with GPUs")
    if report.nvlink is not None:
        for gpu, links in gpu_text.parse_nvlink(report.nvlink).items():
            for n, text in links.items():
                if "inactive" in text.lower():
                    out.append(Signal(Kind.NVLINK, Witness.NODE, f"GPU {gpu} link {n}",
                                      "inactive", at, f"nvidia-smi nvlink -s: GPU {gpu} "
                                      f"Link {n}: {text}"))  # fmt: skip
    if report.smart is not None:
        try:
            disks, _ = host.parse_smart(report.smart)
        except ValueError as e:
            bad.append(f"smartctl: {e}")
            disks = []
        for d in disks:
            name = str(d["device"])
            facts = f"smartctl -j {name}: passed={d['passed']} critical_warning="
            facts += f"{d['critical_warning']} media_errors={d['media_errors']}"
            if d["passed"] is False:
                out.append(Signal(Kind.SMART, Witness.NODE, name, "failed", at, facts))
            if d["critical_warning"]:
                out.append(Signal(Kind.SMART, Witness.NODE, name, "critical-warning", at, facts,
                                  float(d["critical_warning"])))  # fmt: skip
            if isinstance(d["media_errors"], int) and d["media_errors"]:
                out.append(Signal(Kind.SMART, Witness.NODE, name, "media-errors", at, facts,
                                  float(d["media_errors"])))  # fmt: skip
    if report.ib_ports is not None:
        for p in ib.parse_ib(report.ib_ports):
            if p["state"] != "ACTIVE":
                out.append(Signal(Kind.IB_PORT, Witness.NODE, p["port"], p["state"].lower(), at,
                                  f"{p['port']} {p['state']} {p['rate_gbps']:g} Gb/sec"))  # fmt: skip
    if report.dcgm_health is not None:
        try:
            overall, incidents = dcgm.parse_health(report.dcgm_health)
        except ValueError as e:
            bad.append(str(e))
            incidents = []
        for i in incidents:
            # DCGM names the GPU by its index (its entity id), not its PCI address.
            subject = f"{i['group']} {i['entity']}"
            out.append(Signal(Kind.DCGM_HEALTH, Witness.NODE, subject, i["health"].lower(), at,
                              f"dcgmi health -c: {subject} {i['system']} {i['health']}: "
                              f"{i['message']}"))  # fmt: skip
    if len(out) > MAX_SIGNALS:
        bad.append(f"the report held {len(out)} signals; the first {MAX_SIGNALS} were kept")
    return NodeSignals(out[:MAX_SIGNALS], bad)


def ecc_storms(readings: Iterable[Signal], *, now: datetime, window_s: float) -> list[Signal]:
    """Correctable ECC storms from ``correctable-aggregate`` readings: per witness and GPU,
    the errors counted within the last ``window_s`` seconds, per hour of that window, as a
    ``correctable-rate`` signal (the table's threshold decides whether it is a storm). One
    reading gives no rate; a counter that went down (a reset GPU) counts from its new value."""
    since = now - timedelta(seconds=window_s)
    series: dict[tuple[Witness, str], list[Signal]] = {}
    for r in readings:
        ecc = r.kind == Kind.GPU_ECC and r.code == "correctable-aggregate"
        if ecc and r.value is not None and since <= r.at <= now:
            series.setdefault((r.witness, r.subject), []).append(r)
    out = []
    for (witness, subject), rs in sorted(series.items()):
        rs.sort(key=lambda r: r.at)
        if len(rs) < 2:
            continue
        rise = sum(
            max(0.0, (b.value or 0) - (a.value or 0)) for a, b in zip(rs, rs[1:], strict=False)
        )
        rate = rise * 3600 / window_s
        out.append(
            Signal(
                Kind.GPU_ECC,
                witness,
                subject,
                "correctable-rate",
                now,
                f"correctable ECC on GPU {subject} rose by {rise:g} between "
                f"{rs[0].at.isoformat()} and {rs[-1].at.isoformat()} ({rate:g}/h over "
                f"{window_s:g} s)",
                rate,
            )  # fmt: skip
        )
    return out


def silence(last_report: datetime | None, since: datetime, now: datetime) -> Signal:
    """metald's observation of a node's silence: seconds since its last report (or since it
    became active, when it never reported); the table decides when that is fatal."""
    ref = last_report or since
    secs = max(0.0, (now - ref).total_seconds())
    return Signal(Kind.SILENCE, Witness.METALD, "node", "heartbeat", now,
                  f"no node report since {ref.isoformat()} ({secs:.0f} s)", secs)  # fmt: skip


#: Readings kept per GPU, and GPUs per machine, across reports (``carry_ecc``).
MAX_ECC_READINGS = 32
MAX_ECC_GPUS = 64


def carry_ecc(
    kept: dict[str, Any] | None, report: Iterable[Signal], *, now: datetime, window_s: float
) -> tuple[list[Signal], dict[str, Any] | None]:
    """Correctable-ECC storms across reports: the node's ``correctable-aggregate`` readings of
    this report added to those kept from earlier ones (``{gpu: [[iso time, count], ...]}``,
    within ``window_s``), the rate over them (``ecc_storms``), and what to keep now (None when
    nothing). Only readings of the node witness are carried: the storm is the node's word."""
    since = now - timedelta(seconds=window_s)
    series: list[Signal] = []
    for gpu, rows in list((kept or {}).items())[:MAX_ECC_GPUS]:
        for row in rows if isinstance(rows, list) else []:
            try:
                at, value = datetime.fromisoformat(str(row[0])), float(row[1])
            except (TypeError, ValueError, IndexError):
                continue
            if since <= at <= now:
                series.append(Signal(Kind.GPU_ECC, Witness.NODE, str(gpu), "correctable-aggregate",
                                     at, "", value))  # fmt: skip
    fresh = [
        r for r in report
        if r.kind == Kind.GPU_ECC and r.code == "correctable-aggregate" and r.value is not None
        and r.witness == Witness.NODE
    ]  # fmt: skip
    if not fresh:
        return [], kept
    series += fresh
    storms = [s for s in ecc_storms(series, now=now, window_s=window_s) if s.value]
    keep: dict[str, list[list[Any]]] = {}
    for r in sorted(series, key=lambda r: r.at):
        rows = keep.setdefault(r.subject, [])
        if rows and rows[-1][1] == r.value:
            continue  # the same count again: the first reading of it is the one that counts
        rows.append([r.at.isoformat(), r.value])
    out = {g: rows[-MAX_ECC_READINGS:] for g, rows in list(keep.items())[:MAX_ECC_GPUS]}
    return storms, out or None
