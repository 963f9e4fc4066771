"""Commissioning for real, in the lab: two BIOS VMs (QEMU, TCG) enroll themselves through
metald, and the discovery agent runs Debian's stress-ng, memtester, fio and smartctl (the
commissioning tools' second initramfs, fetched only on this boot) before metald lets a machine
be ready. One VM's enroll rule says its disk must be 4 GB; the lab's disks are 2 GiB, so that
VM fails commissioning on the SKU comparison with a sentence naming the sizes, and never runs a
check. The other passes every check with its measured values on record.

Check durations are short on purpose (a few seconds of stress-ng and fio, 16 MiB of memtester):
this proves the tools run and are judged, not that the VM's hardware is good. Run alone:

    BOOTASSETS_CACHE=... .venv/bin/python -m pytest tests/e2e/test_commissioning_lab.py -s
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import lab_skip_reason

pytestmark = [pytest.mark.lab, pytest.mark.root]

TIMEOUT_S = 480
CHECKS = (
    "checks = [\n"
    '  { name = "stress-ng", duration_s = 3, timeout_s = 120, required = true },\n'
    '  { name = "memtester", size_mb = 16, timeout_s = 300, required = true },\n'
    '  { name = "edac", timeout_s = 30 },\n'
    '  { name = "smart", timeout_s = 60, required = true },\n'
    '  { name = "fio", duration_s = 2, timeout_s = 120, required = true },\n'
    "]\n"
)
RULES = (
    '[[enroll.rules]]\nmatch = { vendor = "vm-lab" }\nlabels = { pool = "lab" }\n'
    "[enroll.rules.commissioning]\n"
    'name = "vm-intake"\nmin_cpu_count = 2\nmin_memory_gb = 0.75\n'
    "disks = [{ min_size_gb = 2, count = 1 }]\n" + CHECKS +
    # The lab's second machine (serial VMLAB-<lab>-M1) is sold as having a 4 GB disk.
    '[[enroll.rules]]\nmatch = { serial = "*-M1" }\nlabels = { sku = "big-disk" }\n'
    "[enroll.rules.commissioning]\n"
    'name = "vm-big-disk"\ndisks = [{ min_size_gb = 4, count = 1 }]\n' + CHECKS +
    "[provision]\nwatchdog_interval_s = 5\n"
)  # fmt: skip


def _settle(rack, macs: list[str]) -> dict[str, tuple[dict, float]]:  # type: ignore[no-untyped-def]
    """Wait until each machine leaves enrollment and commissioning (whatever state it lands
    in, so a wrong landing fails at once with its state and last error)."""
    passing = {None, "discovered", "inspecting", "commissioning"}
    out: dict[str, tuple[dict, float]] = {}
    deadline = time.monotonic() + TIMEOUT_S
    while len(out) < len(macs):
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{sorted(set(macs) - set(out))} still enrolling\n{rack.diagnostics()}"
            )
        for mac in set(macs) - set(out):
            item = rack.machine_by_mac(mac)
            if item is not None and item["state"] not in passing:
                out[mac] = (rack.json("machines", "show", item["id"]), time.monotonic())
        time.sleep(1)
    return out


def _states(rack, mid: str) -> list[str]:  # type: ignore[no-untyped-def]
    items = rack.json("events", "--machine", mid, "--kind", "machine.state", "--limit", "100")
    events = sorted(items["items"], key=lambda e: e["id"])
    return [e["to_state"] for e in events]


@pytest.mark.skipif(
    os.environ.get("METALD_LAB_LONG") != "1",
    reason=(
        "two TCG commissioning boots (~1-3 min): METALD_LAB_LONG=1; make test keeps the real agent running the real tools against metald (tests/commissioning/test_agent.py)"
    ),
)
def test_a_healthy_vm_commissions_and_one_with_a_small_disk_fails(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    reason = lab_skip_reason()
    if reason:
        pytest.skip(reason)
    from vmlab.rack import LabRack

    rack = LabRack(
        f"cl{os.getpid() % 10000}",
        tmp_path_factory.mktemp("commission-rack"),
        machines=2,
        uefi=0,
        extra_config=RULES,
    )
    try:
        healthy, small = rack.machines
        bmcs = rack.register_bmcs(["ipmi", "redfish"])
        t_on = {}
        for m in rack.machines:
            rack.ctl("bmcs", "power", bmcs[m["name"]]["id"], "on")
            t_on[m["mac"]] = time.monotonic()
        landed = _settle(rack, [healthy["mac"], small["mac"]])
        for mac, (m, _) in landed.items():
            print(f"\n{mac}: {m['state']} ({m.get('last_error')})")
        assert landed[healthy["mac"]][0]["state"] == "ready", landed[healthy["mac"]][0]
        assert landed[small["mac"]][0]["state"] == "commission-failed", landed[small["mac"]][0]
        ready_at = {healthy["mac"]: landed[healthy["mac"]][1]}
        failed_at = {small["mac"]: landed[small["mac"]][1]}

        # The healthy VM: inspected, commissioned, every check passed with its values.
        hid = rack.machine_by_mac(healthy["mac"])["id"]
        st = _states(rack, hid)
        assert st[-3:] == ["inspecting", "commissioning", "ready"], st
        code, doc = rack.api("GET", f"/api/v1/machines/{hid}/commissioning")
        assert code == 200, doc
        last = doc["last"]
        assert (last["profile"], last["status"]) == ("vm-intake", "passed"), last
        res = {r["check"]: r for r in last["results"]}
        assert set(res) == {"sku", "stress-ng", "memtester", "edac", "smart", "fio"}, res
        want = {"smart": "skipped", "edac": "skipped"}  # virtio has no SMART, QEMU no EDAC
        for name, r in res.items():
            assert r["status"] == want.get(name, "passed"), (name, r["sentence"], r["raw"])
        for name in ("stress-ng", "memtester", "fio"):
            assert res[name]["agent_status"] == "ran", res[name]  # the real tool, from tools.img
            assert res[name]["values"], res[name]
        assert "successful run completed" in res["stress-ng"]["raw"]
        assert re.search(r"got\s+16MB", res["memtester"]["raw"]), res["memtester"]["raw"][:300]
        assert res["fio"]["values"]["jobs"][0]["read_mbps"] > 0, res["fio"]["values"]
        assert res["stress-ng"]["values"]["bogo_ops_per_s"]["cpu"] > 0, res["stress-ng"]
        assert "/dev/vda" in res["smart"]["sentence"], res["smart"]

        # The small-disk VM: failed before any check, the sentence naming the difference.
        sid = rack.machine_by_mac(small["mac"])["id"]
        st = _states(rack, sid)
        assert st[-3:] == ["inspecting", "commissioning", "commission-failed"], st
        code, doc = rack.api("GET", f"/api/v1/machines/{sid}/commissioning")
        assert code == 200, doc
        last = doc["last"]
        assert (last["profile"], last["status"]) == ("vm-big-disk", "failed"), last
        sentence = "expected 1 disk(s) of 4 GB or more, found 0 (vda 2.1 GB)"
        assert sentence in last["summary"], last["summary"]
        assert [r["check"] for r in last["results"]] == ["sku"], last["results"]
        shown = rack.json("machines", "show", sid)
        assert sentence in (shown["last_error"] or ""), shown["last_error"]

        serial = Path(healthy["serial_log"]).read_text(errors="replace")
        loaded = re.search(r"commissioning tools loaded in (\d+) ms", serial)
        assert loaded, serial[-2000:]
        print(f"\ncommissioning in the lab ({rack.state['accel']}):")
        print(f"  tools.img fetched and unpacked in {int(loaded[1]) / 1000:.1f} s")
        for name, r in res.items():
            print(f"  {name:<10} {r['status']:<8} {r['duration_s'] or 0:6.2f} s  {r['sentence']}")
        print(f"  power-on to ready: {ready_at[healthy['mac']] - t_on[healthy['mac']]:.1f} s")
        print(
            f"  power-on to commission-failed: {failed_at[small['mac']] - t_on[small['mac']]:.1f} s"
        )
    finally:
        rack.down()
