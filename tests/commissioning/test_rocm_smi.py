"""AMD GPUs through ``rocm-smi --showallinfo --json``: real captures (telegraf's testdata, see
fixtures/SOURCES.md) and labelled edits of them, judged through ``judge_check``; and the agent's
own invocation with a stand-in rocm-smi that prints a real capture behind a warning line. No
AMD GPU ran these here."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from metald.commissioning.checks import CheckReport, judge_check
from metald.commissioning.profile import CheckSpec, CommissioningProfile

FIX = Path(__file__).parent / "fixtures"
#: 4 x Instinct MI100, ROCm 6.0.2 ("Card series", PCIe 16.0GT/s x16).
MI100 = (FIX / "rocm-smi-json_mi100_rocm602.json").read_text()
#: 1 x Radeon RX 6700 XT, ROCm 6.1.2 ("Card Series": the key changed case; PCIe DPM x1 .. x16).
RX6700 = (FIX / "rocm-smi-json_rx6700xt_rocm612.json").read_text()
COMMISSION = Path(__file__).resolve().parents[2] / "bootassets" / "agent" / "metald-commission"
BUSYBOX = shutil.which("busybox")


def _judge(raw: str, gpu_count: int | None = 4, outcome: str = "ran"):  # type: ignore[no-untyped-def]
    profile = CommissioningProfile(
        name="mi100", gpu_count=gpu_count, checks=[CheckSpec(name="rocm-smi")]
    )
    rep = CheckReport(name="rocm-smi", outcome=outcome, exit_code=0, duration_s=2, raw=raw)
    return judge_check(rep, profile)


def test_real_captures_give_count_model_and_pcie() -> None:
    v = _judge(MI100)
    assert v.status.value == "passed", v.sentence
    assert v.sentence == "4 AMD GPU(s): Arcturus GL-XL [Instinct MI100]"
    assert v.values["driver"] == "6.3.6" and v.values["gpu_count"] == 4
    g = v.values["gpus"][3]
    assert (g["bus"], g["sku"], g["junction_c"]) == ("0000:E3:00.0", "D3431401", 53.0)
    assert (g["pcie_current"], g["pcie_top"], g["pcie_replays"]) == (
        "16.0GT/s x16",
        "16.0GT/s x16",
        0,
    )
    v = _judge(RX6700, gpu_count=1)
    assert v.status.value == "passed", v.sentence
    assert v.values["gpus"][0]["model"] == "Navi 22 [Radeon RX 6700/6700 XT / 6800M]"
    assert v.values["gpus"][0]["pcie_top"] == "16.0GT/s x16"  # of levels x1 and x16


def test_a_missing_gpu_fails_with_the_count() -> None:
    # labelled edit: card2 removed from the MI100 capture (a GPU that fell off the bus)
    doc = json.loads(MI100)
    del doc["card2"]
    v = _judge(json.dumps(doc))
    assert v.status.value == "failed"
    assert v.sentence == "rocm-smi sees 3 GPUs, the profile expects 4"


def test_warnings_around_the_json_and_garbage() -> None:
    v = _judge("WARNING: AMD GPU device(s) is/are in a low-power state\n" + MI100)
    assert v.status.value == "passed"
    assert _judge("ERROR: GPU[0] : Unable to get rocm-smi output").status.value == "error"
    assert _judge('{"system": {"Driver version": "6.3.6"}}').sentence == "rocm-smi reported no GPU"
    # labelled edit: no model key at all on card0
    doc = json.loads(MI100)
    del doc["card0"]["Card series"], doc["card0"]["Card model"]
    assert _judge(json.dumps(doc)).sentence == "card0 reports no model"


def test_absent_tool_is_skipped_unless_required() -> None:
    assert _judge("rocm-smi not found", outcome="missing").status.value == "skipped"


@pytest.mark.skipif(BUSYBOX is None, reason="busybox is not installed")
def test_the_agent_runs_rocm_smi_showallinfo_json(tmp_path: Path) -> None:
    tools = tmp_path / "tools"
    tools.mkdir()
    (tmp_path / "capture.json").write_text(MI100)
    (tools / "rocm-smi").write_text(
        f'#!{BUSYBOX} sh\necho "$@" > {tmp_path}/argv\n'
        f"echo 'WARNING: a warning first'\nexec cat {tmp_path}/capture.json\n"
    )
    (tools / "rocm-smi").chmod(0o755)
    script = (
        f'STATE={tmp_path}; log() {{ :; }}; . "{COMMISSION}"; PATH="{tools}:$PATH"; '
        'run_check rocm-smi 30 0 1 0; echo "$OUTCOME $RC"'
    )
    out = subprocess.run(
        [BUSYBOX, "sh", "-c", script], capture_output=True, text=True, check=True, timeout=30
    )
    assert out.stdout.strip() == "ran 0"
    assert (tmp_path / "argv").read_text().strip() == "--showallinfo --json"
    assert _judge((tmp_path / "c.out").read_text()).status.value == "passed"
