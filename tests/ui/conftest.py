"""Browser tests of the web console: Debian's chromium driven by Playwright, against a real
metald app on loopback (``tests.api_helpers.LoopbackApi``). One app and one browser per
module; each test opens its own browser context (its own cookies).

Never ``playwright install``: the browser is /usr/bin/chromium (scripts/bootstrap installs it).
Screenshots go to $METALD_ARTIFACTS/ui (else a temporary folder), printed at the start."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.api_helpers import LoopbackApi, Prepare

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = "/usr/bin/chromium"
AXE = ROOT / "api" / "ui" / "vendor" / "axe.min.js"
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def artifacts_dir() -> Path:
    base = os.environ.get("METALD_ARTIFACTS")
    out = Path(base) / "ui" if base else Path(tempfile.gettempdir()) / "metald-ui-artifacts"
    out.mkdir(parents=True, exist_ok=True)
    return out


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not Path(CHROMIUM).exists():
        pytest.fail("Debian's chromium is not installed; run scripts/bootstrap")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            yield b
        finally:
            b.close()


def serve(tmp: Path, prepare: Prepare | None) -> LoopbackApi:
    return LoopbackApi(f"sqlite:///{tmp / 'metald.db'}", tmp, prepare)


@pytest.fixture(scope="module")
def shots() -> Path:
    out = artifacts_dir()
    print(f"\nweb console screenshots: {out}")
    return out


def login(browser: Any, base: str, token: str) -> Any:
    """A new browser context logged in with ``token``; its page is on the fleet."""
    ctx = browser.new_context(
        base_url=base, viewport={"width": 1366, "height": 800}, bypass_csp=True
    )
    ctx.set_default_timeout(10_000)
    page = ctx.new_page()
    page.goto("/ui/")
    assert "/ui/login" in page.url
    page.get_by_label("API token").fill(token)
    page.get_by_role("button", name="Log in").click()
    page.wait_for_url(f"{base}/ui/")
    return page


def axe_violations(page: Any) -> list[dict[str, Any]]:
    """axe-core's serious and critical violations on the page as it is now."""
    page.add_script_tag(path=str(AXE))
    result = page.evaluate("async () => (await axe.run(document)).violations")
    return [
        {"id": v["id"], "impact": v["impact"], "nodes": [n["target"] for n in v["nodes"]][:3]}
        for v in result
        if v["impact"] in ("serious", "critical")
    ]


def shoot(page: Any, shots: Path, name: str, *, full: bool = False) -> Path:
    path = shots / f"{name}.png"
    page.screenshot(path=str(path), full_page=full)
    return path


__all__ = ["axe_violations", "login", "serve", "shoot", "shutil"]
