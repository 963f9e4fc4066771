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
