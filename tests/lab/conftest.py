"""The lab tests build real labs: namespaces, bridges, taps, QEMU machines (TCG here) and
virtual BMCs. They need root, QEMU, ipmitool and curl; a lab is removed after its tests."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .labtools import vlab

TOOLS = ("qemu-system-x86_64", "qemu-img", "ipmitool", "curl", "nsenter", "ip")


def lab_prerequisites() -> str | None:
    if os.geteuid() != 0:
        return "vm-lab needs root (network namespaces, taps, QEMU)"
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        return f"vm-lab needs {', '.join(missing)}"
    return None


@pytest.fixture(scope="session")
def lab_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vmlab")


@pytest.fixture(scope="package")  # down once tests/lab is done: idle TCG guests cost CPU
def lab(lab_home: Path) -> Iterator[vlab.Lab]:
    """One lab for the session: m0 boots SeaBIOS, m1 boots OVMF."""
    reason = lab_prerequisites()
    if reason:
        pytest.skip(reason)
    rack = vlab.Lab(f"t{os.getpid()}a", machines=2, uefi=1, workdir=lab_home, cpus=1)
    rack.up()
    try:
        yield rack
    finally:
        rack.down()


@pytest.fixture
def state(lab: vlab.Lab) -> dict[str, Any]:
    return lab.state


@pytest.fixture
def bios(state: dict[str, Any]) -> dict[str, Any]:
    return next(m for m in state["machines"] if m["firmware"] == "bios")


@pytest.fixture
def uefi(state: dict[str, Any]) -> dict[str, Any]:
    return next(m for m in state["machines"] if m["firmware"] == "uefi")
