"""Kernel and initrd over plain HTTP, checked by the real iPXE (``METALD_LAB_LONG=1``).

A BIOS machine (SeaBIOS and the NIC's iPXE ROM, chainloaded into metald's undionly.kpxe) boots
from a metald with its own CA (tls_auto) and ``[boot] assets_http_listen``: the script comes
over HTTPS pinned to that CA, the kernel and initrd over plain HTTP. First a man in the middle
answers the plain port (nftables redirect on the bridge) with the real kernel and an initrd
with one byte changed: iPXE's ``imgverify`` refuses it, nothing boots, and metald records a
``boot.image_refused`` event naming the initrd. Then the man in the middle goes away and the
script's next load (a minute later, same script and token) gets the real files, verifies both and reaches ``ready``: the signed
path works end to end in the real iPXE, and only a changed file stops it.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from tests import waiting
from tests.e2e.conftest import lab_ipxe_assets, lab_skip_reason

pytestmark = [pytest.mark.lab, pytest.mark.root]

PORT, PLAIN, MITM = 8443, 8082, 9082
REFUSED_TIMEOUT_S = 300
READY_TIMEOUT_S = 420


def test_a_changed_initrd_on_the_plain_path_stops_the_boot_with_an_event(tmp_path: Path) -> None:
    if os.environ.get("METALD_LAB_LONG") != "1":
        pytest.skip("3-6 minutes of TCG boots (and a first iPXE build): METALD_LAB_LONG=1")
    reason = lab_skip_reason()
    if reason:
        pytest.skip(reason)
    from vmlab.labipxe import seed_state
    from vmlab.rack import LabRack

    assets = lab_ipxe_assets(tmp_path / "assets")
    # The man in the middle's copy: the real kernel, the initrd with one byte changed (in the
    # middle of the compressed cpio: still a plausible file of the same size).
    fake = tmp_path / "mitm" / "boot" / "assets" / "discovery"
    fake.mkdir(parents=True)
    (fake / "vmlinuz").write_bytes((assets / "discovery" / "vmlinuz").read_bytes())
    initrd = bytearray((assets / "discovery" / "initrd.img").read_bytes())
    initrd[len(initrd) // 2] ^= 0x01
    (fake / "initrd.img").write_bytes(bytes(initrd))
    seed_state(tmp_path / "rack" / "metald")  # metald's tls_auto CA is the one iPXE trusts
    rack = LabRack(
        f"sig{os.getpid() % 10000}",
        tmp_path / "rack",
        machines=1,
        uefi=0,
        rng=True,
        assets=assets,
        boot_config=f'http_listen = "0.0.0.0:{PORT}"\nassets_http_listen = "0.0.0.0:{PLAIN}"\n',
    )
    try:
        _run(rack, tmp_path)
    finally:
        rack.down()


def _run(rack, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    addr, bridge = rack.state["boot_address"], rack.state["bridge"]
    log = rack.log.read_text()
    assert "tls_auto stays off" not in log and "assets_http_listen is not used" not in log, log[
        -3000:
    ]
    rack.lab.spawn(
        [sys.executable, "-m", "http.server", str(MITM), "--directory", str(tmp_path / "mitm")],
        role="mitm",
        log=tmp_path / "mitm.log",
    )
    nft = (
        "table ip mitm {\n chain pre {\n  type nat hook prerouting priority -100;\n"
        f'  iifname "{bridge}" tcp dport {PLAIN} redirect to :{MITM}\n }}\n}}\n'
    )
    waiting.wait_for(
        "the man in the middle to listen",
        lambda: (
            rack.lab.run(["ss", "-ltn"], capture_output=True, text=True).stdout.count(f":{MITM} ")
            > 0
        ),
        30,
        every=0.2,
    )
    r = rack.lab.run(["nft", "-f", "-"], input=nft, text=True, capture_output=True)
    assert r.returncode == 0, r.stderr
    (m,) = rack.machines
    mac = m["mac"]
    t0 = time.monotonic()
    bmcs = rack.register_bmcs(["ipmi"])
    rack.ctl("bmcs", "power", bmcs[m["name"]]["id"], "on")

    def refused() -> list[dict]:  # type: ignore[type-arg]
        items = rack.json("events", "--limit", "1000")["items"]
        return [e for e in items if e["kind"] == "boot.image_refused"]

    waiting.wait_for(
        "iPXE to refuse the changed initrd",
        lambda: bool(refused()),
        REFUSED_TIMEOUT_S,
        every=2,
        explain=rack.diagnostics,
    )
    t_refused = time.monotonic() - t0
    (ev,) = refused()
    assert ev["data"]["file"] == "discovery/initrd.img" and ev["data"]["mac"] == mac, ev
    serial = Path(m["serial_log"]).read_text(errors="replace")
    assert f"http://{addr}:{PLAIN}/boot/assets/discovery/initrd.img" in serial, serial[-3000:]
    assert "discovery/initrd.img failed its signature check" in serial, serial[-3000:]
    assert "Linux version" not in serial and "discovery image up" not in serial  # nothing ran
    mitm = (tmp_path / "mitm.log").read_text()
    assert "GET /boot/assets/discovery/initrd.img" in mitm, mitm  # it did serve the fake
    machine = rack.json("machines", "show", ev["machine_id"])
    assert machine["state"] != "ready", machine

    # The man in the middle leaves: the next load (same script, a minute later) boots the
    # real, verified files.
    r = rack.lab.run(["nft", "delete", "table", "ip", "mitm"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    t1 = time.monotonic()
    rack.wait_state([mac], "ready", READY_TIMEOUT_S)
    t_ready = time.monotonic() - t1
    serial = Path(m["serial_log"]).read_text(errors="replace")
    assert "discovery image up" in serial, serial[-3000:]
    assert len(refused()) == 1  # the clean boot reported nothing
    print(
        f"\npower-on -> changed initrd refused {t_refused:.1f} s; man in the middle gone -> "
        f"ready {t_ready:.1f} s (the 60 s wait before loading again included); load {os.getloadavg()[0]:.1f}"
    )
