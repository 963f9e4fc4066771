"""A check whose tool has no build for the machine's architecture (rocm-smi on arm64) is
skipped with that reason, even where the profile requires it: the absence is known, not a
fault. Every other absent tool is judged as before (a required one fails)."""

from __future__ import annotations

import pytest

from metald.commissioning.checks import NO_BUILD, CheckReport, judge_check
from metald.commissioning.profile import CheckSpec, CommissioningProfile


def _judge(name: str, arch: str | None, outcome: str = "missing", raw: str = ""):  # type: ignore[no-untyped-def]
    profile = CommissioningProfile(
        name="grace", gpu_count=4, checks=[CheckSpec(name=name, required=True)]
    )
    rep = CheckReport(name=name, outcome=outcome, duration_s=0.1, raw=raw or f"{name} not found")
    return judge_check(rep, profile, arch)


def test_rocm_smi_on_arm64_is_skipped_with_the_reason() -> None:
    v = _judge("rocm-smi", "arm64")
    assert v.status.value == "skipped"
    assert v.sentence == f"rocm-smi: {NO_BUILD['arm64']['rocm-smi']}"
    assert v.values == {"arch": "arm64", "no_build": True}


@pytest.mark.parametrize("arch", ["amd64", None])
def test_a_required_rocm_smi_missing_on_amd64_still_fails(arch: str | None) -> None:
    v = _judge("rocm-smi", arch)
    assert v.status.value == "failed"
    assert "the profile requires it" in v.sentence


@pytest.mark.parametrize("name", ["stress-ng", "memtester", "fio", "nvidia-smi", "dcgm"])
def test_tools_with_an_arm64_build_still_fail_when_missing_on_arm64(name: str) -> None:
    v = _judge(name, "arm64")
    assert v.status.value == "failed", v.sentence


def test_a_rocm_smi_that_ran_on_arm64_is_judged_on_its_output() -> None:
    """Only an absent tool is skipped: output (someone's own build) is read as always."""
    v = _judge("rocm-smi", "arm64", outcome="ran", raw="{}")
    assert v.status.value != "skipped"
