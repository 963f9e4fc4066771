"""An arm64 machine end to end, for real: a QEMU "virt" board with AAVMF (Debian's arm64 UEFI
firmware), under TCG, with a virtual BMC, PXE-boots through metald: DHCP sees architecture 11
and hands out metald's own arm64 iPXE (Debian ships none), whose per-machine script loads the
discovery image built from Debian's arm64 packages; the agent reports the inventory and the
machine reaches ready with arch arm64. Then a tenant claims it with the arm64 node image
(declared arm64: an amd64 claim cannot take it) and it joins the tenant's Slurm. TCG emulating
arm64 is slow: under METALD_LAB_LONG=1 (make test-long); it prints its times.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests import waiting
from tests.e2e.conftest import RULES, lab_skip_reason

pytestmark = [pytest.mark.lab, pytest.mark.root]

READY_TIMEOUT_S = 1200
ACTIVE_TIMEOUT_S = 900


def _skip_reason() -> str | None:
    if os.environ.get("METALD_LAB_LONG") != "1":
        return "an emulated arm64 machine takes minutes: set METALD_LAB_LONG=1 (make test-long)"
    if shutil.which("qemu-system-aarch64") is None:
        return "qemu-system-arm is not installed"
    from vmlab.qemu import AAVMF_CODE

    if not AAVMF_CODE.exists():
        return "qemu-efi-aarch64 (AAVMF) is not installed"
    return lab_skip_reason()


@dataclass
class Arm64Rack:
    rack: Any
    machine: dict[str, Any]
    item: dict[str, Any]
    power_on_to_ready_s: float
    built_s: float


@pytest.fixture(scope="module")
def arm64_rack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Arm64Rack]:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    from vmlab.rack import LabRack, tenants_config

    t_build = time.monotonic()
    rack = LabRack(
        f"a64-{os.getpid() % 10000}",
        Path(tmp_path_factory.mktemp("arm64")),
        machines=1,
        uefi=1,
        arm64=1,
        extra_config=lambda state: RULES + tenants_config(state),
    )
    built_s = time.monotonic() - t_build
    try:
        (m,) = rack.machines
        bmcs = rack.register_bmcs(["redfish"])
        rack.ctl("bmcs", "power", bmcs[m["name"]]["id"], "on")
        t_on = time.monotonic()
        ready = rack.wait_state([m["mac"]], "ready", READY_TIMEOUT_S)
        item = rack.machine_by_mac(m["mac"])
        assert item is not None
        yield Arm64Rack(rack, m, item, ready[m["mac"]] - t_on, built_s)
    finally:
        rack.down()


def test_an_arm64_machine_pxe_boots_and_reaches_ready(arm64_rack: Arm64Rack) -> None:
    rack, m, item = arm64_rack.rack, arm64_rack.machine, arm64_rack.item
    assert m["arch"] == "arm64"
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
    serial = Path(m["serial_log"]).read_text(errors="replace")
    assert "-arm64" in serial  # the agent's "kernel <version>" line: Debian's arm64 kernel
    listed = rack.json("machines", "list", "--arch", "arm64")["items"]
    assert [x["id"] for x in listed] == [item["id"]]
    print(
        f"\narm64 ({rack.state['accel']}: virt board, AAVMF) power-on to ready: "
        f"{arm64_rack.power_on_to_ready_s:.1f} s (assets and lab up in {arm64_rack.built_s:.1f} s)"
    )


def test_the_arm64_machine_joins_a_tenants_slurm(arm64_rack: Arm64Rack) -> None:
    from metald.tenants import controlplane

    rack, item = arm64_rack.rack, arm64_rack.item
    st, t = rack.api("POST", "/api/v1/tenants", {"name": "grace", "cluster_kind": "slurm"})
    assert st == 201, t
    st, hub = rack.api("POST", f"/api/v1/tenants/{t['id']}/hub", {})
    assert st == 201, hub
    x86 = rack.json(
        "images", "create", "node-amd64", "--kind", "stateless",
        "--kernel", "node/vmlinuz", "--initrd", "node/initrd.img",
    )  # fmt: skip
    assert x86["spec"]["arch"] == "amd64"  # the default
    # an amd64 image cannot land on the arm64 machine, nor may a selector ask for that
    rc, _ = rack.ctl("claims", "create", "--tenant", t["id"], "--count", "1", "--image", x86["id"], check=False)  # fmt: skip
    assert rc != 0
    rc, _ = rack.ctl("claims", "create", "--tenant", t["id"], "--count", "1", "--image", x86["id"], "--arch", "arm64", check=False)  # fmt: skip
    assert rc != 0
    img = rack.json("images", "create", "node-arm64", *rack.publish_node_image(arch="arm64"))
    assert img["spec"]["arch"] == "arm64"
    t0 = time.monotonic()
    claim = rack.json("claims", "create", "--tenant", t["id"], "--count", "1", "--image", img["id"])  # fmt: skip
    assert [x["id"] for x in claim["machines"]] == [item["id"]]

    def active() -> bool:
        return bool(rack.json("machines", "show", item["id"])["state"] == "active")

    waiting.wait_for("the arm64 node active", active, ACTIVE_TIMEOUT_S, every=2, explain=rack.diagnostics)  # fmt: skip
    t_active = time.monotonic() - t0

    def idle() -> bool:
        r = controlplane.exec_in(rack.state_dir, t["id"], ["sinfo", "-h", "-N", "-o", "%N %t"], timeout=60)  # fmt: skip
        return r.stdout.split()[1:2] == ["idle"]

    waiting.wait_for("the arm64 node idle in sinfo", idle, 120, every=2, explain=rack.diagnostics)
    r = controlplane.exec_in(rack.state_dir, t["id"], ["srun", "-N1", "uname", "-m"], timeout=120)
    assert r.returncode == 0 and r.stdout.split() == ["aarch64"], (r.stdout, r.stderr)
    print(f"\narm64 node: claim to active {t_active:.1f} s; srun uname -m: aarch64")
