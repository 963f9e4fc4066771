"""Build the Debian 12 tenant disk image: systemd, cloud-init, netplan, mdadm, LVM and sshd,
from Debian's packages with ``mmdebstrap`` (apt is the only source), booting through extlinux.

What a tenant asking for "a real OS" gets (issue 32): the deploy agent writes ``disk.raw`` to
the claim's root disk (or the RAID1 array over two), seeds NoCloud into
``/var/lib/cloud/seed/nocloud/`` of its ext4 root, and cloud-init applies the tenant's
user-data, metald's vendor-data and the claim's netplan network-config on first boot.
Output goes to ``<cache>/os/debian-12-<inputs-hash>/``:

    disk.raw        raw BIOS disk: MBR with syslinux's boot code, one ext4 partition labelled
                    "root" (1 MiB in, to the end) holding the whole system and /boot/extlinux
    manifest.json   inputs, their hash, sha256 and size of disk.raw, the installed packages

``<cache>/os/debian-12-current`` points at the newest build. Needs root (mmdebstrap's root
mode, a loop mount for extlinux). docs/tenant-os.md, "The Debian 12 image".
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bootassets import build
from bootassets.build import BuildError
from bootassets.node import DISK_PACKAGES, mbr_sector

HERE = build.HERE
CUSTOMIZE = HERE / "debian" / "customize.sh"
#: Installed into the image as /usr/sbin/metald-node and its systemd unit: the node image's
#: own join agent, so the two images join the same way.
NODE_AGENT = HERE / "node" / "metald-node"
JOIN_UNIT = HERE / "debian" / "metald-join.service"
#: Our files in the image (or making it): their hashes are inputs.
INPUT_FILES = (CUSTOMIZE, NODE_AGENT, JOIN_UNIT, HERE / "debian.py", HERE / "node.py")
SUITE = "bookworm"
NAME = "debian-12"
LINK = f"{NAME}-current"
#: What goes in besides mmdebstrap's minbase (Essential packages and apt): systemd as init,
#: cloud-init with netplan.io (the renderer it picks first, which hands metald's network-config
#: v2 to systemd-networkd unchanged), mdadm and lvm2 (their initramfs hooks assemble a RAID1
#: root and volume groups at boot), sshd for the claim's keys, Debian's kernel; and what the
#: join into the tenant's cluster runs (metald-node's join, metald-join.service): WireGuard's
#: tools (the kernel has the module), nftables (the underlay guard), munge and slurmd (Debian
#: 12's Slurm 22.05, the tenant control plane's own), jq and curl (the agent's JSON and HTTP),
#: dbus (slurmd's cgroup/v2 plugin asks systemd over D-Bus for slurmstepd's scope: without it
#: slurmd exits with "cannot initialize cgroup directory for stepds").
PACKAGES = (
    "systemd-sysv",
    "udev",
    "cloud-init",
    "netplan.io",
    "iproute2",
    "mdadm",
    "lvm2",
    "openssh-server",
    "linux-image-amd64",
    "initramfs-tools",
    "e2fsprogs",
    "wireguard-tools",
    "nftables",
    "munge",
    "slurmd",
    "jq",
    "curl",
    "dbus",
)
#: What minbase installs whatever the list (the Essential set, tzdata): their versions, and
#: those of their dependencies, are inputs too (the manifest lists every installed version).
ESSENTIAL = (
    "base-files", "base-passwd", "bash", "bsdutils", "coreutils", "dash", "diffutils", "dpkg",
    "findutils", "grep", "gzip", "hostname", "login", "ncurses-base", "ncurses-bin", "sed",
    "tar", "util-linux", "apt", "libc6", "tzdata",
)  # fmt: skip
#: Documentation and translations are not installed (dpkg path filters).
DPKG_OPTIONS = (
    "path-exclude=/usr/share/man/*",
    "path-exclude=/usr/share/doc/*",
    "path-include=/usr/share/doc/*/copyright",
    "path-exclude=/usr/share/locale/*",
    "path-exclude=/usr/share/info/*",
    "path-exclude=/usr/share/lintian/*",
)
KERNEL_ARGS = "root=LABEL=root ro console=tty0 console=ttyS0,115200"
EXTLINUX_CONF = """\
SERIAL 0 115200
DEFAULT debian
PROMPT 0
TIMEOUT 0
LABEL debian
  LINUX /boot/vmlinuz-{kver}
  INITRD /boot/initrd.img-{kver}
  APPEND {args}
