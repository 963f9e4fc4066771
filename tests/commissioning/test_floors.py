"""Per-profile floors: NVMe wear, available spare and media errors from real smartctl -j
captures (fixtures/SOURCES.md), and fio read bandwidth / IOPS minimums, judged through
``judge_check`` with the profile's check spec (the path the agent's reports take)."""

from __future__ import annotations

import json
from pathlib import Path

from metald.commissioning.checks import CheckReport, judge_check
from metald.commissioning.profile import CheckSpec, CommissioningProfile

FIX = Path(__file__).parent / "fixtures"
#: Samsung 970 EVO: PASSED, 3 % used, 99 % spare (threshold 10), 7 media errors.
SAMSUNG = (FIX / "smartctl-x-j_nvme-samsung-970evo_media-errors.json").read_text()
#: Intel SSDPEKNW010T8: 0 % used, 100 % spare, no media error.
INTEL = (FIX / "smartctl-j_nvme-intel-ssdpeknw010t8_pass.json").read_text()


def _judge(spec: CheckSpec, raw: str):  # type: ignore[no-untyped-def]
    profile = CommissioningProfile(name="floors", checks=[spec])
    rep = CheckReport(name=spec.name, outcome="ran", exit_code=0, duration_s=1, raw=raw)
    return judge_check(rep, profile)


def test_nvme_floors_from_the_profile() -> None:
    v = _judge(CheckSpec(name="smart"), SAMSUNG)
    assert v.status.value == "failed" and "7 NVMe media errors" in v.sentence
    v = _judge(CheckSpec(name="smart", max_media_errors=10), SAMSUNG)
    assert v.status.value == "passed", v.sentence
    assert v.values["disks"][0]["available_spare"] == 99
    v = _judge(CheckSpec(name="smart", max_media_errors=10, max_percentage_used=2), SAMSUNG)
    assert v.status.value == "failed"
    assert v.sentence == "/dev/nvme0 NVMe 3 % worn, above the profile's 2 %"
    v = _judge(CheckSpec(name="smart", max_media_errors=10, min_available_spare=100), SAMSUNG)
    assert v.sentence == "/dev/nvme0 NVMe available spare 99 %, below the profile's 100 %"
    v = _judge(CheckSpec(name="smart", max_media_errors=5), SAMSUNG)
    assert v.sentence == "/dev/nvme0 has 7 NVMe media errors (the profile allows 5)"
    v = _judge(CheckSpec(name="smart", max_percentage_used=0, min_available_spare=100), INTEL)
    assert v.status.value == "passed", v.sentence


def test_nvme_spare_below_the_drives_own_threshold_fails_without_a_profile_floor() -> None:
    # labelled edit of the Intel capture: spare 5 %, under the drive's threshold of 10 %
    doc = json.loads(INTEL)
    doc["nvme_smart_health_information_log"]["available_spare"] = 5
    v = _judge(CheckSpec(name="smart"), json.dumps(doc))
    assert v.status.value == "failed" and "below the drive's 10 %" in v.sentence


FIO = json.dumps({"jobs": [{"jobname": "read", "error": 0, "read": {"bw": 512000, "iops": 500.0}}]})


def test_fio_floors_from_the_profile() -> None:
    assert _judge(CheckSpec(name="fio"), FIO).status.value == "passed"
    v = _judge(CheckSpec(name="fio", min_read_mbps=600), FIO)
    assert v.sentence == "fio job read read 524.3 MB/s, below the profile's 600 MB/s"
    v = _judge(CheckSpec(name="fio", min_read_mbps=500, min_read_iops=1000), FIO)
    assert v.sentence == "fio job read read 500 IOPS, below the profile's 1000 IOPS"
    v = _judge(CheckSpec(name="fio", min_read_mbps=500, min_read_iops=400), FIO)
    assert v.status.value == "passed" and v.values["jobs"][0]["read_iops"] == 500
