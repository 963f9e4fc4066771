"""The check parsers against real captures, and failure cases derived from them by labelled
edits (never an invented capture called real)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from metald.commissioning.parsers import dcgm, gpu_text, host, ib, nvidia_smi
from metald.commissioning.verdict import Status

HERE = Path(__file__).parent / "fixtures"
GPU = Path("/work/shared/fixtures/gpu")
A100_XML = GPU / "nvidia-smi-q-x_a100-sxm4-80gb_mig_drv535.54.03.xml"
H200_BUNDLE = GPU / "nvgpu-exporter-capture_linux-x86_64__nvidia-h200__590.48.01.txt"
needs_gpu_fixtures = pytest.mark.skipif(not GPU.is_dir(), reason="shared GPU fixtures absent")


def _a100() -> str:
    return A100_XML.read_text()


def _a100_whole() -> str:
    """DERIVED: the real A100 capture holds one <gpu> of the 4 its header counts (cut upstream);
    the header is edited to 1 so the document describes the one GPU it holds."""
    return _a100().replace("<attached_gpus>4</attached_gpus>", "<attached_gpus>1</attached_gpus>")


@needs_gpu_fixtures
def test_real_a100_capture_is_read_and_its_missing_gpus_named() -> None:
    v = nvidia_smi.judge_health(_a100())
    # Upstream cut three GPUs out of the file: exactly what a GPU fallen off the bus looks like.
    assert v.status is Status.FAILED
    assert v.sentence == "nvidia-smi reports 4 attached GPUs but describes 1"
    g = v.values["gpus"][0]
    assert (g["product"], g["vbios"], g["persistence_mode"]) == (
        "NVIDIA A100-SXM4-80GB",
        "92.00.36.00.02",
        "Disabled",
    )
    assert (g["pcie_gen"], g["pcie_gen_max"], g["pcie_width"], g["pcie_width_max"]) == (
        4,
        4,
        16,
        16,
    )
    assert v.values["driver"] == "535.54.03"


@needs_gpu_fixtures
def test_a100_healthy_passes_and_profile_count_is_checked() -> None:
    v = nvidia_smi.judge_health(_a100_whole(), expected_count=1)
    assert v.status is Status.PASSED, v.sentence
    v = nvidia_smi.judge_health(_a100_whole(), expected_count=8)
    assert v.sentence == "nvidia-smi sees 1 GPUs, the profile expects 8"


@needs_gpu_fixtures
def test_derived_pcie_x8_on_x16_fails() -> None:
    # DERIVED: current link width edited from 16x to 8x.
    xml = _a100_whole().replace(
        "<current_link_width>16x</current_link_width>",
        "<current_link_width>8x</current_link_width>",
    )
    v = nvidia_smi.judge_health(xml)
    assert v.sentence == "GPU 00000000:01:00.0 PCIe link at x8, below its maximum x16"


@needs_gpu_fixtures
def test_derived_ecc_uncorrectable_fails_volatile_first() -> None:
    # DERIVED: volatile and aggregate DRAM uncorrectable counts edited from 0 to 2.
    xml = _a100_whole().replace(
        "<dram_uncorrectable>0</dram_uncorrectable>", "<dram_uncorrectable>2</dram_uncorrectable>"
    )
    v = nvidia_smi.judge_health(xml)
    assert v.status is Status.FAILED
    assert "2 uncorrectable ECC errors since the driver loaded" in v.sentence
    assert v.values["gpus"][0]["ecc_aggregate"]["uncorrectable"] == 2


@needs_gpu_fixtures
def test_derived_remap_pending_and_hw_slowdown_fail() -> None:
    # DERIVED: remapped_rows N/A replaced by the element layout of drivers with row remapping,
    # pending set; HW slowdown set Active.
    xml = _a100_whole().replace(
        "<remapped_rows>N/A</remapped_rows>",
        "<remapped_rows><remapped_row_corr>0</remapped_row_corr><remapped_row_unc>1"
        "</remapped_row_unc><remapped_row_pending>Yes</remapped_row_pending>"
        "<remapped_row_failure>No</remapped_row_failure></remapped_rows>",
    )
    xml = xml.replace(
        "<clocks_event_reason_hw_slowdown>Not Active</clocks_event_reason_hw_slowdown>",
        "<clocks_event_reason_hw_slowdown>Active</clocks_event_reason_hw_slowdown>",
    )
    v = nvidia_smi.judge_health(xml)
    assert "row remapping pending" in v.sentence
    assert "clocks slowed down by hw_slowdown" in v.sentence


def test_nvidia_smi_refuses_entities_and_foreign_xml() -> None:
    assert nvidia_smi.judge_health('<!DOCTYPE x [<!ENTITY a "b">]><x/>').status is Status.ERROR
    assert nvidia_smi.judge_health("<html/>").status is Status.ERROR
    assert nvidia_smi.judge_health("nvidia-smi: not found").status is Status.ERROR


def _section(bundle: str, command: str) -> str:
    """One section of the exporter's capture bundle (split on its '# $ <command>' headers)."""
    parts = re.split(r"^# \$ (.*)$", bundle, flags=re.MULTILINE)
    for head, body in zip(parts[1::2], parts[2::2], strict=True):
        if head.strip() == command:
            return body
    raise AssertionError(f"no section {command!r}")


