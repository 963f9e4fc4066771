"""The web console's Firmware page: the machines off their baseline, for staff; no link and a
refusal for an orchestrator."""

from __future__ import annotations

from pathlib import Path

import requests

from metald.firmware.baselines import BaselineSpec, Component
from metald.firmware.records import add_baseline
from tests.firmware.test_metalctl_firmware import _prepare
from tests.ui.conftest import serve


def _login(base: str, token: str) -> requests.Session:
    http = requests.Session()
    r = http.post(base + "/ui/login", data={"token": token}, allow_redirects=False)
    assert r.status_code == 303, r.text
    return http


def test_firmware_page_lists_machines_off_baseline(tmp_path: Path) -> None:
    with serve(tmp_path, _prepare) as app:
        assert app.tokens is not None
        with app.store.session() as s:
            spec = BaselineSpec(components=[Component(id="BIOS", version="2.19.1")])
            add_baseline(s, "h100-8x", spec, note=None, actor="test", instance="test")
        http = _login(app.base, app.tokens.technician)
        r = http.get(app.base + "/ui/firmware", timeout=10)
        assert r.status_code == 200, r.text
        assert "node1" in r.text and "BIOS: 2.18.0 (want 2.19.1)" in r.text
        assert 'href="/ui/firmware"' in http.get(app.base + "/ui/", timeout=10).text
        orch = _login(app.base, app.tokens.orchestrator)
        assert 'href="/ui/firmware"' not in orch.get(app.base + "/ui/claims", timeout=10).text
        r = orch.get(app.base + "/ui/firmware", timeout=10)
        assert r.status_code == 403, r.text[:500]


def test_firmware_page_shows_rollouts_with_progress(tmp_path: Path) -> None:
    from metald.firmware.waves import TargetStatus
    from metald.store.models import FirmwareRollout, FirmwareRolloutTarget

    with serve(tmp_path, _prepare) as app:
        assert app.tokens is not None
        with app.store.session() as s:
            r = FirmwareRollout(profile="h100-8x", baseline_version=1, batch_size=2,
                                max_unavailable=2, failure_budget=1, in_use="skip",
                                state="stopped", reason="the failure budget of 1 is spent",
                                created_by="test")  # fmt: skip
            s.add(r)
            s.flush()
            for i, st in enumerate([TargetStatus.DONE, TargetStatus.FAILED, TargetStatus.PENDING]):
                s.add(FirmwareRolloutTarget(rollout_id=r.id, machine_id=f"m{i}", seq=i,
                                            status=st.value, wave=1 if i < 2 else None))  # fmt: skip
            s.commit()
            rid = r.id
        http = _login(app.base, app.tokens.technician)
        text = http.get(app.base + "/ui/firmware", timeout=10).text
        assert rid[:8] in text and 'max="3" value="2"' in text and "67%" in text
        assert "1 done, 1 failed" in text and "failure budget" in text
