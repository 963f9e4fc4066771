"""The discovery image build: cpio writer, module order, cache, manifest, size budget."""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from bootassets import cpio, kmod
from bootassets.build import (
    AGENT,
    COMMISSION_IMAGE,
    COMMISSION_SIZE_LIMIT,
    LZ4_LEGACY_MAGIC,
    SIZE_LIMIT,
    BuildError,
    compress_initramfs,
    inputs_hash,
    resolve_inputs,
    unpack_initramfs,
    verify,
)

BUSYBOX = shutil.which("busybox")


def extract(archive: bytes, into: Path) -> None:
    into.mkdir()
    subprocess.run(
        [BUSYBOX, "cpio", "-i", "-d", "-m"],
        input=archive,
        cwd=into,
        check=True,
        capture_output=True,
    )


def test_initramfs_compression_is_deterministic_and_round_trips():
    packed = cpio.pack([cpio.directory("bin"), cpio.file("init", b"#!/bin/sh\n" * 5000, 0o755)])
    out = compress_initramfs(packed)
    assert out.startswith(LZ4_LEGACY_MAGIC) and len(out) < len(packed)
    assert compress_initramfs(packed) == out  # the same inputs give the same bytes
    assert unpack_initramfs(out) == packed


@pytest.mark.skipif(BUSYBOX is None, reason="busybox is not installed")
def test_cpio_archive_unpacks_with_busybox(tmp_path):
    entries = [
        cpio.directory("bin"),
        cpio.file("bin/tool", b"#!/bin/sh\necho hi\n", 0o755),
        cpio.symlink("bin/sh", "tool"),
        cpio.file("etc/odd-length", b"abc"),
        cpio.directory("etc"),
    ]
    archive = cpio.pack(entries)
    assert archive == cpio.pack(list(reversed(entries)))  # order-independent, reproducible
    extract(archive, tmp_path / "x")
    assert (tmp_path / "x/bin/tool").read_bytes() == b"#!/bin/sh\necho hi\n"
    assert (tmp_path / "x/bin/tool").stat().st_mode & 0o777 == 0o755
    assert (tmp_path / "x/bin/sh").readlink() == Path("tool")
    assert (tmp_path / "x/etc/odd-length").read_bytes() == b"abc"


def test_load_order_puts_dependencies_first_and_reports_missing(tmp_path):
    def fake_module(name: str, depends: str) -> None:
        # a minimal ELF64 with one .modinfo section is enough for kmod.modinfo
        shstr = b"\0.modinfo\0.shstrtab\0"
        info = f"name={name}\0depends={depends}\0".encode()
        shoff = 64 + len(shstr) + len(info)
        header = bytearray(64)
        header[:6] = b"\x7fELF\x02\x01"
        header[0x28:0x30] = shoff.to_bytes(8, "little")
        header[0x3A:0x40] = (
            (64).to_bytes(2, "little") + (3).to_bytes(2, "little") + (2).to_bytes(2, "little")
        )

        def sh(name_off: int, offset: int, size: int) -> bytes:
            s = bytearray(64)
            s[0:4] = name_off.to_bytes(4, "little")
            s[0x18:0x20] = offset.to_bytes(8, "little")
            s[0x20:0x28] = size.to_bytes(8, "little")
            return bytes(s)

        body = (
            bytes(header)
            + shstr
            + info
            + sh(0, 0, 0)
            + sh(1, 64 + len(shstr), len(info))
            + sh(10, 64, len(shstr))
        )
        (tmp_path / f"{name.replace('_', '-')}.ko").write_bytes(body)

    fake_module("net_drv", "core_a,lib-b")
    fake_module("core_a", "lib_b")
    fake_module("lib_b", "")
    index = kmod.index_modules(tmp_path)
    assert kmod.load_order(["net_drv"], index) == ["lib_b", "core_a", "net_drv"]
    with pytest.raises(kmod.ModuleError, match="'missing' not found"):
        kmod.load_order(["missing"], index)
    fake_module("loop_x", "loop_y")
    fake_module("loop_y", "loop_x")
    with pytest.raises(kmod.ModuleError, match="cycle"):
        kmod.load_order(["loop_x"], kmod.index_modules(tmp_path))


