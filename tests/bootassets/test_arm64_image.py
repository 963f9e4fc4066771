"""The arm64 discovery image (``python -m bootassets build --arch arm64``): built from Debian's
arm64 packages, every ELF file in it (programs, libraries, kernel modules, the commissioning
tools) is for arm64, read from the ELF header here with no QEMU; the kernel is an arm64 Image;
``--install`` puts it under <assets_dir>/arm64/ where metald serves an arm64 machine's boot."""

from __future__ import annotations

import gzip
import os
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from bootassets import build

EM_AARCH64 = 183
EM_X86_64 = 62
BUSYBOX = shutil.which("busybox")


def e_machine(data: bytes) -> int | None:
    """The ELF header's e_machine (None for a file that is not ELF), read independently of
    bootassets.elf."""
    if data[:4] != b"\x7fELF":
        return None
    endian = "<" if data[5] == 1 else ">"
    return int(struct.unpack_from(endian + "H", data, 18)[0])


def _extract(archive: bytes, into: Path) -> None:
    into.mkdir()
    subprocess.run(
        [str(BUSYBOX), "cpio", "-i", "-d", "-m"], input=archive, cwd=into, check=True,
        capture_output=True,
    )  # fmt: skip


def _elf_files(root: Path) -> dict[str, int]:
    out = {}
    for p in root.rglob("*"):
        if p.is_file() and not p.is_symlink():
            m = e_machine(p.read_bytes()[:64])
            if m is not None:
                out[str(p.relative_to(root))] = m
    return out


@pytest.fixture(scope="session")
def arm64_assets() -> Path:
    """The arm64 discovery image, built once into the cache (then reused): ~90 MB of arm64
    packages downloaded and packed, minutes on a fresh machine, so under METALD_LAB_LONG=1
    (make test-long); make test keeps the DHCP, script and claim checks (tests/boot,
    tests/claims/test_arm64_claims.py)."""
    if os.environ.get("METALD_LAB_LONG") != "1":
        pytest.skip("builds the arm64 image: set METALD_LAB_LONG=1 (make test-long)")
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        pytest.skip("building boot assets needs apt-get and dpkg-deb (Debian)")
    foreign = subprocess.run(
        ["dpkg", "--print-foreign-architectures"], capture_output=True, text=True, check=False
    ).stdout.split()
    if "arm64" not in foreign:
        pytest.skip("dpkg has no arm64 architecture: run scripts/bootstrap as root")
    return build.ensure_built(arch="arm64")


@pytest.mark.skipif(BUSYBOX is None, reason="busybox is not installed")
def test_every_binary_in_the_arm64_image_is_arm64(arm64_assets: Path, tmp_path: Path) -> None:
    manifest = build.verify(arm64_assets)
    assert manifest["arch"] == "arm64" and manifest["console"] == "ttyAMA0"
    assert arm64_assets.name == f"arm64-{manifest['inputs_hash']}"
    assert (arm64_assets.parent / "arm64-current").resolve() == arm64_assets
    assert manifest["kernel_version"].endswith("-arm64")
    assert "linux-image-" in str(manifest["inputs"]["packages"]["kernel"])  # type: ignore[index]
    assert str(manifest["inputs"]["packages"]["busybox"]).startswith("busybox-static:arm64=")  # type: ignore[index]
    files: dict[str, object] = manifest["files"]  # type: ignore[assignment]
    assert not [f for f in files if f.endswith((".kpxe", ".efi"))]  # Debian has no arm64 iPXE
    # the kernel: an arm64 Linux Image (its header's magic "ARM\x64" at 0x38; it is a PE file
    # for UEFI too, which is how iPXE starts it)
    kernel = (arm64_assets / "discovery/vmlinuz").read_bytes()
    assert kernel[0x38:0x3C] == b"ARM\x64" and kernel[:2] == b"MZ"

    root = tmp_path / "initrd"
    _extract(build.unpack_initramfs((arm64_assets / "discovery/initrd.img").read_bytes()), root)
    elves = _elf_files(root)
    for need in ("bin/busybox", "usr/bin/ipmitool", "usr/bin/qemu-img", "usr/bin/curl"):
        assert elves.get(need) == EM_AARCH64, need
    modules = [p for p in elves if p.endswith(".ko")]
    assert {Path(p).stem for p in modules} >= {"virtio_net", "virtio_pci", "nvme", "mlx5_core"}
    libs = [p for p in elves if p.startswith("lib/aarch64-linux-gnu/")]
    assert "lib/aarch64-linux-gnu/libc.so.6" in libs
    wrong = {p: m for p, m in elves.items() if m != EM_AARCH64}
    assert wrong == {}, f"non-arm64 ELF files in the arm64 image: {wrong}"
    # programs find their loader where PT_INTERP says (/lib/ld-linux-aarch64.so.1)
    loader = root / "lib/ld-linux-aarch64.so.1"
    assert loader.is_symlink()
    assert (root / str(loader.readlink()).lstrip("/")).is_file()
    assert not (root / "lib64").exists() and not (root / "lib/x86_64-linux-gnu").exists()

    tools = tmp_path / "tools"
    _extract(gzip.decompress((arm64_assets / build.COMMISSION_IMAGE).read_bytes()), tools)
    tool_elves = _elf_files(tools)
    for need in ("usr/bin/stress-ng", "usr/sbin/memtester", "usr/bin/fio", "usr/sbin/smartctl"):
        assert tool_elves.get(need) == EM_AARCH64, need
    assert {p: m for p, m in tool_elves.items() if m != EM_AARCH64} == {}
    print(
        f"\narm64 image: {manifest['total_bytes'] / 1e6:.1f} MB, {len(elves)} ELF files in the "
        f"initrd, {len(tool_elves)} in the commissioning tools, all arm64"
    )


