"""Claims end to end in the virtual rack: claim 2 of the 3 enrolled machines with a small disk
image; metald PXE-boots them through their BMCs into the deploy agent, which writes and
verifies the image and the NoCloud seed; they boot from disk (proven by the image's own
message on their serial consoles). Release wipes them (proven by reading their disks) and
they return to ready.

The test image is tiny and real: an MBR whose boot code prints a marker through the BIOS
(SeaBIOS mirrors it to the serial port), and an ext4 partition with /etc/cloud, where the agent
puts the cloud-init NoCloud seed. So the claim selects the BIOS machines (label from an
enrollment rule on the SMBIOS product).
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from tests import waiting
from vmlab.rack import MARKER

pytestmark = [pytest.mark.lab, pytest.mark.root]


def wait_for(what: str, fn, timeout: float, rack) -> None:  # type: ignore[no-untyped-def]
    waiting.wait_for(what, fn, timeout, every=2, explain=rack.diagnostics)


def disk_ends(qcow2: str, workdir: Path) -> tuple[bytes, bytes]:
    raw = workdir / "disk-copy.raw"
    raw.unlink(missing_ok=True)
    # -U: the disk is open by the running VM; a consistent-enough read after the agent synced.
    subprocess.run(
        ["qemu-img", "convert", "-U", "-f", "qcow2", "-O", "raw", qcow2, str(raw)], check=True
    )
    with open(raw, "rb") as f:
        first = f.read(1 << 20)
        f.seek(-(1 << 20), 2)
        last = f.read(1 << 20)
    raw.unlink()
    return first, last


def test_claim_provision_boot_release_wipe(enrolled_rack, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    rack = enrolled_rack.rack
    image_args = rack.publish_test_image(tmp_path)
    tenant = rack.json("tenants", "create", "acme")["id"]
    img = rack.json("images", "create", "test-disk", *image_args)
    # Too many machines: refused with how many matched, and nothing allocated.
    rc, _ = rack.ctl(
        "claims",
        "create",
        "--tenant",
        tenant,
        "--count",
        "3",
        "--image",
        img["id"],
        "--label",
        "firmware=bios",
        check=False,
    )
    assert rc == 1
    claim = rack.json(
        "claims",
        "create",
        "--tenant",
        tenant,
        "--count",
        "2",
        "--image",
        img["id"],
        "--label",
        "firmware=bios",
        "--idempotency-key",
        "e2e-1",
    )
    again = rack.json(
        "claims",
        "create",
        "--tenant",
        tenant,
        "--count",
        "2",
        "--image",
        img["id"],
        "--label",
        "firmware=bios",
        "--idempotency-key",
        "e2e-1",
    )
    assert again["id"] == claim["id"] and again["replayed"]
    ids = {m["id"] for m in claim["machines"]}
    assert len(ids) == 2
    by_id = {rack.machine_by_mac(m["mac"])["id"]: m for m in rack.machines}
    assert all(by_id[i]["firmware"] == "bios" for i in ids)

    def states() -> dict[str, str]:
        return {m["id"]: m["state"] for m in rack.json("claims", "show", claim["id"])["machines"]}

    t0 = time.monotonic()
    wait_for("provisioned", lambda: set(states().values()) == {"provisioned"}, 420, rack)
    t_prov = time.monotonic() - t0
    for i in ids:
        log = Path(by_id[i]["serial_log"])
        # The first 24 characters: SeaBIOS's serial console may still hold the tail.
        wait_for(
            f"{i} to boot its disk", lambda log=log: MARKER[:24] in log.read_bytes(), 180, rack
        )
    events = rack.json("events", "--limit", "1000")["items"]
    progress = [e for e in events if e["kind"] == "provision.progress" and e["machine_id"] in ids]
    assert progress, "deploy progress was reported"

    t1 = time.monotonic()
    rack.ctl("claims", "release", claim["id"], "--yes")
    wait_for(
        "wiped and ready",
        lambda: all(rack.json("machines", "show", i)["state"] == "ready" for i in ids),
        420,
        rack,
    )
    t_wipe = time.monotonic() - t1
    for i in ids:
        m = rack.json("machines", "show", i)
        assert m["tenant_id"] is None and m["claim_id"] is None
        first, last = disk_ends(by_id[i]["disk"], tmp_path)
        assert first == b"\0" * len(first) and last == b"\0" * len(last), "disk ends wiped"
    print(
        f"\nclaim -> provisioned and booted from disk: {t_prov:.1f} s; release -> wiped and ready: {t_wipe:.1f} s"
    )
