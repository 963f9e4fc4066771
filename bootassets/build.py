"""Build the boot assets metald serves: the discovery image and the iPXE binaries.

Everything comes from Debian packages fetched with ``apt-get download`` and unpacked with
``dpkg-deb -x`` (never the build host's /boot or installed files), so a fresh Debian 12 machine
with only apt builds the same thing. Output goes to ``<cache>/<inputs-hash>/``:

    discovery/vmlinuz       Debian's linux-image-amd64 kernel
    discovery/initrd.img    cpio, LZ4 (legacy frame): busybox-static, drivers, /init, the agent
    commission/tools.img    the commissioning tools (fetched by the agent when it commissions)
    undionly.kpxe ipxe.efi snponly.efi
    manifest.json           inputs, their hash, sha256 and size of every file

``--arch arm64`` builds the same image from Debian's arm64 packages (``apt-get download
pkg:arm64``; the build host needs ``dpkg --add-architecture arm64`` and an ``apt-get update``)
into ``<cache>/arm64-<inputs-hash>/``, without iPXE files (Debian ships no arm64 iPXE: metald's
own build has them, bootassets/ipxe.py). ``install_arch`` copies it into ``<assets_dir>/arm64/``,
where metald looks for an arm64 machine's kernel and initrd (docs/boot.md).

``<cache>/current`` (``arm64-current``) points at the latest build. The inputs hash covers the
package versions and every file that goes into the image, so an unchanged input set reuses the
cached build.
"""

from __future__ import annotations

import fcntl
import gzip
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from bootassets import cpio, elf, kmod

HERE = Path(__file__).resolve().parent
DEFAULT_CACHE = HERE.parent / ".cache" / "bootassets"

AGENT = HERE / "agent" / "metald-agent"
COMMISSION = HERE / "agent" / "metald-commission"
INIT = HERE / "initramfs" / "init"
UDHCPC_SCRIPT = HERE / "initramfs" / "udhcpc.script"
SELECT_DRIVERS = HERE / "initramfs" / "select-drivers"