"""
PART_OFFSET = 1024 * 1024
#: Free room left in the root file system beyond what the packages take (logs, cloud-init's
#: state, the tenant's first files); the tenant grows it onto the rest of the disk if it wants.
HEADROOM = 192 * 1024 * 1024
#: disk.raw must stay below this.
SIZE_LIMIT = 1536 * 1024 * 1024


def default_cache() -> Path:
    return Path(os.environ.get("BOOTASSETS_CACHE") or build.DEFAULT_CACHE)


def sources() -> str:
    """The host's apt sources (deb822 or one-line), which mmdebstrap reads as its mirrors."""
    for p in (Path("/etc/apt/sources.list.d/debian.sources"), Path("/etc/apt/sources.list")):
        if p.is_file() and p.read_text().strip():
            return str(p)
    raise BuildError("no apt sources (/etc/apt/sources.list.d/debian.sources) to build from")


def _closure(names: tuple[str, ...]) -> list[str]:
    """Every package apt would pull in for ``names`` (Depends and Pre-Depends)."""
    out = build._run(
        "apt-cache", "depends", "--recurse", "--no-recommends", "--no-suggests",
        "--no-conflicts", "--no-breaks", "--no-replaces", "--no-enhances", *names,
    )  # fmt: skip
    found = {
        line.strip().split(":")[0] for line in out.splitlines() if line and not line[0].isspace()
    }
    return sorted(n for n in found if not n.startswith("<") and ":" not in n)


def resolve_inputs() -> dict[str, object]:
    """Package versions (the listed packages, their dependency closure, syslinux), mmdebstrap's
    version, the hashes of our files, the kernel arguments: the image depends on these."""
    names = _closure((*PACKAGES, *ESSENTIAL))
    shown = build._apt_show(*names, *DISK_PACKAGES)
    files = {
        str(p.relative_to(HERE)): hashlib.sha256(p.read_bytes()).hexdigest() for p in INPUT_FILES
    }
    return {
        "suite": SUITE,
        "packages": {n: shown[n]["Version"] for n in names},
        "include": list(PACKAGES),
        "disk_packages": " ".join(f"{p}={shown[p]['Version']}" for p in DISK_PACKAGES),
        "mmdebstrap": build._run("mmdebstrap", "--version").strip(),
        "files": files,
        "kernel_args": KERNEL_ARGS,
        "dpkg_options": list(DPKG_OPTIONS),
    }


def can_build() -> bool:
    return os.geteuid() == 0 and all(
        shutil.which(t) for t in ("mmdebstrap", "mkfs.ext4", "losetup", "mount", "umount")
    )


def mmdebstrap_args(inputs: dict[str, Any], tree: Path) -> list[str]:
    """The mmdebstrap command line: minbase, the listed packages pinned to the versions
    hashed, no docs, the customize hook, into the directory ``tree``."""
    versions: dict[str, str] = inputs["packages"]
    include = ",".join(f"{p}={versions[p]}" for p in inputs["include"])
    args = [
        "mmdebstrap",
        "--mode=root",
        "--variant=minbase",
        "--format=directory",
        f"--include={include}",
        '--aptopt=APT::Install-Recommends "false"',
        *(f"--dpkgopt={o}" for o in inputs["dpkg_options"]),
        f'--customize-hook=sh {CUSTOMIZE} "$1"',
        SUITE,
        str(tree),
        sources(),
    ]
    return args


def installed_packages(tree: Path) -> dict[str, str]:
    out = build._run(
        "dpkg-query", f"--admindir={tree / 'var/lib/dpkg'}", "-W", "-f", "${Package} ${Version}\n"
    )
    return dict(line.split(" ", 1) for line in out.splitlines() if line)


#: What boots enabled (multi-user.target.wants) and what must not (the agent starts munged
#: and slurmd itself, with the tenant's key and configless).
JOIN_WANTS = "etc/systemd/system/multi-user.target.wants"


