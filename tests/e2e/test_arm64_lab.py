"""An arm64 machine end to end, for real: a QEMU "virt" board with AAVMF (Debian's arm64 UEFI
firmware), under TCG, with a virtual BMC, PXE-boots through metald: DHCP sees architecture 11
and hands out metald's own arm64 iPXE (Debian ships none), whose per-machine script loads the
discovery image built from Debian's arm64 packages; the agent reports the inventory (its CPU
named from the MIDR: QEMU's cortex-a72) and metald commissions it with the arm64 build of the
commissioning tools (stress-ng, memtester, fio, smartctl from Debian's arm64 packages; rocm-smi,
which has no arm64 build, skipped with that reason) before it is ready with arch arm64. Then a
tenant claims it with the arm64 node image (declared arm64: an amd64 claim cannot take it), it
joins the tenant's Slurm, a job writes to its disk, and the release wipes it (both ends of the
disk read back as zeros) and returns it to ready. TCG emulating arm64 is slow: under
METALD_LAB_LONG=1 (make test-long); it prints the time of each phase.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests import waiting
from tests.e2e.conftest import RULES, lab_skip_reason
from tests.e2e.test_claim_provision_release import disk_ends

pytestmark = [pytest.mark.lab, pytest.mark.root]

READY_TIMEOUT_S = 1800
ACTIVE_TIMEOUT_S = 900
WIPE_TIMEOUT_S = 1200
#: The arm64 machine's commissioning: short runs of every host check (this proves the arm64
#: tools run and are judged, not that the VM is good hardware), and rocm-smi, required, which
#: has no arm64 build: skipped with that reason instead of failing the machine.
COMMISSIONING = (
    '[[enroll.rules]]\nmatch = { product = "vm-lab arm64" }\nlabels = { cpu = "arm64" }\n'
    "[enroll.rules.commissioning]\n"
    'name = "grace-intake"\nmin_cpu_count = 2\nmin_memory_gb = 0.75\n'
    "disks = [{ min_size_gb = 2, count = 1 }]\n"
    "checks = [\n"
    '  { name = "stress-ng", duration_s = 3, timeout_s = 300, required = true },\n'
    '  { name = "memtester", size_mb = 16, timeout_s = 600, required = true },\n'
    '  { name = "edac", timeout_s = 30 },\n'
    '  { name = "smart", timeout_s = 120, required = true },\n'
    '  { name = "fio", duration_s = 2, timeout_s = 300, required = true },\n'
    '  { name = "rocm-smi", timeout_s = 60, required = true },\n'
    "]\n"
)


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
    #: what a later test needs from an earlier one (the tenant, the claim)
    shared: dict[str, Any]


def _state_times(rack: Any, machine_id: str) -> list[tuple[str, float]]:
    """The machine's state changes in order: (to_state, seconds since the epoch)."""
    from datetime import datetime

    items = rack.json(
        "events", "--machine", machine_id, "--kind", "machine.state", "--limit", "200"
    )
    events = sorted(items["items"], key=lambda e: e["id"])
    return [(e["to_state"], datetime.fromisoformat(e["at"]).timestamp()) for e in events]


def _phases(times: list[tuple[str, float]], start: str, end: str) -> str:
    """ "a 1.0 s, b 2.0 s": how long the machine stayed in each state from the last ``start``
    to the first ``end`` after it."""
    first = max(i for i, (st, _) in enumerate(times) if st == start)
    last = next(i for i in range(first, len(times)) if times[i][0] == end)
    return ", ".join(
        f"{times[i][0]} {times[i + 1][1] - times[i][1]:.1f} s" for i in range(first, last)
    )


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
        extra_config=lambda state: RULES + COMMISSIONING + tenants_config(state),
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
        yield Arm64Rack(rack, m, item, ready[m["mac"]] - t_on, built_s, {})
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
    # /proc/cpuinfo has no "model name" on arm64: named from the MIDR (QEMU's SMBIOS type 4
    # says only its machine type, which names nothing)
    assert full["cpu_model"] == "ARM Cortex-A72", full["inventory"]["payload"]["cpu"]
    assert full["inventory"]["payload"]["cpu"]["midr"]["part"] == "0xd08"
    times = _state_times(rack, item["id"])
    print(
        f"\narm64 ({rack.state['accel']}: virt board, AAVMF) power-on to ready: "
        f"{arm64_rack.power_on_to_ready_s:.1f} s (assets and lab up in {arm64_rack.built_s:.1f} s)"
        f"\n  phases: {_phases(times, times[0][0], 'ready')}"
    )


