"""Browser tests of the web console: Debian's chromium driven by Playwright, against a real
metald app on loopback (``tests.api_helpers.LoopbackApi``). One app and one browser per
module; each test opens its own browser context (its own cookies). The browser helpers live
in ``tests.ui_browser`` (the lab's console page test uses them too).

Screenshots go to $METALD_ARTIFACTS/ui (else a temporary folder), printed at the start."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.api_helpers import LoopbackApi, Prepare
from tests.ui_browser import CHROMIUM, artifacts_dir, axe_violations, chromium, login, shoot


# Module scope, not wider: Playwright's sync API keeps an event loop running in this thread
# while the browser is open, and asyncio tests of later modules could not start their own.
@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not Path(CHROMIUM).exists():
        pytest.fail("Debian's chromium is not installed; run scripts/bootstrap")
    with chromium() as b:
        yield b


def serve(tmp: Path, prepare: Prepare | None) -> LoopbackApi:
    return LoopbackApi(f"sqlite:///{tmp / 'metald.db'}", tmp, prepare)


@pytest.fixture(scope="module")
def shots() -> Path:
    out = artifacts_dir()
    print(f"\nweb console screenshots: {out}")
    return out


__all__ = ["axe_violations", "login", "serve", "shoot"]