#: Not loaded at boot: the agent's deploy mode loads these (with their closures) to write
#: cloud-init's NoCloud seed into the image it just wrote: its ext4 root (crc32c for metadata
#: checksums is asked for through the crypto API, not a module dependency) or a vfat "cidata"
#: partition (the default codepage and iocharset tables). Loading them on every discovery boot
#: cost ~0.7 s under TCG. md (RAID0/RAID1) and device-mapper (LVM) are loaded by deploy when the
#: claim's storage layout asks for arrays or volumes, and by wipe to read md superblocks.
ON_DEMAND = (
    "ext4",
    "crc32c_generic",
    "vfat",
    "nls_cp437",
    "nls_utf8",
    "md_mod",
    "raid0",
    "raid1",
    "dm_mod",
)
#: Modules the image carries, loaded in this order after their dependencies (ON_DEMAND only when
#: asked for). QEMU: virtio, e1000.
#: Servers: Intel (e1000e, igb, ixgbe, i40e, ice), Broadcom (bnxt_en, tg3), NVIDIA/Mellanox
#: (mlx5_core) NICs; NVMe and SATA/SAS disks; the IPMI system interface for ipmitool.
MODULES = [
    "virtio_pci",
    "virtio_net",
    "virtio_blk",
    "e1000",
    "e1000e",
    "igb",
    "ixgbe",
    "i40e",
    "ice",
    "bnxt_en",
    "tg3",
    "mlx5_core",
    "nvme",
    "ahci",
    "sd_mod",
    "ipmi_si",
    "ipmi_devintf",
    *ON_DEMAND,
]
#: Loaded whatever the PCI bus shows: the IPMI system interface is found through ACPI/SMBIOS.
ALWAYS_LOAD = frozenset({"ipmi_si", "ipmi_devintf"})
KERNEL_META = "linux-image-amd64"
BUSYBOX = "busybox-static"
IPXE = "ipxe"
IPXE_FILES = ("undionly.kpxe", "ipxe.efi", "snponly.efi")
#: ipmitool (the BMC's address and MAC, so metald can pair BMC and host), qemu-img (the deploy
#: agent writes qcow2 images with it), curl (the agent's HTTPS to metald, pinned to metald's CA
#: and never following a redirect: busybox wget checks no certificate) and the packages that
#: hold the libraries they load.
#: Debian 12 names; the build checks the library closure and names any library it cannot find.
TOOL_PACKAGES = (
    "ipmitool",
    "libc6",
    "libfreeipmi17",
    "libreadline8",
    "libtinfo6",
    "libssl3",
    "libgcrypt20",
    "libgpg-error0",
    "qemu-utils",
    "libaio1",
    "libffi8",
    "libglib2.0-0",
    "libgmp10",
    "libgnutls30",
    "libhogweed6",
    "libidn2-0",
    "libnettle8",
    "libnuma1",
    "libp11-kit0",
    "libpcre2-8-0",
    "libtasn1-6",
    "libunistring2",
    "liburing2",
    "libzstd1",
    "zlib1g",
    "curl",
    "libcurl4",
    "libbrotli1",
    "libcom-err2",
    "libgssapi-krb5-2",
    "libk5crypto3",
    "libkeyutils1",
    "libkrb5-3",
    "libkrb5support0",
    "libldap-2.5-0",
    "libnghttp2-14",
    "libpsl5",
    "librtmp1",
    "libsasl2-2",
    "libssh2-1",
    # tpm2-tools: the measured-boot quote and its attestation key (docs/attestation.md); the
    # device TCTI is loaded by name at run time, so it is listed as a tool of its own.
    "tpm2-tools",
    "libcurl3-gnutls",
    "libtss2-esys-3.0.2-0",
    "libtss2-mu0",
    "libtss2-rc0",
    "libtss2-sys1",
    "libtss2-tctildr0",
    "libtss2-tcti-device0",
    # the claim's storage layout (docs/deploy-agent.md, "Storage"): mdadm (software RAID), lvm2
    # (LVM), mke2fs and mkfs.xfs (the volumes' file systems), wipefs (signatures, at deploy and wipe)
    "mdadm",
    "lvm2",
    "e2fsprogs",
    "util-linux",
    "libudev1",
    "libdevmapper1.02.1",
    "libdevmapper-event1.02.1",
    "libedit2",
    "libbsd0",
    "libmd0",
    "libsystemd0",
    "libcap2",
    "liblz4-1",
    "liblzma5",
    "libblkid1",
    "libselinux1",
    "libext2fs2",
    "libuuid1",
    "libsmartcols1",
    "xfsprogs",
    "libinih1",
    "liburcu8",
)
TOOLS = (
    "usr/bin/ipmitool",
    "usr/bin/qemu-img",
    "usr/bin/curl",
    "usr/bin/tpm2",
    "usr/lib/x86_64-linux-gnu/libtss2-tcti-device.so.0",
    "sbin/mdadm",
    "sbin/lvm",
    "sbin/mke2fs",
    "sbin/wipefs",
    "sbin/mkfs.xfs",
)
MULTIARCH_LIB = "lib/x86_64-linux-gnu"
#: The commissioning checks' tools (docs/commissioning.md), in a second initramfs that the agent
#: fetches and unpacks only when metald tells it to commission: their library closure is ~95 MB
#: unpacked (fio links librbd/librados/libgfapi for engines it never uses here, stress-ng links
#: Intel's IPsec library and libicu comes with libxml2), which every other discovery boot
#: would otherwise pull and unpack. Debian 12 names: the tools, then the packages holding the
#: libraries their closure loads (the build names any library it cannot find).
COMMISSION_PACKAGES = (
    "stress-ng",
    "memtester",
    "fio",
    "smartmontools",
    *[
        "libacl1",
        "libaio1",
        "libapparmor1",
        "libargon2-1",
        "libblkid1",
        "libboost-iostreams1.74.0",
        "libboost-thread1.74.0",
        "libbsd0",
        "libbz2-1.0",
        "libc6",
        "libcom-err2",
        "libcrypt1",
        "libcryptsetup12",
        "libdaxctl1",
        "libdevmapper1.02.1",
        "libdrm2",
        "libegl1",
        "libexpat1",
        "libffi8",
        "libfmt9",
        "libgbm1",
        "libgcc-s1",
        "libgfapi0",
        "libgfrpc0",
        "libgfxdr0",
        "libgles2",
        "libglusterfs0",
        "libglvnd0",
        "libgmp10",
        "libgnutls30",
        "libgssapi-krb5-2",
        "libhogweed6",
        "libibverbs1",
        "libicu72",
        "libidn2-0",
        "libipsec-mb1",
        "libjpeg62-turbo",
        "libjson-c5",
        "libjudydebian1",
        "libk5crypto3",
        "libkeyutils1",
        "libkmod2",
        "libkrb5-3",
        "libkrb5support0",
        "liblzma5",
        "libmd0",
        "libnbd0",
        "libndctl6",
        "libnettle8",
        "libnl-3-200",
        "libnl-route-3-200",
        "libnuma1",
        "libp11-kit0",
        "libpcre2-8-0",
        "libpmem1",
        "libpmemblk1",
        "librados2",
        "librbd1",
        "librdmacm1",
        "libsctp1",
        "libselinux1",
        "libssl3",
        "libstdc++6",
        "libtasn1-6",
        "libtirpc3",
        "libudev1",
        "libunistring2",
        "libuuid1",
        "libwayland-server0",
        "libxml2",
        "libxxhash0",
        "libzstd1",
        "zlib1g",
    ],
)
#: Packages one architecture has and the other not (their programs link them there only):
#: Intel's IPsec library, which stress-ng links on amd64.
ARCH_ONLY = {"libipsec-mb1": "amd64"}
COMMISSION_TOOLS = ("usr/bin/stress-ng", "usr/sbin/memtester", "usr/bin/fio", "usr/sbin/smartctl")
#: librados/librbd find libceph-common through their RUNPATH.
COMMISSION_LIB_DIRS = ("usr/lib/x86_64-linux-gnu/ceph",)
#: Under the assets folder; the agent fetches it from /boot/assets/ (metald-agent).
COMMISSION_IMAGE = "commission/tools.img"
#: Its own budget: the discovery image's (SIZE_LIMIT) covers what every boot loads.
COMMISSION_SIZE_LIMIT = 48 * 1024 * 1024
#: The discovery initramfs's compression. The kernel unpacks it before /init on every discovery
#: boot; measured under QEMU TCG (bench/BOOT.md, "Power-on to ready"), the same 47 MB cpio took
#: 2.0-2.5 s to unpack as gzip -9 (16.0 MB), 1.2-1.8 s as LZ4 (19.4 MB), 2.6-4.0 s as zstd
#: (13.1 MB) and 0.2-1.0 s uncompressed, which iPXE then has to fetch whole (47 MB: ~0.7 s more
#: on the lab's wire, 3x the bytes for a rack booting at once). ``lz4 -l`` writes the legacy
#: frame, the one the kernel's initramfs decompressor reads (Debian: CONFIG_RD_LZ4=y).
INITRD_COMPRESSOR = ("lz4", "-l", "-9", "-c")
LZ4_LEGACY_MAGIC = b"\x02\x21\x4c\x18"
#: The whole asset folder must stay below this (the issue's budget for the discovery image).
SIZE_LIMIT = 64 * 1024 * 1024