@pytest.mark.skipif(shutil.which("apt-cache") is None, reason="needs apt (Debian)")
def test_inputs_hash_follows_the_inputs():
    inputs = resolve_inputs()
    assert inputs["packages"]["kernel"].startswith("linux-image-")
    assert (
        inputs["files"]["agent/metald-agent"]
        == __import__("hashlib").sha256(AGENT.read_bytes()).hexdigest()
    )
    changed = json.loads(json.dumps(inputs))
    changed["files"]["agent/metald-agent"] = "0" * 64
    assert inputs_hash(changed) != inputs_hash(inputs)
    assert inputs_hash(inputs) == inputs_hash(resolve_inputs())


def test_built_image_layout_and_budget(built_assets, tmp_path):
    manifest = verify(built_assets)
    assert manifest["inputs_hash"] == built_assets.name
    assert (built_assets.parent / "current").resolve() == built_assets
    for rel in (
        "discovery/vmlinuz",
        "discovery/initrd.img",
        "undionly.kpxe",
        "ipxe.efi",
        "snponly.efi",
    ):
        assert manifest["files"][rel]["size"] > 0
    # every boot loads the discovery image; the commissioning tools have their own budget
    tools = manifest["files"][COMMISSION_IMAGE]["size"]
    assert manifest["total_bytes"] - tools < SIZE_LIMIT
    assert 0 < tools < COMMISSION_SIZE_LIMIT
    print(
        f"\nboot assets: {manifest['total_bytes'] / 1e6:.1f} MB, initrd {manifest['files']['discovery/initrd.img']['size'] / 1e6:.1f} MB"
    )

    # LZ4's legacy frame (the kernel unpacks it ~0.7 s faster than gzip under TCG; bench/BOOT.md)
    initrd = (built_assets / "discovery/initrd.img").read_bytes()
    assert initrd.startswith(LZ4_LEGACY_MAGIC)
    root = tmp_path / "initrd"
    extract(unpack_initramfs(initrd), root)
    assert (root / "usr/bin/metald-agent").read_bytes() == AGENT.read_bytes()
    assert (root / "init").stat().st_mode & 0o111
    assert (root / "bin/sh").readlink() == Path("busybox")
    order = (root / "lib/modules/load-order").read_text().split()
    assert order == manifest["modules"]
    for want in ("virtio_net", "virtio_pci", "virtio_blk", "e1000", "nvme", "ahci", "sd_mod"):
        assert want in order
    # every module's dependencies (from its own .modinfo) are loaded before it
    moddir = root / "lib/modules" / manifest["kernel_version"]
    for i, name in enumerate(order):
        deps = kmod.modinfo((moddir / f"{name}.ko").read_bytes()).get("depends", [""])[0]
        assert set(filter(None, deps.replace("-", "_").split(","))) <= set(order[:i]), name