def join_setup(tree: Path) -> dict[str, Any]:
    """How the built tree joins the tenant's cluster (the manifest's ``join``): the agent's
    sha256, the unit's, which of metald-join, munge and slurmd start at boot, and whether a
    munge key is baked in. Raises when the tree would not join, or would join wrongly."""
    agent = tree / "usr/sbin/metald-node"
    unit = tree / "etc/systemd/system/metald-join.service"
    wants = tree / JOIN_WANTS
    found = {
        "agent_sha256": sha256_file(agent) if agent.is_file() else None,
        "unit_sha256": sha256_file(unit) if unit.is_file() else None,
        "enabled": sorted(
            n.removesuffix(".service")
            for n in ("metald-join.service", "munge.service", "slurmd.service")
            if (wants / n).is_symlink() or (wants / n).exists()
        ),
        "munge_key_baked": (tree / "etc/munge/munge.key").exists(),
        "tools": sorted(
            t
            for t in ("wg", "nft", "munged", "slurmd", "jq", "curl", "ip")
            if any((tree / d / t).exists() for d in ("usr/bin", "usr/sbin"))
        ),
    }
    problems = []
    if found["agent_sha256"] != sha256_file(NODE_AGENT):
        problems.append("/usr/sbin/metald-node is not bootassets/node/metald-node")
    if found["unit_sha256"] != sha256_file(JOIN_UNIT):
        problems.append("metald-join.service is not bootassets/debian/metald-join.service")
    if found["enabled"] != ["metald-join"]:
        problems.append(f"units enabled at boot: {found['enabled']}, not only metald-join")
    if found["munge_key_baked"]:
        problems.append("the build's munge key is in the image")
    missing = sorted({"wg", "nft", "munged", "slurmd", "jq", "curl", "ip"} - set(found["tools"]))
    if missing:
        problems.append(f"missing tools: {', '.join(missing)}")
    if problems:
        raise BuildError("the image would not join its tenant's cluster: " + "; ".join(problems))
    return found


def _du_bytes(tree: Path) -> int:
    out = build._run("du", "-s", "-B1", "--one-file-system", str(tree))
    return int(out.split()[0])