@dataclass(frozen=True)
class Arch:
    """What differs between the architectures the images are built for."""

    #: Debian's name (``dpkg --print-architecture``), also metald's (machines, images, claims).
    name: str
    #: The multiarch triplet: libraries live in lib/<triplet>, as Debian lays them out.
    triplet: str
    #: Where programs look for the dynamic loader (PT_INTERP), relative to /.
    loader: str
    #: ELF e_machine of every program and library (elf.machine).
    elf_machine: int
    #: The kernel console of the board's first serial port.
    console: str

    @property
    def multiarch_lib(self) -> str:
        return f"lib/{self.triplet}"

    @property
    def kernel_meta(self) -> str:
        return f"linux-image-{self.name}"

    def pkg(self, name: str) -> str:
        """A package name as apt takes it for this architecture (``name:arm64`` for a foreign
        one; the build host's own architecture is written bare, as before)."""
        return name if self.name == "amd64" else f"{name}:{self.name}"

    def loader_entry(self) -> cpio.Entry:
        soname = self.loader.rsplit("/", 1)[-1]
        return cpio.symlink(self.loader, f"/{self.multiarch_lib}/{soname}")


AMD64 = Arch("amd64", "x86_64-linux-gnu", "lib64/ld-linux-x86-64.so.2", elf.EM_X86_64, "ttyS0")
#: Grace (GB200/GH200) and the lab's QEMU "virt" board: their serial port is a PL011.
ARM64 = Arch("arm64", "aarch64-linux-gnu", "lib/ld-linux-aarch64.so.1", elf.EM_AARCH64, "ttyAMA0")
ARCHES = {a.name: a for a in (AMD64, ARM64)}
#: The folder under an assets folder that holds a foreign architecture's build (install_arch).
#: amd64's files stay where they always were, at the top.
ARCH_DIR = {"amd64": "", "arm64": "arm64/"}


