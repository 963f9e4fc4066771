"""An arm64 machine end to end, for real: a QEMU "virt" board with AAVMF (Debian's arm64 UEFI
firmware), under TCG, with a virtual BMC, PXE-boots through metald: DHCP sees architecture 11
and hands out metald's own arm64 iPXE (Debian ships none), whose per-machine script loads the
discovery image built from Debian's arm64 packages; the agent reports the inventory and the
machine reaches ready with arch arm64. TCG emulating arm64 is slow: under METALD_LAB_LONG=1
(make test-long), and it prints its power-on-to-ready time.
"""

from __future__ import annotations

import os
import shutil
import time

import pytest

from tests.e2e.conftest import RULES, lab_skip_reason

pytestmark = [pytest.mark.lab, pytest.mark.root]

READY_TIMEOUT_S = 1200


def _skip_reason() -> str | None:
    if os.environ.get("METALD_LAB_LONG") != "1":
        return "an emulated arm64 machine takes minutes: set METALD_LAB_LONG=1 (make test-long)"
    if shutil.which("qemu-system-aarch64") is None:
        return "qemu-system-arm is not installed"
    from vmlab.qemu import AAVMF_CODE

    if not AAVMF_CODE.exists():
        return "qemu-efi-aarch64 (AAVMF) is not installed"
    return lab_skip_reason()


def test_an_arm64_machine_pxe_boots_and_reaches_ready(tmp_path) -> None:  # type: ignore[no-untyped-def]
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    from vmlab.rack import LabRack

    t_build = time.monotonic()
    rack = LabRack(
        f"a64-{os.getpid() % 10000}",
        tmp_path / "rack",
        machines=1,
        uefi=1,
        arm64=1,
        extra_config=RULES,
    )
    built_s = time.monotonic() - t_build
    try:
        (m,) = rack.machines
        assert m["arch"] == "arm64"
        bmcs = rack.register_bmcs(["redfish"])
        rack.ctl("bmcs", "power", bmcs[m["name"]]["id"], "on")
        t_on = time.monotonic()
        ready = rack.wait_state([m["mac"]], "ready", READY_TIMEOUT_S)
        secs = ready[m["mac"]] - t_on
        item = rack.machine_by_mac(m["mac"])
        assert item is not None
        full = rack.json("machines", "show", item["id"])
        # DHCP option 93 said arm64 UEFI; the agent's uname -m said aarch64
        assert full["firmware"] == "uefi-arm64"
        assert full["arch"] == "arm64"
        assert full["inventory"]["payload"]["cpu"]["arch"] == "aarch64"
        assert full["inventory"]["normalized"]["arch"] == "arm64"
        assert full["cpu_count"] == m["cpus"]
        assert full["system_uuid"] == m["uuid"].lower()
        inv = full["inventory"]["normalized"]
        assert m["mac"] in [n["mac"] for n in inv["nics"]]
        assert 2 * 1024**3 in [d["size_bytes"] for d in inv["disks"]], inv["disks"]
        # the arm64 iPXE came over TFTP, the arm64 kernel over HTTP; the x86 ones never did
        serial = (rack.lab.dir / f"{m['name']}.serial.log").read_text(errors="replace")
        assert "aarch64" in serial or "arm64" in serial
        listed = rack.json("machines", "list", "--arch", "arm64")["items"]
        assert [x["id"] for x in listed] == [item["id"]]
        print(
            f"\narm64 ({rack.state['accel']}: TCG, virt board, AAVMF) power-on to ready: "
            f"{secs:.1f} s (assets and lab up in {built_s:.1f} s)"
        )
    finally:
        rack.down()
