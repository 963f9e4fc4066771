"""Virtual media boot end to end (issue 16 item 3): a BIOS VM on a network where metald gives
no PXE answer at all (metald's DHCP is off; a dnsmasq hands out addresses and no boot options)
enrolls to ready through its Redfish BMC's virtual CD, is claimed, provisioned (it boots its
disk image) and released and wiped the same way; every boot's ISO has its own nonce URL and
is ejected once its agent reported (item 2).

The lab's Redfish BMC (vm-lab/vmlab/redfish.py + vmedia.py) fetches the ISO from metald over
HTTP and puts it in the VM's CD drive over QMP (``blockdev-change-medium``); a one-time ``Cd``
boot override puts the drive first for one boot. ``make test`` runs the enrollment (about 45 s
of TCG boots); the claim, provisioning and wipe run with METALD_LAB_LONG=1 (``make test-long``,
about 2.5 min more). Run alone:

    BOOTASSETS_CACHE=... .venv/bin/python -m pytest tests/e2e/test_virtual_media_lab.py -s
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import lab_ipxe_assets, lab_skip_reason
from tests.waiting import wait_for

pytestmark = [pytest.mark.lab, pytest.mark.root]

TIMEOUT_S = 480


def _commands(m: dict) -> list[str]:  # type: ignore[type-arg]
    """What the machine's BMC was asked, in order (the lab BMC's command log)."""
    lines = Path(m["bmc_commands"]).read_text().splitlines()
    return [json.loads(ln)["command"] for ln in lines if ln]


def _wait(what: str, check, rack, timeout: float = TIMEOUT_S):  # type: ignore[no-untyped-def]
    return wait_for(what, check, timeout, every=1, explain=rack.diagnostics)


def _dnsmasq(rack, work: Path) -> None:  # type: ignore[no-untyped-def]
    """The network's own DHCP server on the lab bridge: addresses, no boot options."""
    st = rack.state
    lo, hi = st["dhcp_range"]
    rack.lab.spawn(
        ["dnsmasq", "--keep-in-foreground", "--conf-file=/dev/null", "--port=0",
         f"--interface={st['bridge']}", "--bind-interfaces", f"--dhcp-range={lo},{hi},10m",
         f"--dhcp-leasefile={work / 'dnsmasq.leases'}", "--pid-file=", "--user=root",
         "--log-dhcp", "--log-facility=-"],
        role="dnsmasq",
        log=work / "dnsmasq.log",
    )  # fmt: skip


def _enroll_by_virtual_media(rack, m: dict) -> tuple[str, float]:  # type: ignore[no-untyped-def,type-arg]
    """Register the machine (labelled to boot from virtual media) and its Redfish BMC, start
    its inspection, ask for a virtual-media boot and wait for ``ready``: its id and the
    seconds from the boot request to ready."""
    code, machine = rack.api(
        "POST", "/api/v1/machines", {"macs": [m["mac"]], "labels": {"boot-via": "virtual-media"}}
    )
    assert code == 201, machine
    mid = machine["id"]
    rack.register_bmcs(["redfish"])
    code, body = rack.api("POST", f"/api/v1/machines/{mid}/actions", {"action": "inspect"})
    assert code == 200, body
    t0 = time.monotonic()
    code, body = rack.api("POST", f"/api/v1/machines/{mid}/boot", {"via": "virtual-media"})
    assert code == 202, body
    rack.wait_state([m["mac"]], "ready", TIMEOUT_S)
    return mid, time.monotonic() - t0