@needs_gpu_fixtures
def test_real_h200_nvlink_all_up_and_derived_inactive_link_fails() -> None:
    text = _section(H200_BUNDLE.read_text(), "nvidia-smi nvlink -s")
    v = gpu_text.judge_nvlink(text, links_per_gpu=18)
    assert v.status is Status.PASSED and v.sentence == "18 NVLink link(s) up on 1 GPU(s)"
    # DERIVED: link 7's bandwidth replaced by the driver's <inactive> marker.
    broken = text.replace("Link 7: 26.562 GB/s", "Link 7: <inactive>")
    assert gpu_text.judge_nvlink(broken).sentence == "GPU 0 NVLink link(s) 7 inactive"


def test_xid_79_fails_and_application_xids_pass() -> None:
    # The kernel's NVRM line format; XID 79 ("GPU has fallen off the bus") with its usual text.
    log = (
        "[ 1.0] nvidia: loading out-of-tree module\n"
        "[ 5.0] NVRM: Xid (PCI:0000:3b:00): 13, pid=1234, Graphics Exception\n"
    )
    assert gpu_text.judge_xid(log).status is Status.PASSED
    log += "[ 9.0] NVRM: Xid (PCI:0000:3b:00): 79, pid=0, GPU has fallen off the bus.\n"
    v = gpu_text.judge_xid(log)
    assert v.sentence == "XID 79 on GPU 0000:3b:00 (pid=0, GPU has fallen off the bus.)"


def test_dcgm_fail_and_warn_are_named() -> None:
    doc = {
        "DCGM GPU Diagnostic": {
            "test_categories": [
                {
                    "category": "Hardware",
                    "tests": [
                        {"name": "GPU Memory", "results": [{"gpu_id": "0", "status": "Pass"}]},
                        {
                            "name": "Diagnostic",
                            "results": [{"gpu_id": "1", "status": "Fail", "warnings": "row remap"}],
                        },
                    ],
                }
            ]
        }
    }
    v = dcgm.judge_dcgm(json.dumps(doc))
    assert v.sentence == "dcgm Diagnostic failed on GPU 1: row remap"
    assert dcgm.judge_dcgm("{}").status is Status.ERROR


def test_real_smartctl_healthy_nvme_passes() -> None:
    v = host.judge_smart((HERE / "smartctl-j_nvme-intel-ssdpeknw010t8_pass.json").read_text())
    assert v.status is Status.PASSED
    assert v.values["disks"][0]["model"] == "INTEL SSDPEKNW010T8"


def test_real_smartctl_passed_with_media_errors_fails() -> None:
    """The drive says PASSED; its 7 media errors say otherwise."""
    v = host.judge_smart((HERE / "smartctl-x-j_nvme-samsung-970evo_media-errors.json").read_text())
    assert v.status is Status.FAILED
    assert v.sentence == "/dev/nvme0 has 7 NVMe media errors"