def get_arch(name: str) -> Arch:
    try:
        return ARCHES[name]
    except KeyError:
        raise BuildError(
            f"no architecture {name!r}: the images are built for {', '.join(ARCHES)}"
        ) from None


class BuildError(Exception):
    pass


def _run(*args: str, cwd: Path | None = None) -> str:
    try:
        res = subprocess.run(args, cwd=cwd, capture_output=True, text=True, check=False)
    except FileNotFoundError:
        raise BuildError(f"{args[0]} is not installed (this builds on Debian with apt)") from None
    if res.returncode != 0:
        raise BuildError(f"{' '.join(args)} failed: {res.stderr.strip() or res.stdout.strip()}")
    return res.stdout


def _apt_show(*packages: str) -> dict[str, dict[str, str]]:
    """Package -> its candidate's control fields (one apt-cache call: each costs about a second).
    ``name:arch`` asks for another architecture's package; the result is keyed by the bare
    name (one architecture per call)."""
    out = _run("apt-cache", "show", "--no-all-versions", *packages)
    stanzas: dict[str, dict[str, str]] = {}
    for block in out.strip().split("\n\n"):
        fields = dict(
            line.split(": ", 1)
            for line in block.splitlines()
            if ": " in line and not line.startswith(" ")
        )
        if "Package" in fields:
            stanzas.setdefault(fields["Package"], fields)
    missing = [p for p in packages if "Version" not in stanzas.get(p.split(":")[0], {})]
    if missing:
        raise BuildError(f"apt knows no package {', '.join(missing)} (run apt-get update?)")
    return stanzas


def resolve_inputs(arch: Arch = AMD64) -> dict[str, object]:
    """Everything the build depends on: package versions and the hashes of our own files.
    arm64 takes no iPXE package (Debian has no arm64 iPXE binary)."""
    ipxe = (IPXE,) if arch is AMD64 else ()
    tools, commission = packages_for(TOOL_PACKAGES, arch), packages_for(COMMISSION_PACKAGES, arch)
    shown = _apt_show(*map(arch.pkg, (arch.kernel_meta, BUSYBOX, *ipxe, *tools, *commission)))

    def pinned(names: tuple[str, ...]) -> str:
        return " ".join(f"{arch.pkg(p)}={shown[p]['Version']}" for p in names)

    packages = {
        "kernel": kernel_package(shown, arch),
        "busybox": pinned((BUSYBOX,)),
        "tools": pinned(tools),
        "commission": pinned(commission),
    }
    if ipxe:
        packages["ipxe"] = pinned(ipxe)
    files = {
        str(p.relative_to(HERE)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in (
            AGENT,
            COMMISSION,
            INIT,
            UDHCPC_SCRIPT,
            SELECT_DRIVERS,
            HERE / "build.py",
            HERE / "cpio.py",
            HERE / "kmod.py",
            HERE / "elf.py",
        )
    }
    inputs: dict[str, object] = {"packages": packages, "files": files, "modules": MODULES}
    if arch is not AMD64:
        inputs["arch"] = arch.name  # amd64's inputs (and so its cache) as before
    return inputs


def packages_for(names: tuple[str, ...], arch: Arch) -> tuple[str, ...]:
    """``names`` less the packages only another architecture has (ARCH_ONLY)."""
    return tuple(p for p in names if ARCH_ONLY.get(p, arch.name) == arch.name)


def kernel_package(shown: dict[str, dict[str, str]], arch: Arch = AMD64) -> str:
    """The versioned kernel package (name=version) the meta-package names."""
    image = next(
        (
            d.strip().split()[0]
            for d in shown[arch.kernel_meta].get("Depends", "").split(",")
            if d.strip().startswith("linux-image-")
        ),
        None,
    )
    if not image:
        raise BuildError(f"{arch.kernel_meta} depends on no linux-image package")
    return f"{arch.pkg(image)}={_apt_show(arch.pkg(image))[image]['Version']}"


def inputs_hash(inputs: dict[str, object]) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]