def test_a_vm_without_pxe_enrolls_is_provisioned_and_wiped_through_virtual_media(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    reason = lab_skip_reason()
    if reason:
        pytest.skip(reason)
    if shutil.which("dnsmasq") is None:
        pytest.skip("needs dnsmasq (the network's own DHCP server)")
    from vmlab.rack import MARKER, LabRack

    work = tmp_path_factory.mktemp("vmedia")
    rack = LabRack(
        f"vm{os.getpid() % 10000}",
        work,
        machines=1,
        uefi=0,
        boot_config='dhcp_mode = "off"\n',  # metald answers no DHCP, so no PXE either
    )
    try:
        m = rack.machines[0]
        _dnsmasq(rack, work)

        code, machine = rack.api(
            "POST",
            "/api/v1/machines",
            {"macs": [m["mac"]], "labels": {"boot-via": "virtual-media"}},
        )
        assert code == 201, machine
        mid = machine["id"]
        bmc = rack.register_bmcs(["redfish"])[m["name"]]
        assert bmc["machine_id"] == mid, bmc  # linked by the MAC its Redfish service reports
        code, body = rack.api("POST", f"/api/v1/machines/{mid}/actions", {"action": "inspect"})
        assert code == 200, body
        code, body = rack.api("POST", f"/api/v1/machines/{mid}/boot", {"via": "virtual-media"})
        assert code == 202, body

        rack.wait_state([m["mac"]], "ready", TIMEOUT_S)

        # Nothing was PXE-booted: the BMC was asked for the ISO and a one-time CD boot.
        sent = _commands(m)
        prefix = f"insert {rack.url}/boot/n/{mid}/"  # the boot's own nonce URL
        assert any(c.startswith(prefix) and c.endswith(".iso") for c in sent), sent
        assert "boot cd once" in sent
        assert not any(c.startswith("boot pxe") for c in sent), sent
        assert "DHCPOFFER" in (work / "dnsmasq.log").read_text()  # the address was dnsmasq's

        # Item 2: once the inventory arrived, metald ejected the ISO through the BMC.
        def ejected() -> dict | None:
            ev = rack.json("events", "--machine", mid, "--kind", "bmc.vmedia-ejected")["items"]
            return ev[0] if ev else None

        event = _wait("no bmc.vmedia-ejected event", ejected, rack, timeout=60)
        assert event["data"]["image"].startswith(f"{rack.url}/boot/n/{mid}/")
        assert "eject" in _commands(m)
        b = m["bmc"]
        r = rack.lab.run(
            ["curl", "-s", "-u", f"{b['username']}:{b['password']}",
             f"{b['redfish_url']}/redfish/v1/Managers/BMC/VirtualMedia/Cd"],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        cd = json.loads(r.stdout)
        assert cd["Inserted"] is False and cd["Image"] is None, cd
        # The CD boot was one-time: the override is used up and the standing order is back.
        r = rack.lab.run(
            ["curl", "-s", "-u", f"{b['username']}:{b['password']}",
             f"{b['redfish_url']}/redfish/v1/Systems/{m['name']}"],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        boot = json.loads(r.stdout)["Boot"]
        assert boot["BootSourceOverrideEnabled"] == "Disabled", boot

        if not os.environ.get("METALD_LAB_LONG"):
            return  # the claim's part below adds ~2.5 min of TCG boots: `make test-long`
        # Claimed: provisioned through virtual media (the label), booted from its disk;
        # released: wiped the same way, back to ready. Each boot's ISO ejected after its report.
        tenant = rack.json("tenants", "create", "acme")["id"]
        img = rack.json("images", "create", "test-disk", *rack.publish_test_image(work))
        rack.json(
            "claims", "create", "--tenant", tenant, "--count", "1", "--image", img["id"],
            "--label", "boot-via=virtual-media",
        )  # fmt: skip
        rack.wait_state([m["mac"]], "provisioned", TIMEOUT_S)
        _wait(
            "the machine to boot its disk",
            lambda: MARKER[:24] in Path(m["serial_log"]).read_bytes(),
            rack,
            timeout=180,
        )
        claim = rack.json("machines", "show", mid)["claim_id"]
        rack.ctl("claims", "release", claim, "--yes")
        rack.wait_state([m["mac"]], "ready", TIMEOUT_S)
        boots = rack.json("events", "--machine", mid, "--kind", "provision.network-boot")["items"]
        assert len(boots) >= 3 and all(e["data"]["via"] == "virtual-media" for e in boots), boots
        inserts = [c for c in _commands(m) if c.startswith("insert ")]
        assert len(inserts) >= 3 and len(set(inserts)) == len(inserts)  # a fresh nonce each boot
        assert not any(c.startswith("boot pxe") for c in _commands(m))
        _wait(
            "three ejects",
            lambda: (
                len(rack.json("events", "--machine", mid, "--kind", "bmc.vmedia-ejected")["items"])
                >= 3
            ),
            rack,
            timeout=60,
        )
    finally:
        rack.down()


def test_a_uefi_vm_enrolls_through_virtual_media_with_metalds_ipxe(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Issue 28, item 3: the same path for a UEFI machine (OVMF). The per-boot ISO's EFI
    boot image holds metald's own ipxe.efi and the boot's script; OVMF boots the CD, iPXE runs
    that script from the CD (``file:/metald.ipxe``), takes dnsmasq's address and fetches the
    boot's nonce script from metald. METALD_LAB_LONG=1: a UEFI TCG boot (~1-2 min) and the
    first run on a machine builds metald's iPXE."""
    if os.environ.get("METALD_LAB_LONG") != "1":
        pytest.skip("a UEFI TCG boot and metald's iPXE build: METALD_LAB_LONG=1")
    reason = lab_skip_reason()
    if reason:
        pytest.skip(reason)
    if shutil.which("dnsmasq") is None or shutil.which("mcopy") is None:
        pytest.skip("needs dnsmasq (the network's own DHCP server) and mtools")
    from vmlab.rack import LabRack

    work = tmp_path_factory.mktemp("vmedia-uefi")
    assets = lab_ipxe_assets(work / "assets")
    rack = LabRack(
        f"vu{os.getpid() % 10000}",
        work,
        machines=1,
        uefi=1,
        rng=True,
        assets=assets,
        boot_config='dhcp_mode = "off"\n',  # metald answers no DHCP, so no PXE either
    )
    try:
        m = rack.machines[0]
        assert m["firmware"] == "uefi"
        assert "virtual-media ISOs boot BIOS machines only" not in rack.log.read_text()
        _dnsmasq(rack, work)
        mid, took = _enroll_by_virtual_media(rack, m)
        sent = _commands(m)
        assert any(c.startswith(f"insert {rack.url}/boot/n/{mid}/") for c in sent), sent
        assert not any(c.startswith("boot pxe") for c in sent), sent
        serial = Path(m["serial_log"]).read_text(errors="replace")
        assert f"/boot/n/{mid}/" in serial, serial[-3000:]  # iPXE fetched the nonce script
        print(f"\nUEFI virtual media (metald's ipxe.efi from the ISO): boot -> ready {took:.1f} s")
    finally:
        rack.down()


def test_a_bios_vm_enrolls_through_virtual_media_over_https_with_metalds_lkrn(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 28: BIOS virtual media over HTTPS. metald runs its own CA (tls_auto) with
    require_https on, so the nonce script goes over HTTPS only; the per-boot ISO's BIOS side is
    metald's ipxe.lkrn (isolinux loads it with the boot's script as its initrd), whose embedded
    script runs that initrd, takes dnsmasq's address and fetches the nonce script pinned to
    metald's CA. Debian's ipxe.krn (before) has no HTTPS and could never fetch it. The lab
    BMC fetches the ISO over the same HTTPS (it trusts the lab CA, as an operator configures
    a BMC's certificate store). METALD_LAB_LONG=1: a TCG boot and metald's iPXE build."""
    if os.environ.get("METALD_LAB_LONG") != "1":
        pytest.skip("a TCG boot and metald's iPXE build: METALD_LAB_LONG=1")
    reason = lab_skip_reason()
    if reason:
        pytest.skip(reason)
    if shutil.which("dnsmasq") is None:
        pytest.skip("needs dnsmasq (the network's own DHCP server)")
    from vmlab.labipxe import lab_ca, seed_state
    from vmlab.rack import LabRack

    work = tmp_path_factory.mktemp("vmedia-bios-https")
    assets = lab_ipxe_assets(work / "assets")
    seed_state(work / "metald")  # metald's tls_auto CA is the one its iPXE trusts
    monkeypatch.setenv("SSL_CERT_FILE", str(lab_ca()))  # the lab BMC's certificate store
    rack = LabRack(
        f"vb{os.getpid() % 10000}",
        work,
        machines=1,
        uefi=0,
        rng=True,
        assets=assets,
        # metald answers no DHCP, so no PXE either; machines' listener HTTPS only
        boot_config='dhcp_mode = "off"\nhttp_listen = "0.0.0.0:8443"\n',
    )
    try:
        st, m = rack.state, rack.machines[0]
        log = rack.log.read_text()
        assert "tls_auto stays off" not in log, log[-3000:]
        assert "boot BIOS machines into Debian's iPXE" not in log, log[-3000:]
        _dnsmasq(rack, work)
        mid, took = _enroll_by_virtual_media(rack, m)
        addr = st["boot_address"]
        sent = _commands(m)
        assert any(c.startswith(f"insert https://{addr}:8443/boot/n/{mid}/") for c in sent), sent
        serial = Path(m["serial_log"]).read_text(errors="replace")
        # metald's iPXE (Debian's 2019 build says 1.0.0+), the nonce script over HTTPS
        assert f"https://{addr}:8443/boot/n/{mid}/" in serial, serial[-3000:]
        assert "Could not boot" not in serial, serial[-3000:]
        print(f"\nBIOS virtual media over HTTPS (metald's ipxe.lkrn): boot -> ready {took:.1f} s")
    finally:
        rack.down()
