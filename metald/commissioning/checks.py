"""metald's verdict on one check the agent ran: recomputed from the raw output with the
parser for that check and the profile's expectations. The agent's own status is kept for the
record but decides nothing, except that a check it could not run (timeout, missing tool) is an
error or a skip, which no output can turn into a pass."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from metald.commissioning.parsers import dcgm, gpu_text, host, ib, nvidia_smi, rocm_smi
from metald.commissioning.profile import CheckName, CommissioningProfile
from metald.commissioning.verdict import Status, Verdict, error, failed, skipped

#: Raw output kept per check (the agent bounds what it sends to this too).
RAW_LIMIT = 64 * 1024


class CheckReport(BaseModel):
    """What the agent posts for one check."""

    model_config = ConfigDict(extra="forbid")

    name: CheckName
    #: The agent's view: ran (output follows), timeout, missing (tool or device absent), error.
    outcome: str = Field(pattern=r"^(ran|timeout|missing|error)$")
    exit_code: int | None = Field(default=None, ge=-255, le=255)
    duration_s: float = Field(ge=0, le=14 * 86400)
    raw: str = Field(default="", max_length=RAW_LIMIT)
    #: Counters read before the run (EDAC), for checks that compare before and after.
    raw_before: str | None = Field(default=None, max_length=RAW_LIMIT)


#: Checks whose tool has no build for an architecture: on such a machine the tool is absent
#: by necessity, so its absence is a skip with this reason even where the profile requires the
#: check (a profile is per kind of machine; one shared by amd64 and arm64 hosts asks for it).
NO_BUILD: dict[str, dict[str, str]] = {
    "arm64": {
        "rocm-smi": "AMD publishes ROCm (rocm-smi) for x86-64 Linux only: no arm64 build to run",
    },
}


def judge_check(
    report: CheckReport, profile: CommissioningProfile, arch: str | None = None
) -> Verdict:
    """``arch``: the machine's architecture (``machines.arch``); a check whose tool has no
    build for it (``NO_BUILD``) and was found absent is skipped with the reason."""
    spec = profile.check(report.name)
    if spec is None:
        return error(f"check {report.name} is not in profile {profile.name}")
    if report.outcome == "timeout":
        return failed([f"{report.name} did not finish within {spec.timeout_s} s"])
    no_build = NO_BUILD.get(arch or "", {}).get(report.name)
    if report.outcome == "missing" and no_build:
        return skipped(f"{report.name}: {no_build}", arch=arch, no_build=True)
    if report.outcome == "missing":
        sentence = f"{report.name}: tool or device absent on this machine"
        return (
            failed([sentence + " (the profile requires it)"])
            if spec.required
            else skipped(sentence)
        )
    if report.outcome == "error":
        return error(f"{report.name} could not run: {report.raw[:200] or 'no output'}")
    return _parse(report, profile)


def _parse(r: CheckReport, p: CommissioningProfile) -> Verdict:
    raw = r.raw
    spec = p.check(r.name)
    assert spec is not None  # judge_check answered for checks not in the profile
    match r.name:
        case "nvidia-smi":
            return nvidia_smi.judge_health(raw, expected_count=p.gpu_count)
        case "xid":
            return gpu_text.judge_xid(raw)
        case "nvlink":
            return gpu_text.judge_nvlink(raw)
        case "dcgm":
            return dcgm.judge_dcgm(raw)
        case "rocm-smi":
            return rocm_smi.judge_rocm_smi(raw, expected_count=p.gpu_count)
        case "ib":
            if p.ib is None:
                return skipped("the profile expects no InfiniBand port")
            return ib.judge_ib(raw, count=p.ib.count, rate_gbps=p.ib.rate_gbps)
        case "stress-ng":
            v = host.judge_stress_ng(raw)
        case "memtester":
            v = host.judge_memtester(raw, r.exit_code)
        case "edac":
            return host.judge_edac(r.raw_before or "", raw)
        case "smart":
            return host.judge_smart(
                raw,
                max_percentage_used=spec.max_percentage_used,
                min_available_spare=spec.min_available_spare,
                max_media_errors=spec.max_media_errors,
            )
        case "fio":
            return host.judge_fio(
                raw, min_read_mbps=spec.min_read_mbps, min_read_iops=spec.min_read_iops
            )
    if r.exit_code not in (None, 0) and v.status is Status.PASSED:
        return failed([f"{r.name} exited with code {r.exit_code}"], **v.values)
    return v


def summarise(results: list[tuple[str, Verdict]]) -> tuple[Status, str]:
    """A run's outcome: failed if any check failed or erred, naming each; else passed."""
    bad = [(n, v) for n, v in results if not v.ok]
    if not bad:
        return Status.PASSED, f"{len(results)} check(s) passed"
    return Status.FAILED, "; ".join(f"{n}: {v.sentence}" for n, v in bad)[:2000]


def as_values(v: Verdict) -> dict[str, Any]:
    return dict(v.values)
