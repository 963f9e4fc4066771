"""One virtual rack for the lab end-to-end tests: 3 machines (2 BIOS, 1 UEFI), metald inside,
BMCs registered by address, powered on through metald, enrolled. Built once per session; the
enrollment test checks how it got there, the claims test takes machines from it."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

READY_TIMEOUT_S = 480
RULES = (
    '[[enroll.rules]]\nmatch = { vendor = "vm-lab" }\nlabels = { pool = "lab" }\n'
    '[[enroll.rules]]\nmatch = { product = "vm-lab bios" }\nlabels = { firmware = "bios" }\n'
    "[provision]\nwatchdog_interval_s = 5\n"
)


def lab_skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces, taps, QEMU)"
    if shutil.which("qemu-system-x86_64") is None:
        return "qemu-system-x86 is not installed"
    return None


def lab_ipxe_assets(into: Path) -> Path:
    """A copy of the built boot assets with metald's own iPXE build in it (``into``), or a
    skip when iPXE's source is not on this machine."""
    from bootassets.build import BuildError, ensure_built
    from bootassets.ipxe import find_source
    from vmlab.labipxe import assets_with_built_ipxe

    try:
        find_source()
    except BuildError as e:
        pytest.skip(str(e))
    return assets_with_built_ipxe(ensure_built(), into)


@dataclass
class EnrolledRack:
    rack: Any
    bmcs: dict[str, dict[str, Any]]
    t_on: dict[str, float]
    ready: dict[str, float]


@pytest.fixture(scope="package")  # down once tests/e2e is done: idle TCG guests cost CPU
def enrolled_rack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EnrolledRack]:
    reason = lab_skip_reason()
    if reason:
        pytest.skip(reason)
    from vmlab.rack import LabRack, tenants_config

    rack = LabRack(
        f"e2e{os.getpid() % 10000}",
        tmp_path_factory.mktemp("rack"),
        machines=3,
        uefi=1,
        extra_config=lambda state: RULES + tenants_config(state),
    )
    try:
        bmcs = rack.register_bmcs(["ipmi", "redfish", "auto"])
        t_on = {}
        for m in rack.machines:
            rack.ctl("bmcs", "power", bmcs[m["name"]]["id"], "on")
            t_on[m["mac"]] = time.monotonic()
        ready = rack.wait_state(list(t_on), "ready", READY_TIMEOUT_S)
        yield EnrolledRack(rack, bmcs, t_on, ready)
    finally:
        rack.down()
