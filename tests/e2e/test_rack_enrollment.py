"""Zero-touch enrollment of a virtual rack, for real: QEMU machines (2 BIOS, 1 UEFI) with
virtual BMCs, metald inside the lab's namespace serving DHCP/TFTP/HTTP boot, the discovery
image built from Debian packages, and the agent posting inventory. Nobody types a MAC: BMCs
are registered by address, the machines are powered on through metald's API, enroll
themselves, and their BMCs are linked to them by system UUID.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.lab,
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces, taps, QEMU)"),
    pytest.mark.skipif(
        shutil.which("qemu-system-x86_64") is None, reason="qemu-system-x86 is not installed"
    ),
]

READY_TIMEOUT_S = 480


@pytest.fixture
def rack(tmp_path: Path):  # type: ignore[no-untyped-def]
    from metald.labrack import LabRack

    r = LabRack(
        f"e2e{os.getpid() % 10000}",
        tmp_path,
        machines=3,
        uefi=1,
        extra_config='[[enroll.rules]]\nmatch = { vendor = "vm-lab" }\nlabels = { pool = "lab" }\n',
    )
    try:
        yield r
    finally:
        r.down()


def test_rack_powers_on_and_enrolls_itself(rack) -> None:  # type: ignore[no-untyped-def]
    bmcs = rack.register_bmcs(["ipmi", "redfish", "auto"])
    for b in bmcs.values():
        assert b["health"] == "ok" and b["machine_id"] is None
        assert "password" not in str(b)
    assert {b["protocol"] for b in bmcs.values()} == {"ipmi", "redfish"}

    t_on = {}
    for m in rack.machines:
        rack.ctl("bmcs", "power", bmcs[m["name"]]["id"], "on")
        t_on[m["mac"]] = time.monotonic()
    ready = rack.wait_state(list(t_on), "ready", READY_TIMEOUT_S)

    rows = []
    linked = {b["id"]: b["machine_id"] for b in rack.json("bmcs", "list")["items"]}
    for m in rack.machines:
        item = rack.machine_by_mac(m["mac"])
        assert item is not None
        full = rack.json("machines", "show", item["id"])
        inv = full["inventory"]["normalized"]
        assert full["cpu_count"] == m["cpus"]
        assert 0.80 * m["memory_mb"] <= full["memory_mb"] <= m["memory_mb"], full["memory_mb"]
        assert 2 * 1024**3 in [d["size_bytes"] for d in inv["disks"]], inv["disks"]
        assert m["mac"] in [n["mac"] for n in inv["nics"]]
        assert full["system_uuid"] == m["uuid"].lower()
        assert full["labels"] == {"pool": "lab"}
        assert linked[bmcs[m["name"]]["id"]] == item["id"], "BMC linked to its machine by UUID"
        rows.append((m["name"], m["firmware"], m["mac"], ready[m["mac"]] - t_on[m["mac"]]))
    events = rack.json("events", "--limit", "1000")["items"]
    kinds = {e["kind"] for e in events}
    assert {"machine.created", "machine.state", "bmc.linked"} <= kinds

    print(f"\npower-on to ready ({rack.state['accel']}, {len(rows)} machines, RA on):")
    for name, fw, mac, secs in rows:
        print(f"  {name} {fw:5} {mac}  {secs:6.1f} s")
    print(f"  whole rack: {max(ready.values()) - min(t_on.values()):6.1f} s")