def test_tampered_build_is_detected(built_assets, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(built_assets, copy)
    (copy / "undionly.kpxe").write_bytes(b"not ipxe")
    with pytest.raises(BuildError, match="does not match its manifest"):
        verify(copy)


@pytest.mark.skipif(BUSYBOX is None, reason="busybox is not installed")
def test_drivers_are_chosen_by_what_is_on_the_pci_bus(built_assets, tmp_path):
    root = tmp_path / "initrd"
    extract(unpack_initramfs((built_assets / "discovery/initrd.img").read_bytes()), root)
    order = (root / "lib/modules/load-order").read_text().split()

    def select(*modaliases: str) -> list[str]:
        sysroot = tmp_path / f"sys{len(list(tmp_path.iterdir()))}"
        for i, alias in enumerate(modaliases):
            dev = sysroot / f"sys/bus/pci/devices/0000:00:{i:02x}.0"
            dev.mkdir(parents=True)
            (dev / "modalias").write_text(alias + "\n")
        out = subprocess.run(
            [BUSYBOX, "sh", str(root / "bin/select-drivers"), str(root / "lib/modules"), str(sysroot)],
            capture_output=True, text=True, check=True, env={"PATH": str(Path(BUSYBOX).parent)},
        )  # fmt: skip
        chosen = out.stdout.split()
        assert chosen == [m for m in order if m in chosen]  # dependency order kept
        return chosen

    always = {"virtio_net", "virtio_blk", "sd_mod", "ipmi_si", "ipmi_devintf"}
    qemu = select(
        "pci:v00001AF4d00001000sv00001AF4sd00000001bc02sc00i00",  # virtio-net (legacy id)
        "pci:v00008086d0000100Esv00001AF4sd00001100bc02sc00i00",  # e1000
    )
    assert always | {"virtio_pci", "virtio", "e1000"} <= set(qemu)
    assert not {"mlx5_core", "ice", "nvme"} & set(qemu)
    server = select(
        "pci:v000015B3d0000101Dsv000015B3sd00000016bc02sc00i00",  # ConnectX-6 Dx
        "pci:v0000144Dd0000A80Asv0000144Dsd0000A801bc01sc08i02",  # Samsung NVMe, matched by class
        "pci:v00008086d00001572sv00008086sd00000000bc02sc00i00",  # X710
    )
    assert {"mlx5_core", "mlxfw", "nvme", "nvme_core", "i40e"} <= set(server)
    assert not {"e1000", "virtio_pci", "ice", "bnxt_en"} & set(server)
    bare = set(select())
    assert always <= bare
    assert not {"e1000", "virtio_pci", "mlx5_core", "nvme", "ahci", "igb"} & bare


def test_ipmitool_runs_from_the_image(built_assets, tmp_path):
    """ipmitool and its library closure, as laid out in the initrd, run (chroot, root only)."""
    import os

    if os.geteuid() != 0:
        pytest.skip("chroot needs root")
    root = tmp_path / "initrd"
    extract(unpack_initramfs((built_assets / "discovery/initrd.img").read_bytes()), root)
    out = subprocess.run(
        ["chroot", str(root), "/usr/bin/ipmitool", "-V"], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ipmitool version")


def test_tpm2_tools_run_from_the_image(built_assets, tmp_path):
    """tpm2 (the agent's quotes, docs/attestation.md) and the device TCTI it loads by name at
    run time are in the initrd and run (chroot, root only)."""
    import os

    if os.geteuid() != 0:
        pytest.skip("chroot needs root")
    root = tmp_path / "initrd"
    extract(unpack_initramfs((built_assets / "discovery/initrd.img").read_bytes()), root)
    assert (root / "usr/lib/x86_64-linux-gnu/libtss2-tcti-device.so.0").exists()
    out = subprocess.run(
        ["chroot", str(root), "/usr/bin/tpm2", "rc_decode", "0x902"], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert "out of memory for object contexts" in out.stdout, out.stdout


def test_commissioning_tools_run_from_their_image(built_assets, tmp_path):
    """stress-ng, memtester, fio and smartctl with their library closure, as the agent unpacks
    commission/tools.img over the discovery image, run (chroot into the tools image alone:
    nothing is borrowed from the discovery image or the host; root only)."""
    import os

    if os.geteuid() != 0:
        pytest.skip("chroot needs root")
    root = tmp_path / "tools"
    extract(gzip.decompress((built_assets / COMMISSION_IMAGE).read_bytes()), root)
    for argv, want in (
        (["/usr/bin/stress-ng", "--version"], "stress-ng"),
        (["/usr/bin/fio", "--version"], "fio-"),
        (["/usr/sbin/smartctl", "--version"], "smartctl"),
        (["/usr/sbin/memtester"], "memtester version"),  # usage, with its version
    ):
        out = subprocess.run(["chroot", str(root), *argv], capture_output=True, text=True)
        assert want in out.stdout + out.stderr, (argv, out.stdout[-500:], out.stderr[-500:])
