"""Build the tenant node image: what a machine runs after metald provisions it.

The node boots, tells metald it is up, joins its tenant's WireGuard hub and starts the
tenant's scheduler agent (slurmd) by itself; ``bootassets/node/metald-node`` holds that protocol
and docs/node-image.md describes it. Like the discovery image (build.py) everything comes from
Debian packages fetched with ``apt-get download`` and unpacked with ``dpkg-deb -x``, never the
build host's installed files. Output goes to ``<cache>/node-<inputs-hash>/``:

    vmlinuz         Debian's linux-image-amd64 kernel (the discovery image's)
    initrd.img      cpio.gz: busybox-static, drivers + wireguard + nf_tables, ip, wg, nft, jq,
                    munged, slurmd, slurmstepd, the Slurm plugins, their library closures
    disk.raw        amd64 (built as root): BIOS-bootable raw disk: MBR + extlinux, one ext4
                    partition labelled "root" with /boot/{vmlinuz,initrd.img} and an empty
                    /etc/cloud. arm64: UEFI-bootable raw disk (``build_efi_disk``): GPT, an EFI
                    system partition with systemd-boot at the removable path
                    (EFI/BOOT/BOOTAA64.EFI, Debian's systemd-boot-efi) and the kernel and
                    initrd, and the ext4 partition labelled "root"
    manifest.json   inputs, their hash, sha256 and size of every file

``<cache>/node-current`` points at the latest build. ``arch="arm64"`` builds the same image
from Debian's arm64 packages into ``<cache>/node-arm64-<inputs-hash>/`` (``node-arm64-current``);
its disk form boots under UEFI (arm64 machines have no BIOS) and needs no root to build.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from bootassets import build, cpio, elf, kmod
from bootassets.build import BuildError

HERE = build.HERE
NODE_DIR = HERE / "node"
NODE_INIT = NODE_DIR / "init"
NODE_SCRIPT = NODE_DIR / "metald-node"
PREFIX = "node-"
CURRENT = "node-current"


def _prefix(arch: build.Arch) -> str:
    return PREFIX if arch is build.AMD64 else f"{PREFIX}{arch.name}-"


def _is_own_build(arch: build.Arch) -> Callable[[Path], bool]:
    """Which cache folders are ``arch``'s node builds (node-arm64-* are not amd64's)."""
    foreign = tuple(_prefix(a) for a in build.ARCHES.values() if a is not build.AMD64)
    if arch is build.AMD64:
        return lambda p: p.name.startswith(PREFIX) and not p.name.startswith(foreign)
    return lambda p: p.name.startswith(_prefix(arch))


#: The programs the node runs (besides busybox): image path -> path in the unpacked packages.
#: Busybox's ip cannot create wireguard links, hence iproute2's.
PROGRAMS = {
    "usr/sbin/ip": "bin/ip",
    "usr/bin/wg": "usr/bin/wg",
    "usr/sbin/nft": "usr/sbin/nft",
    "usr/bin/jq": "usr/bin/jq",
    "usr/sbin/munged": "usr/sbin/munged",
    "usr/bin/munge": "usr/bin/munge",
    "usr/bin/unmunge": "usr/bin/unmunge",
    "usr/sbin/slurmd": "usr/sbin/slurmd-wlm",
    "usr/sbin/slurmstepd": "usr/sbin/slurmstepd-wlm",
    # HTTPS to metald pinned to its CA (metald.ca=), never following a redirect
    "usr/bin/curl": "usr/bin/curl",
    # A tenant OS's own boot manager tool (the node is the tenant's machine): it changes the
    # UEFI boot order through efivarfs, what attestation must catch at the next wipe boot.
    "usr/bin/efibootmgr": "bin/efibootmgr",
}
#: The packages holding those programs; their library packages are found by apt.
TOP_PACKAGES = (
    "iproute2",
    "wireguard-tools",
    "nftables",
    "jq",
    "munge",
    "slurmd",
    "slurm-wlm-basic-plugins",
    "curl",
    "efibootmgr",
)
#: Dependencies apt names that hold no library a program here loads (maintainer-script and
#: debconf machinery); left out so the download stays small.
SKIP_PACKAGES = frozenset(
    {
        "adduser",
        "cdebconf",
        "debconf",
        "dpkg",
        "install-info",
        "lsb-base",
        "passwd",
        "sensible-utils",
        "sysvinit-utils",
        "tar",
        "ucf",
        "libdebian-installer4",
        "libnewt0.52",
        "libslang2",
        "libtextwrap1",
        "libpam-modules",
        "libpam-modules-bin",
        "libcap2-bin",
        "readline-common",
        "libsemanage-common",
        "libsemanage2",
        "libtirpc-common",
        "libaudit-common",
    }
)
#: Loaded by glibc with dlopen (pthread_cancel unwinding), so no DT_NEEDED names it.
DLOPENED = ("libgcc_s.so.1",)
PLUGIN_DIR = "usr/lib/x86_64-linux-gnu/slurm-wlm"


def plugin_dir(arch: build.Arch) -> str:
    return f"usr/lib/{arch.triplet}/slurm-wlm"


#: Plugin families only slurmctld, slurmrestd or the client commands load. Everything else in
#: the plugin dir goes in (the *_none ones are small and some are loaded whatever the config),
#: with its library closure; a plugin whose libraries are not packaged is left out.
PLUGIN_PRUNE = (
    "openapi_",
    "serializer_",
    "rest_auth_",
    "job_submit_",
    "cli_filter_",
    "burst_buffer_",
    "sched_",
    "priority_",
    "preempt_",
    "site_factor_",
    "mcs_",
    "jobcomp_filetxt",
    "jobcomp_lua",
    "jobcomp_script",
    "accounting_storage_slurmdbd",
    "node_features_knl_",
    "slurmctld_nonstop",
)
DISK_PACKAGES = ("extlinux", "syslinux-common")
#: The arm64 disk form's boot loader: systemd-boot's prebuilt UEFI binary (Debian builds it
#: for arm64; the firmware runs it from the removable path, no NVRAM entry needed).
EFI_DISK_PACKAGES = ("systemd-boot-efi",)
SYSTEMD_BOOT_EFI = "usr/lib/systemd/boot/efi/systemd-bootaa64.efi"
#: arm64 disk form: GPT, the EFI system partition (FAT32: the firmware reads only FAT; it
#: holds the kernel and initrd, which systemd-boot loads only from there), then root.
ESP_OFFSET = 1024 * 1024
ESP_BYTES = 64 * 1024 * 1024
EFI_ROOT_BYTES = 8 * 1024 * 1024
EFI_DISK_BYTES = ESP_OFFSET + ESP_BYTES + EFI_ROOT_BYTES + 1024 * 1024  # + the backup GPT
#: Fixed GUIDs: the same inputs build the same bytes.
EFI_DISK_GUIDS = (
    "6d657461-6c64-4e6f-8465-000000000000",
    "6d657461-6c64-4e6f-8465-000000000001",
    "6d657461-6c64-4e6f-8465-000000000002",
)
LOADER_CONF = "default node.conf\ntimeout 0\nconsole-mode keep\n"
#: Modules: the discovery image's NIC and disk drivers (picked by PCI alias at boot), ext4 for
#: the disk form (on demand), and, always loaded, kernel WireGuard and what nft needs for an
#: inet table matching ct state (nft_ct pulls nf_conntrack and its defrag modules). libcrc32c
#: (nf_tables, nf_conntrack) asks the crypto API for crc32c, which no module dependency names:
#: without crc32c_generic loaded first, nf_tables fails with "Unknown symbol crc32c".
NODE_ON_DEMAND = ("ext4",)
NODE_ALWAYS = ("crc32c_generic", "wireguard", "nf_tables", "nft_ct", "efivarfs")
NODE_MODULES = [
    *(m for m in build.MODULES if m not in build.ON_DEMAND and m not in build.ALWAYS_LOAD),
    *NODE_ON_DEMAND,
    *NODE_ALWAYS,
]
ETC = {
    "etc/passwd": "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n",
    "etc/group": "root:x:0:\nnogroup:x:65534:\n",
    "etc/hosts": "127.0.0.1\tlocalhost\n",
    "etc/nsswitch.conf": "passwd: files\ngroup: files\nshadow: files\nhosts: files dns\n",
    "etc/hostname": "metald-node\n",
}
DISK_BYTES = 64 * 1024 * 1024
PART_OFFSET = 1024 * 1024
EXTLINUX_CONF = """\
SERIAL 0 115200
DEFAULT node
PROMPT 0
TIMEOUT 0
LABEL node
  LINUX /boot/vmlinuz
  INITRD /boot/initrd.img
  APPEND metald.boot=disk console=tty0 console=ttyS0,115200 quiet