def _download(packages: str, into: Path) -> Path:
    """apt-get download + dpkg-deb -x of "name=version ..." into one tree; returns the tree."""
    into.mkdir(parents=True, exist_ok=True)
    os.chmod(into, 0o755)  # so apt's sandbox user may write there
    wanted = packages.split()
    _run("apt-get", "download", "-q", *wanted, cwd=into)
    debs = sorted(into.glob("*.deb"))
    if len(debs) != len(wanted):
        raise BuildError(f"apt-get download {packages} gave {len(debs)} .deb files")
    tree = into / "root"
    for deb in debs:
        _run("dpkg-deb", "-x", str(deb), str(tree))
    return tree


def tool_entries(
    tree: Path,
    tools: tuple[str, ...] = TOOLS,
    extra_lib_dirs: tuple[str, ...] = (),
    arch: Arch = AMD64,
) -> list[cpio.Entry]:
    """The tools and every shared library they load (DT_NEEDED closure), laid out as Debian
    does (/lib/<triplet>, the loader where PT_INTERP says), so the programs run unchanged.
    Every file must be an ELF for ``arch``: a package of the build host's architecture slipping
    in would fail only on the machine."""
    lib_dirs = [tree / arch.multiarch_lib, tree / "usr" / arch.multiarch_lib]
    lib_dirs += [tree / d.replace(AMD64.triplet, arch.triplet) for d in extra_lib_dirs]
    entries: list[cpio.Entry] = []
    libs: dict[str, Path] = {}
    for rel in tools:
        rel = rel.replace(AMD64.triplet, arch.triplet)  # a library named by path (the TCTI)
        entries.append(cpio.file(rel, check_elf(tree / rel, arch), 0o755))
        try:
            libs.update(elf.library_closure(tree / rel, lib_dirs))
        except elf.ElfError as e:
            raise BuildError(str(e)) from None
    for soname, path in sorted(libs.items()):
        entries.append(cpio.file(f"{arch.multiarch_lib}/{soname}", check_elf(path, arch), 0o755))
    entries.append(arch.loader_entry())
    return entries


def check_elf(path: Path, arch: Arch) -> bytes:
    """``path``'s bytes, after checking it is an ELF file for ``arch``."""
    data = path.read_bytes()
    try:
        found = elf.machine(data)
    except elf.ElfError as e:
        raise BuildError(f"{path.name}: {e}") from None
    if found != arch.elf_machine:
        what = elf.MACHINE_NAMES.get(found, f"e_machine {found}")
        raise BuildError(f"{path.name} is built for {what}, not {arch.name}")
    return data


def _alias_line(driver: str, alias: str) -> str:
    """One line of the table /init's awk matches device modaliases against.

    Most PCI aliases name one vendor:device with everything else open; those become ``id:``
    keys looked up in a hash. The rest (class matches like NVMe's) become anchored regexes.
    """
    m = re.fullmatch(r"pci:(v[0-9A-F]{8}d[0-9A-F]{8})sv\*sd\*bc\*sc\*i\*", alias)
    if m:
        return f"{driver} id:{m[1]}"
    return f"{driver} ^{alias.replace('*', '.*')}$"


def driver_plan(
    index: dict[str, Path],
    modules: list[str] | None = None,
    on_demand: tuple[str, ...] = ON_DEMAND,
    always_load: frozenset[str] = ALWAYS_LOAD,
) -> tuple[list[str], str, str]:
    """Load order of every module, and two tables /init uses to load only what the machine has.

    ``aliases``: "driver match" lines from each driver's PCI modalias patterns (``*`` when it
    is always loaded: no PCI aliases, or in ALWAYS_LOAD). ``closures``: "driver dep ... driver"
    lines. Loading every NIC driver costs ~5 s under TCG (mlx5_core, ice); matching the PCI
    bus first, as udev would, keeps a VM's boot short and a server's complete.
    ``modules``/``on_demand``/``always_load`` default to the discovery image's (node.py passes
    its own).
    """
    modules = MODULES if modules is None else modules
    order = kmod.load_order(modules, index)
    aliases, closures = [], []
    for leaf in modules:
        closures.append(" ".join([leaf, *kmod.load_order([leaf], index)]))
        if leaf in on_demand:
            continue  # no alias line: select-drivers never picks it
        info = kmod.modinfo(kmod.read_module(index[leaf]))
        pci = [a for a in info.get("alias", []) if a.startswith("pci:")]
        if leaf in always_load or not pci:
            aliases.append(f"{leaf} *")
        else:
            aliases += [_alias_line(leaf, a) for a in pci]
    return (
        order,
        "".join(f"{line}\n" for line in aliases),
        "".join(f"{line}\n" for line in closures),
    )


