"""CPU, memory and disk checks: smartctl -j, fio JSON, stress-ng, memtester, EDAC counters."""

from __future__ import annotations

import json
import re
from typing import Any

from metald.commissioning.verdict import Verdict, error, judge, skipped


def _json(text: str, tool: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as e:
        raise ValueError(f"{tool} output is not JSON: {e}") from None


def parse_smart(text: str) -> tuple[list[dict[str, Any]], list[str]]:
    """``smartctl -j -a /dev/X``, one document per disk (a JSON list, or one per line): the
    facts of each disk with SMART data (device, model, passed, NVMe wear, critical warning,
    media errors, available spare and its threshold), and the devices without any SMART
    interface (virtio, loop, some RAID volumes). Raises ValueError for output that is not
    smartctl's JSON, and for a disk it could not read."""
    docs: list[Any] = []
    try:
        parsed = _json(text, "smartctl") if text.lstrip()[:1] in ("[", "{") else None
    except ValueError:
        parsed = None
    if isinstance(parsed, list):
        docs = parsed
    elif isinstance(parsed, dict):
        docs = [parsed]
    else:
        docs = [_json(line, "smartctl") for line in text.splitlines() if line.strip()]
    disks: list[dict[str, Any]] = []
    without: list[str] = []
    for d in docs:
        if not isinstance(d, dict):
            raise ValueError("smartctl output is not a JSON object per disk")
        status = d.get("smart_status")
        if not isinstance(status, dict):
            msgs = [m.get("string", "") for m in (d.get("smartctl") or {}).get("messages", [])]
            argv = (d.get("smartctl") or {}).get("argv") or ["?"]
            if _no_smart_interface(d):
                without.append(str(argv[-1]))
                continue
            raise ValueError(
                f"smartctl read no SMART data from {argv[-1]}: {'; '.join(msgs)[:200]}"
            )
        nvme = d.get("nvme_smart_health_information_log") or {}
        disks.append(
            {
                "device": (d.get("device") or {}).get("name") or "?",
                "model": d.get("model_name"),
                "passed": status.get("passed"),
                "percentage_used": nvme.get("percentage_used"),
                "critical_warning": nvme.get("critical_warning", 0) or 0,
                "media_errors": nvme.get("media_errors", 0) or 0,
                "available_spare": nvme.get("available_spare"),
                "available_spare_threshold": nvme.get("available_spare_threshold"),
            }
        )
    if not docs:
        raise ValueError("smartctl reported no disk")
    return disks, without


def judge_smart(
    text: str,
    *,
    max_percentage_used: int | None = None,
    min_available_spare: int | None = None,
    max_media_errors: int | None = None,
) -> Verdict:
    """``smartctl -j -a /dev/X`` (``parse_smart``): a document without SMART data (the device
    could not be opened) is an error; overall health failed, an NVMe critical warning, NVMe
    media errors (a drive can report PASSED with them; more than ``max_media_errors`` when the
    profile allows some), NVMe wear of 90 % or more (or above ``max_percentage_used``), or
    available spare below ``min_available_spare`` (or below the drive's own threshold) fail."""
    wear_max = 89 if max_percentage_used is None else max_percentage_used
    media_max = 0 if max_media_errors is None else max_media_errors
    try:
        parsed, without = parse_smart(text)
    except ValueError as e:
        return error(str(e))
    disks, problems = [], []
    for disk in parsed:
        spare_min = disk.pop("available_spare_threshold")
        disks.append(disk)
        name, wear, crit = disk["device"], disk["percentage_used"], disk["critical_warning"]
        media, spare = disk["media_errors"], disk["available_spare"]
        if disk["passed"] is False:
            problems.append(f"{name} SMART overall health failed")
        if crit:
            problems.append(f"{name} NVMe critical warning {crit:#x}")
        if isinstance(media, int) and media > media_max:
            allowed = f" (the profile allows {media_max})" if media_max else ""
            problems.append(f"{name} has {media} NVMe media errors{allowed}")
        if isinstance(wear, int) and wear > wear_max:
            limit = "" if max_percentage_used is None else f", above the profile's {wear_max} %"
            problems.append(f"{name} NVMe {wear} % worn{limit}")
        if isinstance(spare, int):
            floor = min_available_spare if min_available_spare is not None else spare_min
            if isinstance(floor, int) and spare < floor:
                whose = "the profile's" if min_available_spare is not None else "the drive's"
                problems.append(f"{name} NVMe available spare {spare} %, below {whose} {floor} %")
    if not disks:
        return skipped(
            f"no disk has a SMART interface ({', '.join(without)}: smartctl cannot detect a "
            "device type, as for virtio disks)",
            disks=[],
            without_smart=without,
        )
    return judge(
        problems, f"{len(disks)} disk(s) SMART healthy", disks=disks, without_smart=without
    )


def _no_smart_interface(doc: dict[str, Any]) -> bool:
    """smartctl found no way to ask the device for SMART data (exit status bit 0 alone, "Unable
    to detect device type"): a disk with no SMART at all, unlike one it could not open (bit 1),
    which stays an error."""
    ctl = doc.get("smartctl") or {}
    msgs = [m.get("string", "") for m in ctl.get("messages", []) if isinstance(m, dict)]
    return ctl.get("exit_status") == 1 and any(
        m.endswith("Unable to detect device type") for m in msgs
    )


def judge_fio(
    text: str, *, min_read_mbps: float | None = None, min_read_iops: float | None = None
) -> Verdict:
    """``fio --output-format=json``: no job errors; read bandwidth (MB/s) and IOPS at or above
    the profile's floors."""
    try:
        doc = _json(text, "fio")
    except ValueError as e:
        return error(str(e))
    jobs = doc.get("jobs") if isinstance(doc, dict) else None
    if not isinstance(jobs, list) or not jobs:
        return error("fio output has no jobs")
    out, problems = [], []
    for j in jobs:
        name = str(j.get("jobname", "?"))
        err = int(j.get("error", 0) or 0)
        bw_kib = float((j.get("read") or {}).get("bw", 0) or 0)  # KiB/s
        mbps = round(bw_kib * 1024 / 1e6, 1)
        iops = round(float((j.get("read") or {}).get("iops", 0) or 0), 1)
        out.append({"job": name, "error": err, "read_mbps": mbps, "read_iops": iops})
        if err:
            problems.append(f"fio job {name} failed with error {err}")
        if min_read_mbps is not None and mbps < min_read_mbps:
            problems.append(
                f"fio job {name} read {mbps} MB/s, below the profile's {min_read_mbps:g} MB/s"
            )
        if min_read_iops is not None and iops < min_read_iops:
            problems.append(
                f"fio job {name} read {iops:g} IOPS, below the profile's {min_read_iops:g} IOPS"
            )
    return judge(problems, f"fio read {', '.join(str(j['read_mbps']) for j in out)} MB/s", jobs=out)


_STRESS_FAIL = re.compile(r"(?:failed|unsuccessful run completed)", re.IGNORECASE)
_STRESS_OK = re.compile(r"successful run completed")


def judge_stress_ng(text: str) -> Verdict:
    """stress-ng's log: 'successful run completed' and no 'failed'/'unsuccessful' line.
    (With --verify a miscompare is logged as a failure.)"""
    bad = [line.strip() for line in text.splitlines() if _STRESS_FAIL.search(line)]
    bad = [b for b in bad if not re.search(r"\b0 failed\b", b)]
    if bad:
        return judge([f"stress-ng: {bad[0][:200]}"], "", lines=bad[:10])
    if not _STRESS_OK.search(text):
        return error("stress-ng did not report a completed run")
    rates = {m[1]: float(m[2]) for m in _STRESS_METRIC.finditer(text)}
    return judge([], "stress-ng run completed without failures", bogo_ops_per_s=rates)


#: A --metrics-brief row: stressor, bogo ops, real/usr/sys time, bogo ops/s (real time), ...
_STRESS_METRIC = re.compile(r"\] (\w[\w-]*) +\d+ +[\d.]+ +[\d.]+ +[\d.]+ +([\d.]+)", re.MULTILINE)


def judge_memtester(text: str, exit_code: int | None) -> Verdict:
    """memtester: exit 0 and no FAILURE line (its exit code sets bits per failed test)."""
    fails = [line.strip() for line in text.splitlines() if "FAILURE" in line]
    if fails or (exit_code not in (None, 0)):
        first = fails[0][:200] if fails else f"exit code {exit_code}"
        return judge([f"memtester: {first}"], "", failures=fails[:10], exit_code=exit_code)
    if "Done." not in text:
        return error("memtester did not finish (no 'Done.')")
    return judge([], "memtester passed", exit_code=exit_code)


def parse_edac(text: str) -> dict[str, int]:
    """``name value`` lines (``mc0/ce_count 0``) as the agent reads /sys/devices/system/edac/mc."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            out[parts[0]] = int(parts[1])
    return out


def judge_edac(before: str, after: str) -> Verdict:
    """Uncorrected errors at all, or corrected errors that grew during the run, fail."""
    b, a = parse_edac(before), parse_edac(after)
    problems = []
    for key, value in sorted(a.items()):
        if key.endswith("ue_count") and value:
            problems.append(f"EDAC {key} = {value} uncorrected memory errors")
        elif key.endswith("ce_count") and value > b.get(key, 0):
            problems.append(f"EDAC {key} grew from {b.get(key, 0)} to {value} during the run")
    if not a:
        return skipped("no EDAC memory controller (the kernel has no EDAC driver here)")
    return judge(problems, f"EDAC counters steady on {len(a) // 2 or 1} controller(s)", after=a)