"""
#: The whole node folder must stay below this.
SIZE_LIMIT = 160 * 1024 * 1024


def default_cache() -> Path:
    return Path(os.environ.get("BOOTASSETS_CACHE") or build.DEFAULT_CACHE)


def node_files() -> list[Path]:
    """Our files that go into the image or decide what goes in (their hashes are inputs)."""
    return [
        NODE_INIT,
        NODE_SCRIPT,
        build.UDHCPC_SCRIPT,
        build.SELECT_DRIVERS,
        HERE / "node.py",
        HERE / "build.py",
        HERE / "cpio.py",
        HERE / "kmod.py",
        HERE / "elf.py",
    ]


def _library_packages(arch: build.Arch = build.AMD64) -> list[str]:
    """The library packages the top packages depend on, directly or not (apt's view)."""
    out = build._run(
        "apt-cache",
        "depends",
        "--recurse",
        "--no-recommends",
        "--no-suggests",
        "--no-conflicts",
        "--no-breaks",
        "--no-replaces",
        "--no-enhances",
        *map(arch.pkg, TOP_PACKAGES),
    )
    names = {
        line.strip().split(":")[0] for line in out.splitlines() if line and not line[0].isspace()
    }
    return sorted(
        n
        for n in names
        # ":arm64" and the like: a foreign architecture added to dpkg (for cross builds)
        # makes apt list other architectures' packages too; the image is the build host's.
        if not n.startswith("<")
        and ":" not in n
        and n not in SKIP_PACKAGES
        and n not in TOP_PACKAGES
        and (n.startswith("lib") or n in ("zlib1g", "gcc-12-base"))
    )


def resolve_node_inputs(
    *, disk: bool | None = None, arch: build.Arch = build.AMD64
) -> dict[str, object]:
    """Package versions, our files' hashes and the module list: the build depends on these."""
    libs = [p for p in _library_packages(arch) if p != "gcc-12-base"]
    disk_packages = DISK_PACKAGES if arch is build.AMD64 else EFI_DISK_PACKAGES
    shown = build._apt_show(
        *map(arch.pkg, (arch.kernel_meta, build.BUSYBOX, *TOP_PACKAGES, *libs, *disk_packages))
    )

    def pinned(names: tuple[str, ...] | list[str]) -> str:
        return " ".join(f"{arch.pkg(p)}={shown[p]['Version']}" for p in names)

    if disk is None:
        disk = can_build_disk() if arch is build.AMD64 else can_build_efi_disk()
    packages = {
        "kernel": build.kernel_package(shown, arch),
        "busybox": pinned((build.BUSYBOX,)),
        "tools": pinned(TOP_PACKAGES),
        "libraries": pinned(libs),
        "disk": pinned(disk_packages),
    }
    files = {
        (str(p.relative_to(HERE)) if p.is_relative_to(HERE) else p.name): hashlib.sha256(
            p.read_bytes()
        ).hexdigest()
        for p in node_files()
    }
    # disk.raw needs root (loop mount for extlinux): a build without it differs
    inputs = {"packages": packages, "files": files, "modules": NODE_MODULES, "disk": disk}
    if arch is not build.AMD64:
        inputs["arch"] = arch.name
    return inputs


def can_build_efi_disk() -> bool:
    """The arm64 disk form needs no root: sgdisk writes the GPT into a file, mtools the FAT
    file system, mke2fs -d the ext4 one."""
    return all(shutil.which(t) for t in ("sgdisk", "mformat", "mcopy", "mmd", "mkfs.ext4"))


def can_build_disk() -> bool:
    return os.geteuid() == 0 and all(
        shutil.which(t) for t in ("mkfs.ext4", "losetup", "mount", "umount")
    )


def program_entries(
    tree: Path, arch: build.Arch = build.AMD64
) -> tuple[list[cpio.Entry], dict[str, object]]:
    """The programs, the Slurm plugins and every shared library they load, and a report of
    what went in (and which plugins were left out, why). Every one must be an ELF for
    ``arch``."""
    plugins_at = plugin_dir(arch)
    lib_dirs = [
        tree / arch.multiarch_lib,
        tree / "usr" / arch.multiarch_lib,
        tree / plugins_at,
    ]
    entries: list[cpio.Entry] = []
    libs: dict[str, Path] = {}
    for image_path, rel in PROGRAMS.items():
        src = tree / rel
        if not src.is_file():
            raise BuildError(f"{rel} is in none of the unpacked packages")
        entries.append(cpio.file(image_path, build.check_elf(src, arch), 0o755))
        try:
            libs.update(elf.library_closure(src, lib_dirs))
        except elf.ElfError as e:
            raise BuildError(str(e)) from None
    for soname in DLOPENED:
        path = next((d / soname for d in lib_dirs if (d / soname).exists()), None)
        if path is None:
            raise BuildError(f"{soname} is in none of the unpacked packages")
        libs[soname] = path.resolve()
        libs.update(elf.library_closure(path, lib_dirs))
    plugins, skipped = [], {}
    for so in sorted((tree / plugins_at).glob("*.so")):
        if so.name.startswith("lib"):
            continue  # libslurmfull: a library, taken when something needs it
        if so.name.startswith(PLUGIN_PRUNE):
            skipped[so.name] = "pruned: never loaded on a node"
            continue
        try:
            closure = elf.library_closure(so, lib_dirs)
        except elf.ElfError as e:
            skipped[so.name] = str(e)
            continue
        libs.update(closure)
        plugins.append(so.name)
        entries.append(cpio.file(f"{plugins_at}/{so.name}", build.check_elf(so, arch), 0o755))
    for soname, path in sorted(libs.items()):
        if path.is_relative_to(tree / plugins_at):
            dest = f"{plugins_at}/{soname}"  # libslurmfull: slurmd's RUNPATH
        else:
            dest = f"{arch.multiarch_lib}/{soname}"
        entries.append(cpio.file(dest, build.check_elf(path, arch), 0o755))
    entries.append(arch.loader_entry())
    report: dict[str, object] = {
        "plugins": plugins,
        "plugins_left_out": skipped,
        "libraries": sorted(libs),
    }
    return entries, report


def build_node_initramfs(
    kernel_tree: Path,
    busybox: bytes,
    kernel_version: str,
    programs: list[cpio.Entry],
    arch: build.Arch = build.AMD64,
) -> tuple[bytes, list[str], list[cpio.Entry]]:
    """The node initramfs (gzip'd cpio), its module load order and its entries."""
    moddir = kernel_tree / "lib" / "modules" / kernel_version
    index = kmod.index_modules(moddir / "kernel")
    order, aliases, closures = build.driver_plan(
        index, NODE_MODULES, NODE_ON_DEMAND, frozenset(NODE_ALWAYS)
    )
    dirs = [
        "bin",
        "dev",
        "etc",
        "etc/munge",
        "etc/slurm",
        "lib",
        "lib/modules",
        f"lib/modules/{kernel_version}",
        *build.image_lib_dirs(arch),
        "mnt",
        "proc",
        "root",
        "run",
        "sbin",
        "sys",
        "usr",
        "usr/bin",
        "usr/lib",
        f"usr/lib/{arch.triplet}",
        plugin_dir(arch),
        "usr/sbin",
        "usr/share",
        "usr/share/udhcpc",
        "var",
        "var/lib",
        "var/log",
        "var/spool",
    ]
    entries = [cpio.directory(d, 0o700 if d in ("etc/munge", "root") else 0o755) for d in dirs]
    entries += [
        cpio.directory("tmp", 0o1777),
        cpio.char_device("dev/console", 5, 1),
        cpio.char_device("dev/null", 1, 3, 0o666),
        cpio.file("bin/busybox", busybox, 0o755),
        cpio.symlink("bin/sh", "busybox"),
        cpio.file("init", NODE_INIT.read_bytes(), 0o755),
        cpio.file("bin/select-drivers", build.SELECT_DRIVERS.read_bytes(), 0o755),
        cpio.file("usr/bin/metald-node", NODE_SCRIPT.read_bytes(), 0o755),
        cpio.file("usr/share/udhcpc/default.script", build.UDHCPC_SCRIPT.read_bytes(), 0o755),
        cpio.file("lib/modules/load-order", "".join(f"{m}\n" for m in order).encode()),
        cpio.file("lib/modules/aliases", aliases.encode()),
        cpio.file("lib/modules/closures", closures.encode()),
    ]
    entries += [cpio.file(path, text.encode()) for path, text in ETC.items()]
    entries += programs
    for name in order:
        data = kmod.read_module(index[name])  # insmod wants plain ELF
        entries.append(cpio.file(f"lib/modules/{kernel_version}/{name}.ko", data))
    packed = gzip.compress(cpio.pack(entries), compresslevel=9, mtime=0)
    return packed, order, entries


def _sh(*args: str) -> str:
    return build._run(*args)


def mbr_sector(boot_code: bytes, start: int, sectors: int) -> bytes:
    """Sector 0: syslinux's MBR boot code, a disk signature and one bootable Linux (0x83)
    partition (LBA addressing; CHS fields say "beyond CHS", as modern tools write them)."""
    if len(boot_code) > 440:
        raise BuildError("MBR boot code longer than 440 bytes")
    entry = (
        bytes([0x80, 0xFE, 0xFF, 0xFF, 0x83, 0xFE, 0xFF, 0xFF])
        + start.to_bytes(4, "little")
        + sectors.to_bytes(4, "little")
    )
    sector = boot_code.ljust(440, b"\0") + b"MTLD" + b"\0\0" + entry + b"\0" * 48 + b"\x55\xaa"
    assert len(sector) == 512
    return sector


def build_disk(out: Path, vmlinuz: Path, initrd: Path, syslinux_tree: Path) -> dict[str, object]:
    """disk.raw: MBR, one bootable ext4 partition labelled root (1 MiB in, to the end),
    syslinux's MBR code and extlinux installed in /boot/extlinux. Needs root: extlinux can
    only install into a mounted file system (loop device)."""
    disk = out / "disk.raw"
    mbr = syslinux_tree / "usr/lib/syslinux/mbr/mbr.bin"
    extlinux = syslinux_tree / "usr/bin/extlinux"
    for need in (mbr, extlinux):
        if not need.exists():
            raise BuildError(f"{need.relative_to(syslinux_tree)} is not in {DISK_PACKAGES}")
    staging = out.parent / "disk-root"
    (staging / "boot" / "extlinux").mkdir(parents=True)
    (staging / "etc" / "cloud").mkdir(parents=True)
    (staging / "etc" / "metald").mkdir(parents=True)
    (staging / "var" / "lib" / "cloud").mkdir(parents=True)
    shutil.copyfile(vmlinuz, staging / "boot" / "vmlinuz")
    shutil.copyfile(initrd, staging / "boot" / "initrd.img")
    (staging / "boot" / "extlinux" / "extlinux.conf").write_text(EXTLINUX_CONF)
    with open(disk, "wb") as f:
        f.truncate(DISK_BYTES)
    part_bytes = DISK_BYTES - PART_OFFSET
    # 4 KiB blocks (mke2fs picks 1 KiB for a disk this small: extlinux 6.04 then fails to
    # read /boot/vmlinuz with "I/O error"), no 64bit/metadata_csum_seed/orphan_file features
    _sh(
        "mkfs.ext4",
        "-q",
        "-F",
        "-L",
        "root",
        "-b",
        "4096",
        "-O",
        "^64bit,^metadata_csum_seed,^orphan_file",
        "-E",
        f"offset={PART_OFFSET},root_owner=0:0",
        "-d",
        str(staging),
        "-U",
        "7a3e2b1c-0d9f-4e5a-8b6c-4d2e1f0a9b8c",
        str(disk),
        f"{part_bytes // 1024}k",
    )
    mnt = out.parent / "disk-mnt"
    mnt.mkdir()
    loop = _sh(
        "losetup", "--find", "--show", "--offset", str(PART_OFFSET), "--sizelimit",
        str(part_bytes), str(disk),
    ).strip()  # fmt: skip
    try:
        _sh("mount", "-t", "ext4", loop, str(mnt))
        try:
            _sh(str(extlinux), "--install", str(mnt / "boot" / "extlinux"))
        finally:
            _sh("umount", str(mnt))
    finally:
        _sh("losetup", "--detach", loop)
    with open(disk, "r+b") as f:
        f.write(mbr_sector(mbr.read_bytes(), PART_OFFSET // 512, part_bytes // 512))
    return {
        "bytes": DISK_BYTES,
        "partition": {"offset": PART_OFFSET, "bytes": part_bytes, "fs": "ext4", "label": "root"},
        "bootloader": "syslinux mbr.bin + extlinux (/boot/extlinux/extlinux.conf)",
    }


def loader_entry(console: str) -> str:
    """systemd-boot's entry for the node (loader/entries/node.conf on the ESP)."""
    return (
        "title metald node\nlinux /vmlinuz\ninitrd /initrd.img\n"
        f"options metald.boot=disk console={console},115200 quiet\n"
    )


def build_efi_disk(
    out: Path, vmlinuz: Path, initrd: Path, sdboot_tree: Path, console: str
) -> dict[str, object]:
    """disk.raw for UEFI machines (arm64): GPT; partition 1, the EFI system partition (FAT32,
    labelled ESP) with systemd-boot at the removable path EFI/BOOT/BOOTAA64.EFI, its
    loader.conf (no menu) and one entry booting /vmlinuz and /initrd.img beside it; partition
    2, ext4 labelled root with an empty /etc/cloud, where metald's deploy agent writes the
    NoCloud seed and the node keeps its joined state, as in the BIOS form. No root needed."""
    efi = sdboot_tree / SYSTEMD_BOOT_EFI
    if not efi.exists():
        raise BuildError(f"{SYSTEMD_BOOT_EFI} is not in {EFI_DISK_PACKAGES}")
    disk = out / "disk.raw"
    with open(disk, "wb") as f:
        f.truncate(EFI_DISK_BYTES)
    esp_first = ESP_OFFSET // 512
    esp_last = esp_first + ESP_BYTES // 512 - 1
    root_offset = ESP_OFFSET + ESP_BYTES
    root_first = root_offset // 512
    root_last = root_first + EFI_ROOT_BYTES // 512 - 1
    disk_guid, esp_guid, root_guid = EFI_DISK_GUIDS
    _sh(
        "sgdisk", "--clear", f"--disk-guid={disk_guid}",
        f"--new=1:{esp_first}:{esp_last}", "--typecode=1:EF00", "--change-name=1:ESP",
        f"--partition-guid=1:{esp_guid}",
        f"--new=2:{root_first}:{root_last}", "--typecode=2:8300", "--change-name=2:root",
        f"--partition-guid=2:{root_guid}",
        str(disk),
    )  # fmt: skip
    esp = out.parent / "esp.img"
    with open(esp, "wb") as f:
        f.truncate(ESP_BYTES)
    # FAT32 (what UEFI requires of an ESP); 512-byte clusters keep FAT32's cluster minimum
    _sh("mformat", "-i", str(esp), "-F", "-c", "1", "-v", "ESP", "-N", "6d6c6464", "::")
    for d in ("::/EFI", "::/EFI/BOOT", "::/loader", "::/loader/entries"):
        _sh("mmd", "-i", str(esp), d)
    conf = out.parent / "esp-files"
    conf.mkdir()
    (conf / "loader.conf").write_text(LOADER_CONF)
    (conf / "node.conf").write_text(loader_entry(console))
    for src, dest in (
        (efi, "::/EFI/BOOT/BOOTAA64.EFI"),
        (conf / "loader.conf", "::/loader/loader.conf"),
        (conf / "node.conf", "::/loader/entries/node.conf"),
        (vmlinuz, "::/vmlinuz"),
        (initrd, "::/initrd.img"),
    ):
        _sh("mcopy", "-i", str(esp), "-m", str(src), dest)
    staging = out.parent / "efi-root"
    for d in ("etc/cloud", "etc/metald", "var/lib/cloud"):
        (staging / d).mkdir(parents=True)
    _sh(
        "mkfs.ext4", "-q", "-F", "-L", "root", "-b", "4096",
        "-O", "^metadata_csum_seed,^orphan_file",
        "-E", f"offset={root_offset},root_owner=0:0", "-d", str(staging),
        "-U", "7a3e2b1c-0d9f-4e5a-8b6c-4d2e1f0a9b8d", str(disk), f"{EFI_ROOT_BYTES // 1024}k",
    )  # fmt: skip
    with open(disk, "r+b") as f, open(esp, "rb") as src_f:
        f.seek(ESP_OFFSET)
        shutil.copyfileobj(src_f, f)
    esp.unlink()
    return {
        "bytes": EFI_DISK_BYTES,
        "table": "gpt",
        "esp": {"offset": ESP_OFFSET, "bytes": ESP_BYTES, "fs": "vfat", "label": "ESP"},
        "partition": {
            "offset": root_offset,
            "bytes": EFI_ROOT_BYTES,
            "fs": "ext4",
            "label": "root",
        },  # fmt: skip
        "bootloader": "systemd-boot (EFI/BOOT/BOOTAA64.EFI, loader/entries/node.conf)",
    }


def _build(
    target: Path, inputs: dict[str, object], digest: str, arch: build.Arch = build.AMD64
) -> None:
    packages: dict[str, str] = inputs["packages"]  # type: ignore[assignment]
    with tempfile.TemporaryDirectory(prefix="metald-nodeimage-") as tmp:
        work = Path(tmp)
        kernel = build._download(packages["kernel"], work / "kernel")
        busybox = build._download(packages["busybox"], work / "busybox")
        tree = build._download(f"{packages['tools']} {packages['libraries']}", work / "tools")
        vmlinuz = sorted((kernel / "boot").glob("vmlinuz-*"))
        if len(vmlinuz) != 1:
            raise BuildError("the kernel package holds no single vmlinuz")
        kernel_version = vmlinuz[0].name.removeprefix("vmlinuz-")
        programs, report = program_entries(tree, arch)
        initrd, order, entries = build_node_initramfs(
            kernel,
            build.check_elf(busybox / "bin" / "busybox", arch),
            kernel_version,
            programs,
            arch,
        )
        out = work / "out"
        out.mkdir()
        shutil.copyfile(vmlinuz[0], out / "vmlinuz")
        (out / "initrd.img").write_bytes(initrd)
        disk_info: dict[str, object] | None = None
        if inputs.get("disk") and arch is build.AMD64:
            syslinux = build._download(packages["disk"], work / "syslinux")
            disk_info = build_disk(out, out / "vmlinuz", out / "initrd.img", syslinux)
        elif inputs.get("disk"):
            sdboot = build._download(packages["disk"], work / "systemd-boot")
            disk_info = build_efi_disk(
                out, out / "vmlinuz", out / "initrd.img", sdboot, arch.console
            )
        build.publish(
            out,
            target,
            "node image files",
            SIZE_LIMIT,
            arch=arch.name,
            console=arch.console,
            inputs_hash=digest,
            inputs=inputs,
            kernel_version=kernel_version,
            modules=order,
            initrd_unpacked_bytes=sum(len(e.data) for e in entries),
            contents=sorted(e.path for e in entries),
            disk=disk_info,
            **report,
        )


def ensure_node_built(
    cache_dir: Path | str | None = None, *, force: bool = False, arch: str = "amd64"
) -> Path:
    """The node image folder for the current inputs, building it only when missing or changed.

    File-locked (the same lock as build.py's), so concurrent test runs wait for one build.
    When apt cannot resolve package versions an existing ``node-current`` build is used.
    """
    a = build.get_arch(arch)
    cache = Path(cache_dir) if cache_dir else default_cache()
    prefix = _prefix(a)
    link = f"{prefix}current"
    try:
        inputs = resolve_node_inputs(arch=a)
    except BuildError as e:
        current = cache / link
        if current.exists() and not force:
            print(f"bootassets: {e}; using the existing build {current.resolve()}", file=sys.stderr)
            build.verify(current)
            return current.resolve()
        raise
    name = prefix + build.inputs_hash(inputs)
    target = cache / name
    with build._locked(cache):
        if force or not (target / "manifest.json").exists():
            _build(target, inputs, name.removeprefix(prefix), a)
        build.verify(target)
        build.point_current(cache, link, name)
        build.prune(cache, link, 2, _is_own_build(a))
    return target