def build_initramfs(
    kernel_tree: Path,
    busybox: bytes,
    kernel_version: str,
    tools: list[cpio.Entry] | None = None,
    arch: Arch = AMD64,
) -> tuple[bytes, list[str]]:
    """The initramfs (LZ4-compressed cpio) and the module load order it carries."""
    moddir = kernel_tree / "lib" / "modules" / kernel_version
    index = kmod.index_modules(moddir / "kernel")
    order, aliases, closures = driver_plan(index)
    entries = [
        cpio.directory(d)
        for d in (
            "bin",
            "dev",
            "etc",
            "lib",
            "lib/modules",
            f"lib/modules/{kernel_version}",
            "proc",
            "run",
            "sbin",
            "sys",
            "tmp",
            "usr",
            "usr/bin",
            "usr/lib",
            f"usr/{MULTIARCH_LIB}",
            "usr/share",
            "usr/share/udhcpc",
        )
    ]
    entries += [
        cpio.char_device("dev/console", 5, 1),
        cpio.char_device("dev/null", 1, 3, 0o666),
        cpio.file("bin/busybox", busybox, 0o755),
        cpio.symlink("bin/sh", "busybox"),
        cpio.file("init", INIT.read_bytes(), 0o755),
        cpio.file("bin/select-drivers", SELECT_DRIVERS.read_bytes(), 0o755),
        cpio.file("usr/bin/metald-agent", AGENT.read_bytes(), 0o755),
        cpio.file("usr/bin/metald-commission", COMMISSION.read_bytes(), 0o755),
        cpio.file("usr/share/udhcpc/default.script", UDHCPC_SCRIPT.read_bytes(), 0o755),
        cpio.file("lib/modules/load-order", "".join(f"{m}\n" for m in order).encode()),
        cpio.file("lib/modules/aliases", aliases.encode()),
        cpio.file("lib/modules/closures", closures.encode()),
    ]
    entries += [cpio.directory(d) for d in image_lib_dirs(arch)] + list(tools or [])
    for name in order:
        data = kmod.read_module(index[name])  # insmod wants plain ELF
        entries.append(cpio.file(f"lib/modules/{kernel_version}/{name}.ko", data))
    return compress_initramfs(cpio.pack(entries)), order


def compress_initramfs(packed: bytes) -> bytes:
    """``packed`` (a cpio archive) as the kernel's LZ4 initramfs format; deterministic."""
    try:
        res = subprocess.run(INITRD_COMPRESSOR, input=packed, capture_output=True, check=False)
    except FileNotFoundError:
        raise BuildError("lz4 is not installed (Debian package lz4)") from None
    if res.returncode != 0 or not res.stdout.startswith(LZ4_LEGACY_MAGIC):
        raise BuildError(f"lz4 failed: {res.stderr.decode(errors='replace').strip()}")
    return res.stdout


def unpack_initramfs(data: bytes) -> bytes:
    """The cpio archive inside a discovery initramfs (LZ4 legacy or gzip)."""
    if data.startswith(LZ4_LEGACY_MAGIC):
        try:
            res = subprocess.run(["lz4", "-d", "-c"], input=data, capture_output=True, check=True)
        except FileNotFoundError:
            raise BuildError("lz4 is not installed (Debian package lz4)") from None
        return res.stdout
    return gzip.decompress(data)


def image_lib_dirs(arch: Arch) -> list[str]:
    """The library folders an image holds for ``arch`` (and the loader's, when apart)."""
    dirs = [arch.multiarch_lib]
    loader_dir = arch.loader.rsplit("/", 1)[0]
    if loader_dir not in ("lib", arch.multiarch_lib):
        dirs.append(loader_dir)
    return dirs