def test_the_arm64_machine_was_commissioned_with_its_arm64_tools(arm64_rack: Arm64Rack) -> None:
    rack, m, item = arm64_rack.rack, arm64_rack.machine, arm64_rack.item
    states = [st for st, _ in _state_times(rack, item["id"])]
    assert states[-3:] == ["inspecting", "commissioning", "ready"], states
    code, doc = rack.api("GET", f"/api/v1/machines/{item['id']}/commissioning")
    assert code == 200, doc
    last = doc["last"]
    assert (last["profile"], last["status"]) == ("grace-intake", "passed"), last
    res = {r["check"]: r for r in last["results"]}
    assert set(res) == {"sku", "stress-ng", "memtester", "edac", "smart", "fio", "rocm-smi"}
    # virtio has no SMART, QEMU no EDAC; rocm-smi has no arm64 build
    want = {"smart": "skipped", "edac": "skipped", "rocm-smi": "skipped"}
    for name, r in res.items():
        assert r["status"] == want.get(name, "passed"), (name, r["sentence"], r["raw"])
    for name in ("stress-ng", "memtester", "fio"):
        assert res[name]["agent_status"] == "ran", res[name]  # the arm64 tool, from tools.img
        assert res[name]["values"], res[name]
    assert "successful run completed" in res["stress-ng"]["raw"]
    assert res["fio"]["values"]["jobs"][0]["read_mbps"] > 0, res["fio"]["values"]
    assert res["rocm-smi"]["agent_status"] == "missing"
    assert "no arm64 build" in res["rocm-smi"]["sentence"], res["rocm-smi"]
    serial = Path(m["serial_log"]).read_text(errors="replace")
    loaded = re.search(r"commissioning tools loaded in (\d+) ms", serial)
    assert loaded, serial[-2000:]
    print(f"\narm64 commissioning ({rack.state['accel']}):")
    print(f"  tools.img (arm64) fetched and unpacked in {int(loaded[1]) / 1000:.1f} s")
    for name, r in res.items():
        print(f"  {name:<10} {r['status']:<8} {r['duration_s'] or 0:7.2f} s  {r['sentence']}")


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
    times = _state_times(rack, item["id"])
    print(
        f"\narm64 node: claim to active {t_active:.1f} s ({_phases(times, 'claimed', 'active')});"
        " srun uname -m: aarch64"
    )
    arm64_rack.shared.update(tenant=t, claim=claim)


def test_the_released_arm64_machine_is_wiped_back_to_ready(
    arm64_rack: Arm64Rack, tmp_path: Path
) -> None:
    """The tenant's job leaves data at both ends of the disk; the release wipes it (the arm64
    wipe boot: AAVMF PXE, metald's arm64 iPXE, the arm64 discovery image in wipe mode) and
    the machine is ready again with zeros at both ends."""
    from metald.tenants import controlplane

    rack, m, item = arm64_rack.rack, arm64_rack.machine, arm64_rack.item
    if "claim" not in arm64_rack.shared:
        pytest.skip("the claim test did not get the machine active")
    t, claim = arm64_rack.shared["tenant"], arm64_rack.shared["claim"]
    write = (
        "head -c 1048576 /dev/urandom > /tmp/junk && "
        "dd if=/tmp/junk of=/dev/vda bs=1M count=1 conv=fsync status=none && "
        "dd if=/tmp/junk of=/dev/vda bs=1M seek=$(($(blockdev --getsize64 /dev/vda) / 1048576 - 1)) "
        "count=1 conv=fsync status=none && echo written"
    )
    r = controlplane.exec_in(rack.state_dir, t["id"], ["srun", "-N1", "sh", "-c", write], timeout=180)  # fmt: skip
    assert r.returncode == 0 and "written" in r.stdout, (r.stdout, r.stderr)
    first, last = disk_ends(m["disk"], tmp_path)
    assert first.strip(b"\0") and last.strip(b"\0"), "the tenant's data is on the disk"
    t0 = time.monotonic()
    rack.ctl("claims", "release", claim["id"], "--yes")

    def ready() -> bool:
        return bool(rack.json("machines", "show", item["id"])["state"] == "ready")

    waiting.wait_for("the arm64 machine wiped and ready", ready, WIPE_TIMEOUT_S, every=3, explain=rack.diagnostics)  # fmt: skip
    t_wipe = time.monotonic() - t0
    shown = rack.json("machines", "show", item["id"])
    assert shown["tenant_id"] is None and shown["claim_id"] is None
    first, last = disk_ends(m["disk"], tmp_path)
    assert first == b"\0" * len(first) and last == b"\0" * len(last), "disk ends wiped"
    times = _state_times(rack, item["id"])
    states = [st for st, _ in times]
    assert "wiping" in states[states.index("active") :], states
    print(
        f"\narm64 release to wiped and ready: {t_wipe:.1f} s ({_phases(times, 'active', 'ready')})"
    )


