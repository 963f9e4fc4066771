"""Shared paths and builders for the inventory tests (payloads from vmlab.inventory)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from vmlab.inventory import BOOT_ID, payload  # noqa: F401 - the inventory tests import them from here

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "gpu"
AGENT = ROOT / "bootassets" / "agent" / "metald-agent"


def fixture_text(name: str) -> str:
    return (FIXTURES / name).read_text()


def nvidia_smi_q_gpus(text: str) -> list[dict[str, str]]:
    """Product Name, Device Id and Bus Id of each GPU in the first ``nvidia-smi -q`` section."""
    if "# $ nvidia-smi -q\n" in text:  # capture bundles: several commands, one "-q" section each
        text = text.split("# $ nvidia-smi -q\n", 1)[1].split("\n# $ ", 1)[0]
    gpus: list[dict[str, str]] = []
    for line in text.splitlines():
        m = re.match(r"^\s*(Product Name|Device Id|Bus Id)\s+: (.*)$", line)
        if not m:
            continue
        if m[1] == "Product Name":
            gpus.append({})
        if gpus and m[1] not in gpus[-1]:
            gpus[-1][m[1]] = m[2].strip()
    return gpus


@pytest.fixture
def valid_payload() -> dict[str, Any]:
    return payload()


@pytest.fixture(scope="session")
def built_assets() -> Path:
    """The discovery image, built once into the cache (about 25 s the first time, then reused)."""
    import shutil

    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        pytest.skip("building boot assets needs apt-get and dpkg-deb (Debian)")
    from bootassets.build import ensure_built

    return ensure_built()
