"""The arm64 node image's disk form (``bootassets.node.build_efi_disk``): a GPT disk whose EFI
system partition holds Debian's systemd-boot at the removable path EFI/BOOT/BOOTAA64.EFI with
the kernel and initrd, and an ext4 partition labelled root, as metald's deploy agent and the
node expect it.

The structure is read here with independent tools (sgdisk, mtools, dumpe2fs, the PE header by
hand). Under METALD_LAB_LONG=1 the real disk boots for real: QEMU's virt board, AAVMF (UEFI),
TCG; the firmware finds BOOTAA64.EFI, systemd-boot loads the kernel, and the node reads the
NoCloud seed from the root partition (the step metald's deploy agent prepares)."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import time
from pathlib import Path

import pytest

from bootassets import build, node

IMAGE_MACHINE_ARM64 = 0xAA64  # PE/COFF IMAGE_FILE_MACHINE_ARM64
TOOLS = ("sgdisk", "mformat", "mcopy", "mmd", "mtype", "mdir", "mkfs.ext4", "dumpe2fs")


def pe_machine(data: bytes) -> int | None:
    """A PE image's COFF machine type (the firmware runs only its own), read by hand."""
    if data[:2] != b"MZ":
        return None
    pe = struct.unpack_from("<I", data, 0x3C)[0]
    if data[pe : pe + 4] != b"PE\0\0":
        return None
    return int(struct.unpack_from("<H", data, pe + 4)[0])