def build_commission_image(tree: Path, arch: Arch = AMD64) -> tuple[bytes, int]:
    """The commissioning tools' initramfs (gzip'd cpio, unpacked over the running discovery
    image's root) and its unpacked size."""
    dirs = ["usr", "usr/bin", "usr/sbin", "lib", *image_lib_dirs(arch)]
    entries = [cpio.directory(d) for d in dirs]
    entries += tool_entries(tree, COMMISSION_TOOLS, COMMISSION_LIB_DIRS, arch)
    packed = cpio.pack(entries)
    return gzip.compress(packed, compresslevel=9, mtime=0), len(packed)


@contextmanager
def _locked(cache: Path) -> Iterator[None]:
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two test runs building at once wait for each other
        yield


def file_table(out: Path, limit: int, what: str) -> tuple[dict[str, dict[str, object]], int]:
    """Every file under ``out`` (relative path -> sha256 and size) and their total size, which
    must stay within ``limit`` bytes."""
    files: dict[str, dict[str, object]] = {}
    total = 0
    for p in sorted(out.rglob("*")):
        if p.is_file():
            size = p.stat().st_size
            files[str(p.relative_to(out))] = {"sha256": _sha256(p), "size": size}
            total += size
    if total > limit:
        raise BuildError(f"{what} are {total} bytes, over the {limit} byte budget")
    return files, total


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def verify(assets: Path) -> dict[str, object]:
    """The manifest of a finished build, after checking every file against it."""
    manifest = json.loads((assets / "manifest.json").read_text())
    for rel, meta in manifest["files"].items():
        if _sha256(assets / rel) != meta["sha256"]:
            raise BuildError(
                f"{assets / rel} does not match its manifest; delete {assets} and rebuild"
            )
    checked: dict[str, object] = manifest
    return checked


def _build(target: Path, inputs: dict[str, object], digest: str, arch: Arch = AMD64) -> None:
    packages: dict[str, str] = inputs["packages"]  # type: ignore[assignment]
    with tempfile.TemporaryDirectory(prefix="metald-bootassets-") as tmp:
        work = Path(tmp)
        kernel = _download(packages["kernel"], work / "kernel")
        busybox = _download(packages["busybox"], work / "busybox")
        ipxe = _download(packages["ipxe"], work / "ipxe") if "ipxe" in packages else None
        vmlinuz = sorted((kernel / "boot").glob("vmlinuz-*"))
        if len(vmlinuz) != 1:
            raise BuildError("the kernel package holds no single vmlinuz")
        kernel_version = vmlinuz[0].name.removeprefix("vmlinuz-")
        tools = tool_entries(_download(packages["tools"], work / "tools"), arch=arch)
        initrd, order = build_initramfs(
            kernel,
            check_elf(busybox / "bin" / "busybox", arch),
            kernel_version,
            tools,
            arch,
        )
        commission, commission_unpacked = build_commission_image(
            _download(packages["commission"], work / "commission"), arch
        )

        out = work / "out"
        (out / "discovery").mkdir(parents=True)
        shutil.copyfile(vmlinuz[0], out / "discovery" / "vmlinuz")
        (out / "discovery" / "initrd.img").write_bytes(initrd)
        if len(commission) > COMMISSION_SIZE_LIMIT:
            raise BuildError(
                f"the commissioning tools are {len(commission)} bytes, over their "
                f"{COMMISSION_SIZE_LIMIT} byte budget"
            )
        (out / COMMISSION_IMAGE).parent.mkdir()
        (out / COMMISSION_IMAGE).write_bytes(commission)
        if ipxe is not None:
            for name in IPXE_FILES:
                shutil.copyfile(ipxe / "usr" / "lib" / "ipxe" / name, out / name)
        publish(
            out,
            target,
            "boot assets",
            SIZE_LIMIT + COMMISSION_SIZE_LIMIT,
            arch=arch.name,
            console=arch.console,
            inputs_hash=digest,
            commission_unpacked_bytes=commission_unpacked,
            inputs=inputs,
            kernel_version=kernel_version,
            modules=order,
        )


# The cache holds builds of both kinds (discovery assets here, node images in node.py), each
# a folder with its manifest.json, published, pointed at and pruned the same way.