def test_install_puts_the_arm64_build_under_arm64(arm64_assets: Path, tmp_path: Path) -> None:
    assets = tmp_path / "assets"
    assets.mkdir()
    dest = build.install_arch(arm64_assets, assets)
    assert dest == assets / "arm64"
    for rel in ("discovery/vmlinuz", "discovery/initrd.img", build.COMMISSION_IMAGE):
        assert (dest / rel).read_bytes() == (arm64_assets / rel).read_bytes()
    assert build.verify(dest)["arch"] == "arm64"
    build.install_arch(arm64_assets, assets)  # again: replaced, nothing left over
    assert sorted(p.name for p in assets.iterdir()) == ["arm64"]


def test_a_binary_of_another_architecture_is_refused(tmp_path: Path) -> None:
    """The build reads every program's and library's ELF header: an amd64 file slipping into
    the arm64 image (a package without :arm64) fails the build, not the machine."""
    x86 = tmp_path / "tool"
    x86.write_bytes(
        b"\x7fELF\x02\x01\x01" + bytes(9) + struct.pack("<HH", 2, EM_X86_64) + bytes(44)
    )
    with pytest.raises(build.BuildError, match="tool is built for amd64, not arm64"):
        build.check_elf(x86, build.ARM64)
    assert build.check_elf(x86, build.AMD64)[:4] == b"\x7fELF"
    (tmp_path / "script").write_bytes(b"#!/bin/sh\n")
    with pytest.raises(build.BuildError, match="not an ELF64"):
        build.check_elf(tmp_path / "script", build.ARM64)
    with pytest.raises(build.BuildError, match="no architecture 'riscv64'"):
        build.get_arch("riscv64")


@pytest.mark.skipif(BUSYBOX is None, reason="busybox is not installed")
def test_the_arm64_node_image_is_arm64_throughout(tmp_path: Path) -> None:
    """The tenant node image for arm64 (``python -m bootassets node --arch arm64``): slurmd,
    munged, wg, nft, curl and every library and Slurm plugin are arm64 ELF files; stateless
    only. A second ~50 MB arm64 download and build: under METALD_LAB_LONG=1 (make test-long)."""
    import os

    if os.environ.get("METALD_LAB_LONG") != "1":
        pytest.skip("builds a second arm64 image: set METALD_LAB_LONG=1 (make test-long)")
    from bootassets.node import ensure_node_built

    node = ensure_node_built(arch="arm64")
    manifest = build.verify(node)
    assert manifest["arch"] == "arm64" and manifest["disk"] is None
    assert node.name.startswith("node-arm64-")
    root = tmp_path / "node"
    _extract(gzip.decompress((node / "initrd.img").read_bytes()), root)
    elves = _elf_files(root)
    for need in (
        "usr/sbin/slurmd",
        "usr/sbin/munged",
        "usr/bin/wg",
        "usr/sbin/nft",
        "usr/bin/curl",
    ):
        assert elves.get(need) == EM_AARCH64, need
    assert any(p.startswith("usr/lib/aarch64-linux-gnu/slurm-wlm/") for p in elves)
    assert {p: m for p, m in elves.items() if m != EM_AARCH64} == {}
    print(f"\narm64 node image: {manifest['total_bytes'] / 1e6:.1f} MB, {len(elves)} ELF files")