@pytest.fixture(scope="module")
def systemd_boot(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if any(shutil.which(t) is None for t in TOOLS) or shutil.which("apt-get") is None:
        pytest.skip(f"needs {', '.join(TOOLS)} and apt-get")
    a = build.get_arch("arm64")
    try:
        shown = build._apt_show(a.pkg("systemd-boot-efi"))
    except build.BuildError as e:
        pytest.skip(f"no arm64 package lists: {e}")
    version = shown["systemd-boot-efi"]["Version"]
    into = tmp_path_factory.mktemp("sdboot")
    return build._download(f"{a.pkg('systemd-boot-efi')}={version}", into)


def test_the_disk_is_gpt_with_an_esp_and_a_root(systemd_boot: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    kernel, initrd = tmp_path / "vmlinuz", tmp_path / "initrd.img"
    kernel.write_bytes(b"MZ" + os.urandom(4096))
    initrd.write_bytes(os.urandom(8192))
    info = node.build_efi_disk(out, kernel, initrd, systemd_boot, "ttyAMA0")
    disk = out / "disk.raw"
    assert disk.stat().st_size == info["bytes"] == node.EFI_DISK_BYTES
    table = subprocess.run(["sgdisk", "-p", str(disk)], capture_output=True, text=True, check=True)
    rows = re.findall(r"^\s+(\d)\s+(\d+)\s+(\d+)\s+\S+ \S+\s+(\w{4})\s+(\S+)$", table.stdout, re.M)
    esp, root = info["esp"], info["partition"]  # type: ignore[index]
    assert rows == [
        ("1", str(esp["offset"] // 512), str((esp["offset"] + esp["bytes"]) // 512 - 1), "EF00", "ESP"),
        ("2", str(root["offset"] // 512), str((root["offset"] + root["bytes"]) // 512 - 1), "8300", "root"),
    ], table.stdout  # fmt: skip
    at = f"{disk}@@{esp['offset']}"
    listing = subprocess.run(["mdir", "-i", at, "-/", "-b", "::"], capture_output=True, text=True)
    assert set(listing.stdout.split()) >= {
        "::/EFI/BOOT/BOOTAA64.EFI",
        "::/loader/loader.conf",
        "::/loader/entries/node.conf",
        "::/vmlinuz",
        "::/initrd.img",
    }, listing.stdout
    efi = subprocess.run(
        ["mtype", "-i", at, "::/EFI/BOOT/BOOTAA64.EFI"], capture_output=True, check=True
    ).stdout
    assert pe_machine(efi) == IMAGE_MACHINE_ARM64  # an arm64 UEFI application
    assert efi == (systemd_boot / node.SYSTEMD_BOOT_EFI).read_bytes()
    entry = subprocess.run(
        ["mtype", "-i", at, "::/loader/entries/node.conf"], capture_output=True, text=True
    ).stdout
    assert "linux /vmlinuz" in entry and "initrd /initrd.img" in entry
    assert "metald.boot=disk console=ttyAMA0,115200" in entry
    copied = subprocess.run(["mtype", "-i", at, "::/initrd.img"], capture_output=True).stdout
    assert copied == initrd.read_bytes()
    fat = subprocess.run(["minfo", "-i", at, "::"], capture_output=True, text=True).stdout
    assert 'disk type="FAT32   "' in fat, fat  # UEFI requires FAT32 of an ESP
    ext = subprocess.run(
        ["dumpe2fs", "-h", f"{disk}?offset={root['offset']}"], capture_output=True, text=True
    )
    assert re.search(r"^Filesystem volume name:\s+root$", ext.stdout, re.M), ext.stdout[:500]


def _long_reason() -> str | None:
    if os.environ.get("METALD_LAB_LONG") != "1":
        return "booting an emulated arm64 machine takes minutes: set METALD_LAB_LONG=1"
    if shutil.which("qemu-system-aarch64") is None:
        return "qemu-system-arm is not installed"
    from vmlab.qemu import AAVMF_CODE, AAVMF_VARS

    if not (AAVMF_CODE.exists() and AAVMF_VARS.exists()):
        return "qemu-efi-aarch64 (AAVMF) is not installed"
    return None


def test_the_arm64_disk_boots_under_uefi(tmp_path: Path) -> None:
    reason = _long_reason()
    if reason:
        pytest.skip(reason)
    from bootassets.node import ensure_node_built
    from vmlab import procs
    from vmlab.qemu import AAVMF_CODE, AAVMF_VARS

    image = ensure_node_built(arch="arm64")
    manifest = json.loads((image / "manifest.json").read_text())
    assert manifest["disk"]["table"] == "gpt", manifest.get("disk")
    disk = tmp_path / "disk.raw"
    shutil.copyfile(image / "disk.raw", disk)
    offset = manifest["disk"]["partition"]["offset"]
    seed = "/var/lib/cloud/seed/nocloud"
    (tmp_path / "meta-data").write_text('{"instance-id": "a64-1", "local-hostname": "grace-d1"}\n')
    (tmp_path / "user-data").write_text("#cloud-config\n")
    for cmd in (
        "mkdir /var/lib/cloud/seed",
        f"mkdir {seed}",
        f"write {tmp_path / 'meta-data'} {seed}/meta-data",
        f"write {tmp_path / 'user-data'} {seed}/user-data",
    ):
        subprocess.run(["debugfs", "-w", "-R", cmd, f"{disk}?offset={offset}"], check=True, capture_output=True)  # fmt: skip
    vars_fd = tmp_path / "vars.fd"
    shutil.copyfile(AAVMF_VARS, vars_fd)
    console = tmp_path / "console.log"
    cmd = [
        "qemu-system-aarch64", "-M", "virt", "-cpu", "cortex-a72", "-accel", "tcg", "-m", "1024",
        "-drive", f"if=pflash,format=raw,unit=0,readonly=on,file={AAVMF_CODE}",
        "-drive", f"if=pflash,format=raw,unit=1,file={vars_fd}",
        "-drive", f"file={disk},format=raw,if=virtio", "-nic", "none",
        "-display", "none", "-monitor", "none", "-serial", f"file:{console}", "-no-reboot",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    t0 = time.monotonic()
    wanted = "metald-node: hostname grace-d1 from the seed on /dev/vda2"
    text = ""
    try:
        while time.monotonic() - t0 < 600 and proc.poll() is None:
            text = console.read_text(errors="replace") if console.exists() else ""
            if wanted in text:
                break
            time.sleep(1)
    finally:
        procs.stop_group(proc)
    took = time.monotonic() - t0
    assert wanted in text, text[-3000:]
    assert "metald-node: disk boot: reading the NoCloud seed" in text
    print(f"\narm64 disk form: power-on to the node reading its seed {took:.1f} s (TCG, AAVMF)")
