"""Zero-touch enrollment of a virtual rack, for real: QEMU machines (2 BIOS, 1 UEFI) with
virtual BMCs, metald inside the lab's namespace serving DHCP/TFTP/HTTP boot, the discovery
image built from Debian packages, and the agent posting inventory. Nobody types a MAC: BMCs
are registered by address, the machines are powered on through metald's API, enroll
themselves, and their BMCs are linked to them by system UUID (see conftest.enrolled_rack).
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.lab, pytest.mark.root]


def test_rack_powers_on_and_enrolls_itself(enrolled_rack) -> None:  # type: ignore[no-untyped-def]
    rack, bmcs = enrolled_rack.rack, enrolled_rack.bmcs
    assert {b["protocol"] for b in bmcs.values()} == {"ipmi", "redfish"}
    for b in bmcs.values():
        assert "password" not in str(b)
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
        want = {"pool": "lab", **({"firmware": "bios"} if m["firmware"] == "bios" else {})}
        assert full["labels"] == want
        # What DHCP saw (option 93): OVMF's PXE says x86-64 UEFI, SeaBIOS's iPXE ROM BIOS.
        assert full["firmware"] == ("bios" if m["firmware"] == "bios" else "uefi-x64")
        assert linked[bmcs[m["name"]]["id"]] == item["id"], "BMC linked to its machine by UUID"
        secs = enrolled_rack.ready[m["mac"]] - enrolled_rack.t_on[m["mac"]]
        rows.append((m["name"], m["firmware"], m["mac"], secs))
    kinds = {e["kind"] for e in rack.json("events", "--limit", "1000")["items"]}
    assert {"machine.created", "machine.state", "bmc.linked"} <= kinds

    print(f"\npower-on to ready ({rack.state['accel']}, {len(rows)} machines, RA on):")
    for name, fw, mac, secs in rows:
        print(f"  {name} {fw:5} {mac}  {secs:6.1f} s")
    whole = max(enrolled_rack.ready.values()) - min(enrolled_rack.t_on.values())
    print(f"  whole rack: {whole:6.1f} s")