def publish(out: Path, target: Path, what: str, limit: int, **manifest: object) -> None:
    """Write ``out``'s manifest (``manifest`` plus its file table, checked against ``limit``
    bytes), then move the finished build to ``target`` (under the lock)."""
    files, total = file_table(out, limit, what)
    manifest |= {"files": files, "total_bytes": total}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    if target.exists():
        shutil.rmtree(target)
    shutil.move(str(out), target)


def point_current(cache: Path, link: str, name: str) -> None:
    """Point the symlink ``cache/link`` at the build ``name``."""
    tmp = cache / f".{link}-{os.getpid()}"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(name)
    tmp.replace(cache / link)  # atomic: readers see the old or the new build, never none


def prune(cache: Path, link: str, keep: int, is_build: Callable[[Path], bool]) -> None:
    """Remove all but the ``keep`` newest builds that ``is_build`` owns; the one ``link``
    points at always stays."""
    current = (cache / link).resolve()
    builds = sorted(
        (
            p
            for p in cache.iterdir()
            if p.is_dir() and not p.is_symlink() and is_build(p) and (p / "manifest.json").exists()
        ),
        key=lambda p: p.stat().st_mtime,
        reverse=True,
    )
    for old in builds[keep:]:
        if old != current:
            shutil.rmtree(old, ignore_errors=True)


def _is_discovery_build(p: Path) -> bool:
    # node-* folders are node.py's builds, arm64-* the arm64 discovery builds: each pruned
    # by its own kind
    return not p.name.startswith(("node-", "arm64-"))


def _prefix(arch: Arch) -> str:
    return "" if arch is AMD64 else f"{arch.name}-"


def ensure_built(
    cache_dir: Path | str | None = None, *, force: bool = False, arch: str = "amd64"
) -> Path:
    """The assets folder for the current inputs, building it only when missing or changed.

    ``cache_dir`` defaults to $BOOTASSETS_CACHE or <repo>/.cache/bootassets (not a METALD_
    variable: metald's config reads every METALD_* variable as a setting). When apt
    cannot resolve package versions (no package lists) an existing ``current`` build is used.
    ``arch``: "arm64" builds from Debian's arm64 packages into ``arm64-<hash>/``
    (``arm64-current``).
    """
    a = get_arch(arch)
    cache = Path(cache_dir or os.environ.get("BOOTASSETS_CACHE") or DEFAULT_CACHE)
    link = f"{_prefix(a)}current"
    try:
        inputs = resolve_inputs(a)
    except BuildError as e:
        current = cache / link
        if current.exists() and not force:
            print(f"bootassets: {e}; using the existing build {current.resolve()}", file=sys.stderr)
            verify(current)
            return current.resolve()
        if a is not AMD64:
            e.args = (
                f"{e} (arm64 packages need the architecture added: dpkg --add-architecture "
                f"{a.name} && apt-get update, as scripts/bootstrap does)",
            )
        raise
    digest = inputs_hash(inputs)
    name = _prefix(a) + digest
    target = cache / name
    with _locked(cache):
        if force or not (target / "manifest.json").exists():
            _build(target, inputs, digest, a)
        verify(target)
        point_current(cache, link, name)
        if a is AMD64:
            prune(cache, link, 3, _is_discovery_build)
        else:
            prune(cache, link, 2, lambda p: p.name.startswith(_prefix(a)))
    return target


def install_arch(built: Path, assets_dir: Path) -> Path:
    """Copy a foreign architecture's build (its discovery and commissioning files) into
    ``<assets_dir>/<arch>/``, where metald finds an arm64 machine's kernel and initrd
    (hard links where the file system allows); returns that folder."""
    manifest = verify(built)
    arch = get_arch(str(manifest.get("arch") or "amd64"))
    if arch is AMD64:
        raise BuildError(f"{built} is an amd64 build: its files are the assets folder itself")
    dest = Path(assets_dir) / ARCH_DIR[arch.name].rstrip("/")
    tmp = Path(assets_dir) / f".{arch.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    files: dict[str, object] = manifest["files"]  # type: ignore[assignment]
    for rel in [*files, "manifest.json"]:
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(built / rel, tmp / rel)
        except OSError:
            shutil.copyfile(built / rel, tmp / rel)
    old = Path(assets_dir) / f".{arch.name}-old-{os.getpid()}"
    if dest.exists():
        dest.rename(old)
    tmp.rename(dest)
    shutil.rmtree(old, ignore_errors=True)
    return dest
