"""Debian's chromium driven by Playwright, shared by the web console's browser tests
(tests/ui) and the lab's console page test (tests/lab/test_console_lab.py, which runs it
inside the lab's network namespace).

Never ``playwright install``: the browser is /usr/bin/chromium (scripts/bootstrap installs it).
Screenshots go to $METALD_ARTIFACTS/ui (else a temporary folder)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
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


@contextmanager
def chromium() -> Iterator[Any]:
    """A headless Debian chromium under Playwright's sync API."""
    if not Path(CHROMIUM).exists():
        raise RuntimeError("Debian's chromium is not installed; run scripts/bootstrap")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            yield b
        finally:
            b.close()


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


def open_as(browser: Any, base: str, token: str, path: str = "/ui/") -> Any:
    """A new browser context with a session for ``token``, its page at ``path``. The session
    is opened by posting the login form from the context (same route, same cookie) without
    loading the login page: for tests about something else than the login form."""
    ctx = browser.new_context(
        base_url=base, viewport={"width": 1366, "height": 800}, bypass_csp=True
    )
    ctx.set_default_timeout(10_000)
    r = ctx.request.post("/ui/login", form={"token": token}, max_redirects=0)
    assert r.status == 303, r.text()
    page = ctx.new_page()
    page.goto(path)
    assert page.url == base + path, page.url
    return page


def axe_violations(page: Any) -> list[dict[str, Any]]:
    """axe-core's serious and critical violations on the page as it is now."""
    page.add_script_tag(path=str(AXE))
    # Only violations are read: axe then skips gathering the passes and incomplete checks.
    result = page.evaluate(
        "async () => (await axe.run(document, {resultTypes: ['violations']})).violations"
    )
    return [
        {"id": v["id"], "impact": v["impact"], "nodes": [n["target"] for n in v["nodes"]][:3]}
        for v in result
        if v["impact"] in ("serious", "critical")
    ]


def shoot(page: Any, shots: Path, name: str, *, full: bool = False) -> Path:
    path = shots / f"{name}.png"
    page.screenshot(path=str(path), full_page=full)
    return path