def test_real_smartctl_that_could_not_open_the_disk_is_an_error_not_a_pass() -> None:
    v = host.judge_smart((HERE / "smartctl-j_open-failed_exit2.json").read_text())
    assert v.status is Status.ERROR
    assert "read no SMART data from /dev/sda" in v.sentence


def test_real_smartctl_on_a_virtio_disk_is_skipped_not_an_error() -> None:
    # A QEMU virtio disk has no SMART interface at all: a healthy VM must not fail on it.
    v = host.judge_smart("[" + (HERE / "smartctl-j_virtio-no-smart_exit1.json").read_text() + "]")
    assert v.status is Status.SKIPPED
    assert "/dev/vda" in v.sentence and "no disk has a SMART interface" in v.sentence
    assert v.values["without_smart"] == ["/dev/vda"]


def test_smart_disks_with_smart_are_judged_next_to_one_without() -> None:
    virtio = (HERE / "smartctl-j_virtio-no-smart_exit1.json").read_text()
    bad = (HERE / "smartctl-x-j_nvme-samsung-970evo_media-errors.json").read_text()
    v = host.judge_smart(f"[{virtio},{bad}]")
    assert v.status is Status.FAILED
    assert v.sentence == "/dev/nvme0 has 7 NVMe media errors"
    assert v.values["without_smart"] == ["/dev/vda"]


def test_smart_overall_failed_derived() -> None:
    # DERIVED: the healthy capture with smart_status.passed edited to false.
    doc = json.loads((HERE / "smartctl-j_nvme-intel-ssdpeknw010t8_pass.json").read_text())
    doc["smart_status"]["passed"] = False
    v = host.judge_smart(json.dumps(doc))
    assert v.sentence == "/dev/testfoobarpass SMART overall health failed"


def test_fio_stress_memtester_edac_ib() -> None:
    fio = {"jobs": [{"jobname": "read", "error": 0, "read": {"bw": 102400}}]}
    assert host.judge_fio(json.dumps(fio)).values["jobs"][0]["read_mbps"] == 104.9
    v = host.judge_fio(json.dumps(fio), min_read_mbps=500)
    assert v.sentence == "fio job read read 104.9 MB/s, below the profile's 500 MB/s"
    fio["jobs"][0]["error"] = 5
    assert host.judge_fio(json.dumps(fio)).status is Status.FAILED
    assert host.judge_stress_ng("stress-ng: info: [1] successful run completed in 10.00s\n").ok
    bad = "stress-ng: fail: [9] cpu: verify failed\nstress-ng: info: unsuccessful run completed\n"
    assert host.judge_stress_ng(bad).status is Status.FAILED
    assert host.judge_stress_ng("killed").status is Status.ERROR
    assert host.judge_memtester("Loop 1/1:\n  Stuck Address : ok\nDone.\n", 0).ok
    v = host.judge_memtester("  Random Value : FAILURE: 0x1 != 0x3 at offset 0x8.\n", 2)
    assert v.status is Status.FAILED
    assert host.judge_edac(
        "mc0/ce_count 1\nmc0/ue_count 0\n", "mc0/ce_count 1\nmc0/ue_count 0\n"
    ).ok
    v = host.judge_edac("mc0/ce_count 1\nmc0/ue_count 0\n", "mc0/ce_count 4\nmc0/ue_count 0\n")
    assert v.sentence == "EDAC mc0/ce_count grew from 1 to 4 during the run"
    assert host.judge_edac("", "").status is Status.SKIPPED
    ports = "mlx5_0/1 4: ACTIVE 400 Gb/sec (4X NDR)\nmlx5_1/1 1: DOWN 10 Gb/sec (4X SDR)\n"
    v = ib.judge_ib(ports, count=2, rate_gbps=400)
    assert v.sentence == (
        "expected 2 InfiniBand port(s) active at 400 Gb/s or more, found 1 "
        "(mlx5_0/1 ACTIVE 400 Gb/s, mlx5_1/1 DOWN 10 Gb/s)"
    )