def test_the_arm64_disk_form_is_deployed_and_boots_under_uefi(
    arm64_rack: Arm64Rack, tmp_path: Path
) -> None:
    """The node image's arm64 disk form (GPT, an EFI system partition with systemd-boot at
    EFI/BOOT/BOOTAA64.EFI, ext4 root) as a disk image: the deploy agent writes it and the NoCloud
    seed, AAVMF boots it from the disk, the node reads its seed from the root partition, joins
    the tenant's Slurm; the release wipes it back to ready."""
    import json

    from bootassets.node import ensure_node_built
    from metald.tenants import controlplane

    rack, m, item = arm64_rack.rack, arm64_rack.machine, arm64_rack.item
    if "tenant" not in arm64_rack.shared:
        pytest.skip("the claim test did not make the tenant")
    if rack.json("machines", "show", item["id"])["state"] != "ready":
        pytest.skip("the machine was not wiped back to ready")
    t = arm64_rack.shared["tenant"]
    node = ensure_node_built(arch="arm64")
    manifest = json.loads((node / "manifest.json").read_text())
    assert manifest["disk"]["table"] == "gpt", manifest.get("disk")
    base = rack._serve(node, 8083, "node-disk-server-arm64")
    img = rack.json(
        "images", "create", "node-arm64-disk", "--kind", "disk", "--arch", "arm64",
        "--url", f"{base}/disk.raw", "--sha256", manifest["files"]["disk.raw"]["sha256"],
        "--size", str(manifest["files"]["disk.raw"]["size"]),
    )  # fmt: skip
    serial = Path(m["serial_log"])
    before = len(serial.read_bytes())
    t0 = time.monotonic()
    claim = rack.json("claims", "create", "--tenant", t["id"], "--count", "1", "--image", img["id"])  # fmt: skip
    assert [x["id"] for x in claim["machines"]] == [item["id"]]

    def active() -> bool:
        return bool(rack.json("machines", "show", item["id"])["state"] == "active")

    waiting.wait_for("the arm64 disk node active", active, ACTIVE_TIMEOUT_S, every=3, explain=rack.diagnostics)  # fmt: skip
    t_active = time.monotonic() - t0
    log = serial.read_bytes()[before:].decode(errors="replace")
    assert "metald-node: disk boot: reading the NoCloud seed" in log, log[-3000:]
    assert "from the seed on /dev/vda2" in log, log[-3000:]  # the GPT's root partition

    def idle() -> bool:
        r = controlplane.exec_in(rack.state_dir, t["id"], ["sinfo", "-h", "-N", "-o", "%N %t"], timeout=60)  # fmt: skip
        return "idle" in r.stdout.split()

    waiting.wait_for("the arm64 disk node idle in sinfo", idle, 180, every=2, explain=rack.diagnostics)  # fmt: skip
    r = controlplane.exec_in(rack.state_dir, t["id"], ["srun", "-N1", "uname", "-m"], timeout=120)
    assert r.returncode == 0 and r.stdout.split() == ["aarch64"], (r.stdout, r.stderr)
    first, _ = disk_ends(m["disk"], tmp_path)
    assert first[510:512] == b"\x55\xaa" and first[512:520] == b"EFI PART"  # a GPT on the disk
    times = _state_times(rack, item["id"])
    print(
        f"\narm64 disk form: claim to active {t_active:.1f} s ({_phases(times, 'claimed', 'active')})"
    )
    t1 = time.monotonic()
    rack.ctl("claims", "release", claim["id"], "--yes")

    def ready() -> bool:
        return bool(rack.json("machines", "show", item["id"])["state"] == "ready")

    waiting.wait_for("the arm64 disk node wiped and ready", ready, WIPE_TIMEOUT_S, every=3, explain=rack.diagnostics)  # fmt: skip
    first, last = disk_ends(m["disk"], tmp_path)
    assert first == b"\0" * len(first) and last == b"\0" * len(last), "disk ends wiped"
    print(f"arm64 disk form: release to wiped and ready {time.monotonic() - t1:.1f} s")
