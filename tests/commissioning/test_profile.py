"""The SKU comparison: one sentence naming every difference between inventory and profile."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from metald.commissioning.profile import (
    CommissioningProfile,
    DiskSpec,
    IbSpec,
    NicSpec,
    compare_sku,
)
from metald.commissioning.verdict import Status
from metald.config import EnrollConfig
from metald.inventory.normalize import DiskFacts, GpuFacts, NicFacts, NormalizedInventory
from metald.inventory.rules import EnrollmentRule, profile_for


def _gpu(model: str) -> GpuFacts:
    return GpuFacts(vendor_id="0x10de", device_id="0x2330", model=model, family="H100")


def inventory(
    gpus: int = 8,
    model: str = "NVIDIA H100 80GB HBM3",
    memory_gib: int = 2048,
    disk_bytes: int = 3_840_755_982_336,
    nic_mbps: int = 25000,
) -> NormalizedInventory:
    return NormalizedInventory(
        cpu_model="Intel(R) Xeon(R) Platinum 8480+",
        cpu_count=224,
        memory_mb=memory_gib * 1024,
        gpus=[_gpu(model) for _ in range(gpus)],
        gpu_model=model if gpus else None,
        gpu_count=gpus,
        disks=[DiskFacts(name="nvme0n1", size_bytes=disk_bytes, rotational=False)],
        nics=[
            NicFacts(name="eno1", mac="02:00:00:00:00:01", link=True, speed_mbps=nic_mbps),
            NicFacts(name="ens1", mac="02:00:00:00:00:02", link=False, speed_mbps=None),
        ],
    )


XE9680 = CommissioningProfile(
    name="xe9680",
    gpu_model="NVIDIA H100*",
    gpu_count=8,
    min_memory_gb=2000,
    cpu_model="*8480*",
    min_cpu_count=224,
    nics=[NicSpec(speed_mbps=25000)],
    disks=[DiskSpec(min_size_gb=3800)],
)


def test_matching_machine_passes() -> None:
    v = compare_sku(XE9680, inventory())
    assert v.status is Status.PASSED and v.sentence == "hardware matches profile xe9680"


def test_every_difference_is_named_in_one_sentence() -> None:
    inv = inventory(gpus=7, memory_gib=1024, disk_bytes=1_920_383_410_176, nic_mbps=10000)
    v = compare_sku(XE9680, inv)
    assert v.sentence == (
        "expected 8 GPUs, found 7; "
        "expected at least 2000 GiB of memory, found 1024.0 GiB; "
        "expected 1 NIC(s) linked at 25000 Mb/s or more, found 0 "
        "(eno1 10000 Mb/s, ens1 ? Mb/s (no link)); "
        "expected 1 disk(s) of 3800 GB or more, found 0 (nvme0n1 1920.4 GB)"
    )


def test_wrong_gpu_model_and_no_gpu() -> None:
    v = compare_sku(XE9680, inventory(model="NVIDIA A100-SXM4-80GB"))
    assert v.sentence.startswith("expected GPUs NVIDIA H100*, found NVIDIA A100-SXM4-80GB")
    v = compare_sku(XE9680, inventory(gpus=0))
    assert v.sentence.startswith("expected GPUs NVIDIA H100*, found no GPU; expected 8 GPUs")


def test_profiles_come_from_the_last_matching_rule_and_reject_unknown_keys() -> None:
    other = XE9680.model_copy(update={"name": "burn-in"})
    rules = [
        EnrollmentRule(match={"gpu_model": "*H100*"}, commissioning=XE9680),
        EnrollmentRule(match={"gpu_model": "*A100*"}, commissioning=other),
        EnrollmentRule(labels={"x": "y"}),
    ]
    assert profile_for(rules, inventory(), None) is XE9680
    assert profile_for(rules, inventory(gpus=0), None) is None
    with pytest.raises(ValidationError):
        EnrollConfig.model_validate({"rules": [{"commissioning": {"name": "p", "gpu_cuont": 8}}]})
    with pytest.raises(ValidationError):
        CommissioningProfile(name="p", checks=[{"name": "gpu-burn"}])  # type: ignore[list-item]
    assert IbSpec(count=4, rate_gbps=400).count == 4


def test_the_documented_toml_loads() -> None:
    """The profile example of docs/commissioning.md is valid configuration."""
    import re
    import tomllib
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "commissioning.md").read_text()
    block = re.search(r"```toml\n(.*?)```", doc, re.S)
    assert block is not None
    cfg = EnrollConfig.model_validate(tomllib.loads(block.group(1))["enroll"])
    prof = cfg.rules[0].commissioning
    assert prof is not None and prof.name == "hgx-h100" and len(prof.checks) == 11
    assert prof.check("fio").required  # type: ignore[union-attr]
    assert prof.check("fio").min_read_mbps == 2000  # type: ignore[union-attr]
    assert prof.check("smart").max_percentage_used == 10  # type: ignore[union-attr]
    # bmc-sel is metald's own: in the profile, never in the agent's plan
    assert prof.check("bmc-sel") is not None
    assert "bmc-sel" not in [c["name"] for c in prof.plan()]
