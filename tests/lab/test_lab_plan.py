"""The lab plan (names, subnets, MACs) and the QEMU command line, without building anything."""

from __future__ import annotations

import dataclasses
import ipaddress
import shutil
from pathlib import Path

import pytest

from .labtools import plan, qemu


def test_interface_names_fit_the_kernel_limit_and_differ_across_labs() -> None:
    names = set()
    for slot in (1, 99, plan.MAX_SLOT):
        names.add(plan.bridge_name(slot))
        for index in range(plan.MAX_MACHINES):
            names.add(plan.tap_name(slot, index))
    assert all(len(n) <= 15 for n in names)
    assert len(names) == 3 * (plan.MAX_MACHINES + 1)


def test_address_plan_of_a_slot() -> None:
    net = plan.subnet(7)
    assert str(net) == "10.7.0.0/24"
    assert str(plan.boot_address(7)) == "10.7.0.1"
    bmcs = [plan.bmc_address(7, i) for i in range(plan.MAX_MACHINES)]
    assert str(bmcs[0]) == "10.7.0.2" and str(bmcs[-1]) == "10.7.0.99"
    low, high = plan.dhcp_range(7)
    assert all(a < low for a in bmcs) and high in net
    assert not net.overlaps(plan.subnet(8))
    assert net.subnet_of(plan.lab_supernet(7))
    with pytest.raises(plan.PlanError):
        plan.bmc_address(7, plan.MAX_MACHINES)


def test_machines_mix_bios_and_uefi_with_unique_macs() -> None:
    machines = plan.plan_machines(3, 4, 1)
    assert [m.firmware for m in machines] == ["bios", "bios", "bios", "uefi"]
    macs = {m.mac for m in machines} | {m.mac for m in plan.plan_machines(4, 4, 1)}
    assert len(macs) == 8
    for m in machines:
        assert ipaddress.IPv4Address(m.bmc_address) in plan.subnet(3)
        assert int(m.mac.split(":")[0], 16) & 1 == 0  # unicast


def test_attached_namespaces_belong_to_their_lab() -> None:
    ns = plan.attached_netns_name("demo", "hub")
    assert plan.lab_of_netns(ns) == "demo" and plan.lab_of_netns(plan.netns_name("demo")) == "demo"
    assert plan.lab_of_netns("other-ns") is None
    low, high = plan.dhcp_range(5)
    hubs = [plan.attached_address(5, i) for i in range(plan.MAX_ATTACHED)]
    assert high < hubs[0] and hubs[-1] < plan.subnet(5).broadcast_address
    names = [n for i in range(plan.MAX_ATTACHED) for n in plan.attached_veth_names(250, i)]
    assert len(set(names)) == len(names) and all(len(n) <= 15 for n in names)
    with pytest.raises(plan.PlanError):
        plan.attached_netns_name("demo", "Bad+suffix")


@pytest.mark.parametrize(
    ("machines", "uefi"), [(-1, 0), (0, 1), (plan.MAX_MACHINES + 1, 0), (2, 3), (2, -1)]
)
def test_impossible_labs_are_refused(machines: int, uefi: int) -> None:
    with pytest.raises(plan.PlanError):
        plan.plan_machines(1, machines, uefi)


def test_a_lab_of_no_machines_is_the_network_alone() -> None:
    assert plan.plan_machines(1, 0, 0) == []


@pytest.mark.parametrize("name", ["", "Upper", "has space", "-lead", "a" * 32, "x/y"])
def test_bad_lab_names_are_refused(name: str) -> None:
    with pytest.raises(plan.PlanError):
        plan.netns_name(name)


