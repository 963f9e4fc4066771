"""``metalctl firmware baselines|baseline|compliance`` against a real metald on loopback."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from metald.config import Config
from metald.metalctl.firmware import fix_argv
from metald.metalctl.main import main
from metald.store import Store
from tests.api_helpers import LoopbackApi
from tests.conftest import Tokens
from tests.firmware.test_api_compliance import BASELINE, H100, _set


def _prepare(cfg: Config, store: Store, tokens: Tokens) -> None:
    cfg.enroll.rules = [H100]
    _set(store, tokens.machine_b, "NVIDIA H100 80GB HBM3", {"BIOS": "2.18.0", "GPU0": "96.00.89"})


@pytest.fixture
def live(db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LoopbackApi]:
    with LoopbackApi(db_url, tmp_path, _prepare) as api:
        assert api.tokens is not None
        monkeypatch.setenv("METALD_URL", api.base)
        yield api


def _run(capsys: Any, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_old_firmware_id_form_still_works() -> None:
    assert fix_argv(["firmware", "node1"]) == ["firmware", "show", "node1"]
    assert fix_argv(["-o", "json", "firmware", "node1"]) == [
        "-o",
        "json",
        "firmware",
        "show",
        "node1",
    ]
    assert fix_argv(["firmware", "compliance"]) == ["firmware", "compliance"]
    assert fix_argv(["machines", "firmware"]) == ["machines", "firmware"]


def test_baselines_and_compliance(
    live: LoopbackApi, tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert live.tokens is not None
    spec = tmp_path / "h100.json"
    spec.write_text(json.dumps(BASELINE))
    monkeypatch.setenv("METALD_TOKEN", live.tokens.technician)
    rc, _, err = _run(capsys, "firmware", "baseline", "h100-8x", "--set", str(spec))
    assert rc == 1 and "403" in err  # technicians do not choose what is flashed
    monkeypatch.setenv("METALD_TOKEN", live.tokens.admin)
    rc, out, _ = _run(capsys, "firmware", "baseline", "h100-8x", "--set", str(spec))
    assert rc == 0 and "profile h100-8x version 1" in out and "host-reset" in out
    monkeypatch.setenv("METALD_TOKEN", live.tokens.technician)
    rc, out, _ = _run(capsys, "firmware", "baselines")
    assert rc == 0 and "BIOS=2.19.1, GPU*=96.00.89" in out
    rc, out, _ = _run(capsys, "firmware", "compliance")
    lines = out.splitlines()
    assert rc == 0 and lines[0].split()[:2] == ["MACHINE", "STATE"]
    assert len(lines) == 2 and "node1" in lines[1] and "BIOS 2.18.0 (want 2.19.1)" in lines[1]
    rc, out, _ = _run(capsys, "firmware", "compliance", "-o", "json")
    assert json.loads(out)["items"][0]["off_baseline"][0]["status"] == "differs"


def test_update_commands_reach_the_api(
    live: LoopbackApi, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """This API runs without the daemon's firmware service: both commands get its 503 and
    say so (the updates themselves are tested through the API against the lab BMC)."""
    assert live.tokens is not None
    monkeypatch.setenv("METALD_TOKEN", live.tokens.technician)
    for argv in (["firmware", "update", "node1", "BIOS"], ["firmware", "updates", "node1"]):
        rc, _, err = _run(capsys, *argv)
        assert rc == 1 and "runs no firmware updates" in err and "HTTP 503" in err, err
    monkeypatch.setenv("METALD_TOKEN", live.tokens.orchestrator)
    rc, _, err = _run(capsys, "firmware", "update", "node1")
    assert rc == 1 and "HTTP 403" in err


def test_rollout_commands(
    live: LoopbackApi, tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rollout started, listed with its progress bar, paused and shown; technicians read
    but do not start (its waves run in the daemon's service, tested in test_rollouts)."""
    from metald.metalctl.firmware import bar

    assert live.tokens is not None
    spec = tmp_path / "h100.json"
    spec.write_text(json.dumps(BASELINE))
    monkeypatch.setenv("METALD_TOKEN", live.tokens.admin)
    assert _run(capsys, "firmware", "baseline", "h100-8x", "--set", str(spec))[0] == 0
    monkeypatch.setenv("METALD_TOKEN", live.tokens.technician)
    rc, _, err = _run(capsys, "firmware", "rollout", "start", "h100-8x", "1")
    assert rc == 1 and "403" in err
    monkeypatch.setenv("METALD_TOKEN", live.tokens.admin)
    rc, out, err = _run(capsys, "firmware", "rollout", "start", "h100-8x", "1",
                        "--batch-size", "5", "--in-use", "wait")  # fmt: skip
    assert rc == 0, err
    assert "running [" in out and "0 done" in out and "machines in use: wait" in out
    rid = out.split()[1].rstrip(":")
    monkeypatch.setenv("METALD_TOKEN", live.tokens.technician)
    rc, out, _ = _run(capsys, "firmware", "rollouts")
    lines = out.splitlines()
    assert rc == 0 and lines[0].split()[:4] == ["ID", "PROFILE", "VERSION", "STATE"]
    assert rid[:8] in lines[1] and "[" in lines[1] and "0%" in lines[1]
    monkeypatch.setenv("METALD_TOKEN", live.tokens.admin)
    rc, out, _ = _run(capsys, "firmware", "rollout", "pause", rid)
    assert rc == 0 and "paused" in out
    rc, out, _ = _run(capsys, "firmware", "rollouts", rid)
    assert rc == 0 and "pending" in out and live.tokens.machine_b in out
    progress = {"total": 4, "done": 2, "failed": 1, "skipped": 0, "updating": 1, "percent": 75}
    assert bar(progress, width=8) == "[####!!>>] 75%"