def build_disk(out: Path, tree: Path, syslinux: Path) -> dict[str, object]:
    """disk.raw from ``tree``: an ext4 file system labelled root sized to the tree plus
    HEADROOM, extlinux in /boot/extlinux, syslinux's MBR code. The ext4 features extlinux
    6.04 reads (no 64bit, metadata_csum_seed, orphan_file; 4 KiB blocks), as node.py."""
    mbr = syslinux / "usr/lib/syslinux/mbr/mbr.bin"
    extlinux = syslinux / "usr/bin/extlinux"
    for need in (mbr, extlinux):
        if not need.exists():
            raise BuildError(f"{need.relative_to(syslinux)} is not in {DISK_PACKAGES}")
    kernels = sorted((tree / "boot").glob("vmlinuz-*"))
    if len(kernels) != 1:
        raise BuildError(f"the image holds {len(kernels)} kernels in /boot, not one")
    kver = kernels[0].name.removeprefix("vmlinuz-")
    if not (tree / "boot" / f"initrd.img-{kver}").exists():
        raise BuildError(f"the image has no /boot/initrd.img-{kver}")
    (tree / "boot" / "extlinux").mkdir(exist_ok=True)
    (tree / "boot" / "extlinux" / "extlinux.conf").write_text(
        EXTLINUX_CONF.format(kver=kver, args=KERNEL_ARGS)
    )
    # inodes and the journal come on top of the files' blocks
    mib = 1024 * 1024
    part_bytes = -(-(_du_bytes(tree) * 115 // 100 + HEADROOM) // mib) * mib
    disk = out / "disk.raw"
    with open(disk, "wb") as f:
        f.truncate(PART_OFFSET + part_bytes)
    build._run(
        "mkfs.ext4", "-q", "-F", "-L", "root", "-b", "4096",
        "-O", "^64bit,^metadata_csum_seed,^orphan_file",
        "-E", f"offset={PART_OFFSET}", "-d", str(tree), str(disk), f"{part_bytes // 1024}k",
    )  # fmt: skip
    mnt = out.parent / "disk-mnt"
    mnt.mkdir()
    loop = build._run(
        "losetup", "--find", "--show", "--offset", str(PART_OFFSET), "--sizelimit",
        str(part_bytes), str(disk),
    ).strip()  # fmt: skip
    try:
        build._run("mount", "-t", "ext4", loop, str(mnt))
        try:
            build._run(str(extlinux), "--install", str(mnt / "boot" / "extlinux"))
        finally:
            build._run("umount", str(mnt))
        build._run("e2fsck", "-f", "-n", loop)
    finally:
        build._run("losetup", "--detach", loop)
    with open(disk, "r+b") as f:
        f.write(mbr_sector(mbr.read_bytes(), PART_OFFSET // 512, part_bytes // 512))
    return {
        "bytes": PART_OFFSET + part_bytes,
        "partition": {"offset": PART_OFFSET, "bytes": part_bytes, "fs": "ext4", "label": "root"},
        "bootloader": "syslinux mbr.bin + extlinux (/boot/extlinux/extlinux.conf)",
        "kernel_version": kver,
        "kernel_args": KERNEL_ARGS,
    }


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def mounts_under(path: Path) -> list[str]:
    """Mount points at or below ``path`` (deepest first), from /proc/self/mounts."""
    root = str(path.resolve())
    found = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        point = line.split()[1].replace("\\040", " ")
        if point == root or point.startswith(root + "/"):
            found.append(point)
    return sorted(found, key=len, reverse=True)


def _unmount_all(path: Path) -> None:
    """A killed mmdebstrap can leave its chroot's proc, sys and dev mounted: detach them
    before the work folder is deleted, so the deletion never walks into them."""
    for point in mounts_under(path):
        subprocess.run(["umount", "--lazy", point], capture_output=True, check=False)
    left = mounts_under(path)
    if left:
        raise BuildError(f"cannot unmount {', '.join(left)}; remove them, then {path}")


def _build(target: Path, inputs: dict[str, Any], digest: str) -> None:
    with tempfile.TemporaryDirectory(prefix="metald-debian-", dir=target.parent) as tmp:
        try:
            _build_in(Path(tmp), target, inputs, digest)
        finally:
            _unmount_all(Path(tmp))


def _build_in(work: Path, target: Path, inputs: dict[str, Any], digest: str) -> None:
    tree = work / "tree"
    res = subprocess.run(mmdebstrap_args(inputs, tree), capture_output=True, text=True, check=False)
    (work / "mmdebstrap.log").write_text(res.stdout + res.stderr)
    if res.returncode != 0:
        raise BuildError(f"mmdebstrap failed:\n{(res.stdout + res.stderr)[-4000:]}")
    packages = installed_packages(tree)
    join = join_setup(tree)
    syslinux = build._download(inputs["disk_packages"], work / "syslinux")
    out = work / "out"
    out.mkdir()
    disk = build_disk(out, tree, syslinux)
    size = (out / "disk.raw").stat().st_size
    if size > SIZE_LIMIT:
        raise BuildError(f"disk.raw is {size} bytes, over the {SIZE_LIMIT} byte budget")
    manifest = {
        "name": NAME,
        "arch": "amd64",
        "inputs_hash": digest,
        "inputs": inputs,
        "disk": disk,
        "installed": packages,
        "join": join,
        "files": {"disk.raw": {"sha256": sha256_file(out / "disk.raw"), "size": size}},
        "total_bytes": size,
        "kernel_version": disk["kernel_version"],
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    if target.exists():
        shutil.rmtree(target)
    shutil.move(str(out), target)


def verify(built: Path) -> dict[str, Any]:
    """The manifest of a finished build, after checking disk.raw against it."""
    manifest: dict[str, Any] = json.loads((built / "manifest.json").read_text())
    for rel, meta in manifest["files"].items():
        if sha256_file(built / rel) != meta["sha256"]:
            raise BuildError(f"{built / rel} does not match its manifest; delete {built}")
    return manifest


def image_spec(built: Path, url: str) -> dict[str, Any]:
    """The body of ``POST /api/v1/images`` (kind disk) for this build served at ``url``."""
    manifest = json.loads((built / "manifest.json").read_text())
    meta = manifest["files"]["disk.raw"]
    return {
        "name": f"{NAME}-{manifest['inputs_hash'][:8]}",
        "kind": "disk",
        "url": url,
        "sha256": meta["sha256"],
        "format": "raw",
        "size_bytes": meta["size"],
        "arch": manifest["arch"],
    }


def ensure_debian_built(cache_dir: Path | str | None = None, *, force: bool = False) -> Path:
    """The image folder for the current inputs, built only when missing or changed (under the
    boot-asset cache's lock). When apt cannot resolve versions, an existing build is used."""
    cache = Path(cache_dir) if cache_dir else default_cache()
    osdir = cache / "os"
    try:
        inputs = resolve_inputs()
    except BuildError as e:
        current = osdir / LINK
        if current.exists() and not force:
            print(f"bootassets: {e}; using the existing build {current.resolve()}", file=sys.stderr)
            verify(current)
            return current.resolve()
        raise
    name = f"{NAME}-{build.inputs_hash(inputs)}"
    target = osdir / name
    with build._locked(cache):
        osdir.mkdir(exist_ok=True)
        if force or not (target / "manifest.json").exists():
            if not can_build():
                raise BuildError("building the Debian image needs root and mmdebstrap")
            _build(target, inputs, name.removeprefix(f"{NAME}-"))
        verify(target)
        build.point_current(osdir, LINK, name)
        build.prune(osdir, LINK, 2, lambda p: p.name.startswith(f"{NAME}-"))
    return target