def _spec(firmware: str, tmp_path: Path) -> qemu.MachineSpec:
    return qemu.MachineSpec(
        name="lab-m0",
        firmware=firmware,
        uuid="9f0c3a52-51a4-4d57-8d2b-7a3e0c1f7a11",
        mac="52:54:00:6c:01:00",
        tap="mlab1t0",
        disk=tmp_path / "m0.qcow2",
        serial_log=tmp_path / "m0.serial.log",
        qmp_bmc=tmp_path / "m0.qmp-bmc",
        qmp=tmp_path / "m0.qmp",
        uefi_vars=tmp_path / "m0.vars.fd" if firmware == "uefi" else None,
    )


def test_command_line_starts_paused_with_ipxe_nic_and_both_boot_devices(tmp_path: Path) -> None:
    argv = qemu.command_line(_spec("bios", tmp_path), "tcg")
    joined = " ".join(argv)
    assert "-S" in argv and "-no-shutdown" in argv
    assert "virtio-net-pci,id=nic0,netdev=net0,mac=52:54:00:6c:01:00,bootindex=2" in joined
    assert "virtio-blk-pci,id=disk0,drive=drive0,bootindex=1" in joined
    assert "romfile=" not in joined  # the default ROM of virtio-net-pci is iPXE
    assert "pflash" not in joined
    assert joined.count("-qmp unix:") == 2
    # no RNG unless asked for (with one, the failover lab's warm machines PXE-booted by
    # themselves); asked for, a hardware RNG, so metald's iPXE does not gather TLS entropy
    assert "virtio-rng-pci" not in joined
    spec = dataclasses.replace(_spec("bios", tmp_path), rng=True)
    joined = " ".join(qemu.command_line(spec, "tcg"))
    assert "rng-random,id=rng0,filename=/dev/urandom" in joined
    assert "virtio-rng-pci,rng=rng0" in joined


def test_uefi_machines_get_ovmf_with_their_own_variable_store(tmp_path: Path) -> None:
    joined = " ".join(qemu.command_line(_spec("uefi", tmp_path), "tcg"))
    assert f"readonly=on,file={qemu.OVMF_CODE}" in joined
    assert f"unit=1,file={tmp_path / 'm0.vars.fd'}" in joined
    spec = _spec("uefi", tmp_path)
    with pytest.raises(qemu.QemuError):
        qemu.command_line(
            qemu.MachineSpec(**{**spec.__dict__, "uefi_vars": None}),
            "tcg",
        )


def test_arm64_machines_are_virt_boards_with_aavmf_under_tcg(tmp_path: Path) -> None:
    spec = dataclasses.replace(_spec("uefi", tmp_path), arch="arm64")
    argv = qemu.command_line(spec, "kvm")  # an x86 host has no arm64 KVM: TCG whatever is asked
    joined = " ".join(argv)
    assert argv[0] == "qemu-system-aarch64" and "-accel tcg" in joined
    assert "-machine virt" in joined and f"-cpu {qemu.ARM64_CPU}" in joined
    assert f"readonly=on,file={qemu.AAVMF_CODE}" in joined
    assert f"unit=1,file={tmp_path / 'm0.vars.fd'}" in joined
    # the same device ids the virtual BMC drives; no x86 option ROM on the NIC
    assert "virtio-net-pci,id=nic0,netdev=net0,mac=52:54:00:6c:01:00,bootindex=2,romfile=" in joined
    assert "virtio-blk-pci,id=disk0,drive=drive0,bootindex=1" in joined
    assert "scsi-cd,id=cd0" in joined and "ide-cd" not in joined
    assert "-S" in argv and "-no-shutdown" in argv and joined.count("-qmp unix:") == 2
    with pytest.raises(qemu.QemuError, match="arm64 machine boots UEFI"):
        qemu.command_line(dataclasses.replace(spec, firmware="bios", uefi_vars=None), "tcg")


def test_a_lab_makes_its_last_uefi_machines_arm64(tmp_path: Path) -> None:
    from vmlab.lab import Lab, LabError

    lab = Lab("arm", machines=3, uefi=2, arm64=1, workdir=tmp_path)
    state = lab._planned_state(7, "tcg")
    assert [(m["firmware"], m["arch"]) for m in state["machines"]] == [
        ("bios", "amd64"),
        ("uefi", "amd64"),
        ("uefi", "arm64"),
    ]
    with pytest.raises(LabError, match="arm64 machines boot UEFI"):
        Lab("arm", machines=2, uefi=1, arm64=2, workdir=tmp_path)


def test_a_lab_gives_machines_further_nics_on_a_data_network_and_further_disks(
    tmp_path: Path,
) -> None:
    from vmlab.lab import Lab, LabError

    state = Lab("multi", machines=2, uefi=0, nics=3, disks=2, workdir=tmp_path)._planned_state(
        7, "tcg"
    )
    assert state["data_bridge"] == "mlab7db" != state["bridge"]
    macs, taps = set(), set()
    for m in state["machines"]:
        assert len(m["extra_nics"]) == 2 and len(m["extra_disks"]) == 1
        macs |= {m["mac"]} | {n["mac"] for n in m["extra_nics"]}
        taps |= {m["tap"]} | {n["tap"] for n in m["extra_nics"]}
        assert m["extra_disks"][0] != m["disk"]
    assert len(macs) == len(taps) == 6  # every NIC of the lab its own MAC and tap
    assert all(len(t) <= 15 for t in taps | {plan.nic_tap_name(250, 97, 9)})
    # one NIC: no data network, as before
    plain = Lab("one", machines=1, uefi=0, workdir=tmp_path)._planned_state(7, "tcg")
    assert plain["data_bridge"] is None and plain["machines"][0]["extra_nics"] == []
    with pytest.raises(LabError, match="nics must be"):
        Lab("bad", machines=1, nics=0, workdir=tmp_path)

    spec = dataclasses.replace(
        _spec("bios", tmp_path),
        serial_number="VMLAB-A-LONG-LAB-NAME-M0",
        extra_nics=(("52:54:00:6d:01:00", "mlab1t0n1"), ("52:54:00:6e:01:00", "mlab1t0n2")),
        extra_disks=(tmp_path / "m0.d1.qcow2",),
    )
    joined = " ".join(qemu.command_line(spec, "tcg"))
    # the data NICs: no option ROM and no boot index (the machine PXE-boots its first NIC)
    assert "virtio-net-pci,id=nic1,netdev=net1,mac=52:54:00:6d:01:00,romfile=" in joined
    assert "virtio-net-pci,id=nic2,netdev=net2,mac=52:54:00:6e:01:00,romfile=" in joined
    assert "tap,id=net2,ifname=mlab1t0n2," in joined
    assert joined.count("bootindex=") == 2
    # serial numbers tell the disks apart within virtio-blk's 20 bytes
    serials = [qemu.disk_serial(spec, i) for i in (0, 1)]
    assert serials == ["LONG-LAB-NAME-M0-D0", "LONG-LAB-NAME-M0-D1"]
    assert f"virtio-blk-pci,id=disk0,drive=drive0,bootindex=1,serial={serials[0]}" in joined
    assert f"virtio-blk-pci,id=disk1,drive=drive1,serial={serials[1]}" in joined
    assert f"file={tmp_path / 'm0.d1.qcow2'},if=none,id=drive1,format=qcow2" in joined


@pytest.mark.skipif(shutil.which(qemu.QEMU) is None, reason="needs qemu-system-x86")
def test_accelerator_override_and_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VMLAB_ACCEL", "kvm")
    assert qemu.choose_accelerator(tmp_path) == "kvm"
    monkeypatch.delenv("VMLAB_ACCEL")
    # A cached answer for this QEMU and kernel is used without probing again.
    monkeypatch.setattr(qemu, "_kvm_boots_probe", lambda timeout: pytest.fail("probed"))
    key = f"{qemu._qemu_version()} | {__import__('platform').release()}"
    (tmp_path / "accel.json").write_text(f'{{"key": "{key}", "accel": "tcg"}}')
    assert qemu.choose_accelerator(tmp_path) == "tcg"
