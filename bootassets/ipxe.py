"""Build metald's own iPXE from source: HTTPS pinned to metald's CA, no banner wait, an embedded
script, x86-64 (BIOS and UEFI) and arm64 (UEFI).

Debian 12's iPXE binaries (2019) wait 2 s on a banner, trust iPXE's own root CA and carry no
script. This recipe builds upstream iPXE from a source tarball (``git archive`` of the
upstream repository) or any iPXE tree an operator points it at (an upstream clone), with:

- ``config/local/general.h`` (``config_header``): ``BANNER_TIMEOUT 0``, HTTPS on every platform
  (BIOS builds leave it out by default), the commands metald's scripts use, and the ones it does
  not (SAN boot, wireless, Infiniband and Fibre Channel management, NTLM) left out;
- ``TRUST=`` metald's CA certificate: the only root the binaries accept for HTTPS, and DHCP
  cannot replace it (iPXE allows a trust override only when no ``TRUST`` is given); ``CERT=``
  the same certificate, built in, so a server need not send it;
- ``EMBED=`` metald's script (``embedded_script``): DHCP, then chain to the boot file metald's
  DHCP server hands iPXE (its per-MAC script URL), retrying without a prompt.

Output goes to ``<cache>/ipxe/<inputs-hash>/``:

    undionly.kpxe ipxe.pxe          x86-64 BIOS (PXE stack kept / iPXE's own drivers)
    ipxe.lkrn                       x86-64 BIOS, loaded as a Linux kernel (virtual media)
    snponly.efi ipxe.efi            x86-64 UEFI (firmware's network stack / iPXE's drivers)
    snponly-arm64.efi ipxe-arm64.efi   arm64 UEFI (cross-built with gcc-aarch64-linux-gnu)
    metald.ipxe ca.pem              the embedded script and the trusted CA, as built in
    manifest.json                   inputs, their hash, sha256 and size of every file

``<cache>/ipxe/current`` points at the latest build. The inputs hash covers the source (the
tarball's sha256, or every file of a tree's ``src/``), the config header, the CA, the script,
the targets, the compilers' versions and this file, so an unchanged input set reuses the cached
build and nothing else does. ``install`` copies a build into ``<assets_dir>/ipxe/``, where
metald's DHCP server and TFTP find it (docs/boot.md).

Tested with upstream commit 0ab2277c40f1de56c736b9e7db7ee23d52509ec5 (2026-08-21).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from bootassets import build
from bootassets.build import BuildError

#: The upstream commit this recipe was tested with.
TESTED_COMMIT = "0ab2277c40f1de56c736b9e7db7ee23d52509ec5"
SUBDIR = "ipxe"
#: The folder under a boot assets folder that metald looks in for built binaries.
INSTALL_DIR = "ipxe"
#: Where the source is looked for when neither --source nor $BOOTASSETS_IPXE_SOURCE names it:
#: the newest ipxe-*.tar.xz here.
DEFAULT_SOURCE_DIR = build.HERE.parent / ".cache" / "vendor"
CROSS_ARM64 = "aarch64-linux-gnu-"


@dataclass(frozen=True)
class Target:
    #: make target under src/
    make: str
    #: the file's name in the build (and under <assets_dir>/ipxe/)
    name: str
    #: the CROSS= prefix ("" for the build host's gcc)
    cross: str = ""


TARGETS = (
    Target("bin/undionly.kpxe", "undionly.kpxe"),
    Target("bin/ipxe.pxe", "ipxe.pxe"),
    Target("bin/ipxe.lkrn", "ipxe.lkrn"),
    Target("bin-x86_64-efi/snponly.efi", "snponly.efi"),
    Target("bin-x86_64-efi/ipxe.efi", "ipxe.efi"),
    Target("bin-arm64-efi/snponly.efi", "snponly-arm64.efi", CROSS_ARM64),
    Target("bin-arm64-efi/ipxe.efi", "ipxe-arm64.efi", CROSS_ARM64),
)
NAMES = tuple(t.name for t in TARGETS)

#: Commands metald's scripts and an operator at the iPXE shell need, beyond iPXE's defaults
#: (BIOS builds leave the crypto ones out by default).
ENABLE = (
    "DOWNLOAD_PROTO_HTTPS",
    "CERT_CMD",
    "CONSOLE_CMD",
    "DIGEST_CMD",
    "IMAGE_TRUST_CMD",
    "NTP_CMD",
    "PARAM_CMD",
    "PCI_CMD",
    "PING_CMD",
    "VLAN_CMD",
)
#: What no metald boot uses: less code for a hostile network to reach.
DISABLE = (
    "HTTP_AUTH_NTLM",
    "SANBOOT_CMD",
    "IWMGMT_CMD",
    "IBMGMT_CMD",
    "FCMGMT_CMD",
    "LOGIN_CMD",
    "SANBOOT_PROTO_ISCSI",
    "SANBOOT_PROTO_AOE",
    "SANBOOT_PROTO_IB_SRP",
    "SANBOOT_PROTO_FCP",
    "SANBOOT_PROTO_HTTP",
    "CRYPTO_80211_WEP",
    "CRYPTO_80211_WPA",
    "CRYPTO_80211_WPA2",
)


def config_header() -> str:
    """``config/local/general.h``: included after iPXE's own general.h, so it has the last
    word (``#undef`` then ``#define``, since some defaults are per platform)."""
    lines = [
        "/* metald's iPXE configuration (bootassets/ipxe.py). */",
        "",
        '/* No "Press Ctrl-B" wait: metald\'s script runs at once (2 s per boot). */',
        "#undef BANNER_TIMEOUT",
        "#define BANNER_TIMEOUT 0",
        "#undef ROM_BANNER_TIMEOUT",
        "#define ROM_BANNER_TIMEOUT 0",
        "",
    ]
    for name in ENABLE:
        lines += [f"#undef {name}", f"#define {name}"]
    lines.append("")
    lines += [f"#undef {name}" for name in DISABLE]
    return "\n".join(lines) + "\n"


#: Where a per-boot virtual-media ISO (bootassets/iso.py) puts its script, on the EFI boot
#: image this iPXE is loaded from; ``file:`` is the file system iPXE itself came from.
MEDIA_SCRIPT = "metald.ipxe"
#: The image iPXE makes of the initrd its boot loader handed it when it was started as a Linux
#: kernel (``ipxe.lkrn``; iPXE's runtime.c): the per-boot ISO's script on BIOS virtual media.
#: Looked up by ``imgstat`` first, which never downloads (``imgexec`` of a missing name would
#: fetch it as a URL relative to where iPXE came from, the network for a PXE-started one).
MEDIA_INITRD = "<INITRD>"
#: The DHCP user class (option 77) metald's iPXE sends instead of ``iPXE``: metald's DHCP
#: server hands the script URL to this iPXE only, and chainloads any other iPXE (a NIC's
#: ROM, Debian's) into this one (metald.boot.dhcp.bootfile).
USER_CLASS = "metald"


def embedded_script() -> str:
    """The script built into every binary. It says it is metald's (``user-class``), so
    metald's DHCP server answers it with the machine's script URL as its boot file; HTTPS
    there is checked against the built-in CA only. Started from a file system (UEFI virtual
    media: the per-boot ISO's EFI image), it runs that file system's ``metald.ipxe`` first (a
    PXE-started iPXE has no such file system, and the ``file:`` scheme is never the network,
    unlike iPXE's own ``autoexec.ipxe``, which it also asks TFTP for and which this script
    never runs); started as a Linux kernel from a boot loader with an initrd (BIOS virtual
    media: ``ipxe.lkrn`` and the ISO's script), it runs that initrd (``MEDIA_INITRD``, an image
    in memory only). Failures retry (DHCP can be busy in a rack-wide power-on) instead of dropping
    to a shell or the next boot device."""
    return (
        "#!ipxe\n"
        "# metald's embedded script (bootassets/ipxe.py)\n"
        f"set user-class {USER_CLASS}\n"
        "iseq ${platform} efi && goto media_efi ||\n"
        f"imgstat {MEDIA_INITRD} && goto media_bios ||\n"
        "goto retry\n"
        ":media_efi\n"
        f"chain --autofree --replace file:/{MEDIA_SCRIPT} || goto retry\n"
        ":media_bios\n"
        f"imgexec --autofree --replace {MEDIA_INITRD} || goto retry\n"
        ":retry\n"
        "dhcp || goto wait\n"
        "isset ${filename} || goto wait\n"
        "echo metald: chaining to ${filename}\n"
        "chain --autofree --replace ${filename} || goto wait\n"
        ":wait\n"
        "echo metald: no boot script yet (${errno}), retrying in 5 s\n"
        "sleep 5\n"
        "goto retry\n"
    )


def _tool_version(cmd: str) -> str:
    try:
        res = subprocess.run([cmd, "--version"], capture_output=True, text=True, check=False)
    except FileNotFoundError:
        return "missing"
    return res.stdout.splitlines()[0] if res.returncode == 0 and res.stdout else "missing"


def source_digest(source: Path) -> str:
    """A tarball's sha256, or for a tree the sha256 over every file under its ``src/`` (path
    and content; ``.git`` and build outputs are not part of it)."""
    if source.is_file():
        h = hashlib.sha256()
        with source.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        return f"tar:{h.hexdigest()}"
    src = source / "src"
    if not (src / "Makefile").is_file():
        raise BuildError(f"{source} is not an iPXE tree (no src/Makefile)")
    h = hashlib.sha256()
    for p in sorted(src.rglob("*")):
        rel = p.relative_to(src)
        if rel.parts[0].startswith("bin") or not p.is_file() or p.is_symlink():
            continue
        if rel.parts[0] == "config" and len(rel.parts) > 1 and rel.parts[1] == "local":
            continue  # ours, written into the build's copy
        h.update(str(rel).encode() + b"\0" + p.read_bytes() + b"\0")
    return f"tree:{h.hexdigest()}"


def find_source(source: Path | str | None = None) -> Path:
    """``source``, else $BOOTASSETS_IPXE_SOURCE, else the newest ipxe-*.tar.xz in
    <repo>/.cache/vendor/; BuildError naming all three when there is none."""
    named = source or os.environ.get("BOOTASSETS_IPXE_SOURCE")
    if named:
        path = Path(named)
        if not path.exists():
            raise BuildError(f"iPXE source {path} does not exist")
        return path
    found = sorted(DEFAULT_SOURCE_DIR.glob("ipxe-*.tar.xz"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise BuildError(
            "no iPXE source: pass --source (an upstream tarball or clone), set "
            f"BOOTASSETS_IPXE_SOURCE, or put an ipxe-*.tar.xz in {DEFAULT_SOURCE_DIR}"
        )
    return found[-1]


def read_ca(ca: Path | str | None) -> bytes:
    """metald's CA certificate (PEM): ``ca`` or $BOOTASSETS_IPXE_CA. One certificate only: it
    becomes the binaries' only trusted root."""
    named = ca or os.environ.get("BOOTASSETS_IPXE_CA")
    if not named:
        raise BuildError(
            "no CA: pass --ca with metald's CA certificate (the one its HTTPS certificate "
            "chains to) or set BOOTASSETS_IPXE_CA; without one iPXE would trust its "
            "project's own root CA instead"
        )
    try:
        pem = Path(named).read_bytes()
    except OSError as e:
        raise BuildError(f"cannot read the CA certificate {named}: {e.strerror}") from None
    if pem.count(b"-----BEGIN CERTIFICATE-----") != 1:
        raise BuildError(f"{named} must hold exactly one PEM certificate (metald's CA)")
    return pem


def resolve_inputs(source: Path, ca_pem: bytes) -> dict[str, object]:
    return {
        "source": source_digest(source),
        "config": hashlib.sha256(config_header().encode()).hexdigest(),
        "script": hashlib.sha256(embedded_script().encode()).hexdigest(),
        "ca": hashlib.sha256(ca_pem).hexdigest(),
        "targets": [[t.make, t.name, t.cross] for t in TARGETS],
        "compilers": {
            "gcc": _tool_version("gcc"),
            f"{CROSS_ARM64}gcc": _tool_version(f"{CROSS_ARM64}gcc"),
        },
        "recipe": hashlib.sha256(Path(__file__).read_bytes()).hexdigest(),
    }


def _unpack(source: Path, into: Path) -> Path:
    """The iPXE tree to build in: the tarball unpacked, or a copy of the tree's ``src/``
    (never building inside an operator's clone)."""
    tree = into / "ipxe"
    tree.mkdir(parents=True)
    if source.is_file():
        build._run("tar", "-xf", str(source), "-C", str(tree), "--strip-components=1")
        if not (tree / "src" / "Makefile").is_file():
            raise BuildError(f"{source} is not an iPXE source tarball (no src/Makefile in it)")
    else:
        shutil.copytree(
            source / "src",
            tree / "src",
            symlinks=True,
            ignore=lambda d, names: (
                [n for n in names if n.startswith("bin")] if Path(d) == source / "src" else []
            ),
        )
    return tree


def _make(src: Path, targets: list[Target], script: Path, ca: Path, jobs: int) -> None:
    # TRUST= holds only the CA's fingerprint; CERT= embeds the CA itself, so iPXE can complete
    # the chain of a server that sends its own certificate alone (else it asks ca.ipxe.org).
    args = ["make", "-C", str(src), f"-j{jobs}", f"EMBED={script}", f"TRUST={ca}", f"CERT={ca}"]
    if targets[0].cross:
        args.append(f"CROSS={targets[0].cross}")
    args += [t.make for t in targets]
    try:
        res = subprocess.run(args, capture_output=True, text=True, check=False)
    except FileNotFoundError:
        raise BuildError("make is not installed (Debian package build-essential)") from None
    if res.returncode != 0:
        tail = "\n".join((res.stderr or res.stdout).strip().splitlines()[-15:])
        hint = ""
        if "lzma.h" in tail:
            hint = " (install liblzma-dev)"
        elif targets[0].cross and "not found" in tail:
            hint = " (install gcc-aarch64-linux-gnu)"
        raise BuildError(f"building iPXE {' '.join(t.make for t in targets)} failed{hint}:\n{tail}")


def _build(
    target: Path, source: Path, ca_pem: bytes, inputs: dict[str, object], digest: str
) -> None:
    jobs = os.cpu_count() or 1
    with tempfile.TemporaryDirectory(prefix="metald-ipxe-") as tmp:
        work = Path(tmp)
        src = _unpack(source, work) / "src"
        local = src / "config" / "local"
        local.mkdir(parents=True, exist_ok=True)
        (local / "general.h").write_text(config_header())
        script = work / "metald.ipxe"
        script.write_text(embedded_script())
        ca = work / "ca.pem"
        ca.write_bytes(ca_pem)
        for cross in sorted({t.cross for t in TARGETS}):
            _make(src, [t for t in TARGETS if t.cross == cross], script, ca, jobs)
        out = work / "out"
        out.mkdir()
        for t in TARGETS:
            shutil.copyfile(src / t.make, out / t.name)
        shutil.copyfile(script, out / "metald.ipxe")
        shutil.copyfile(ca, out / "ca.pem")
        build.publish(
            out, target, "iPXE binaries", 16 * 1024 * 1024, inputs_hash=digest, inputs=inputs
        )


def ensure_ipxe_built(
    cache_dir: Path | str | None = None,
    *,
    source: Path | str | None = None,
    ca: Path | str | None = None,
    force: bool = False,
) -> Path:
    """The folder of iPXE binaries for the current inputs, building only when missing or
    changed. ``cache_dir`` defaults as the discovery image's (build.ensure_built)."""
    cache = Path(cache_dir or os.environ.get("BOOTASSETS_CACHE") or build.DEFAULT_CACHE) / SUBDIR
    src = find_source(source)
    ca_pem = read_ca(ca)
    inputs = resolve_inputs(src, ca_pem)
    digest = build.inputs_hash(inputs)
    target = cache / digest
    with build._locked(cache):
        if force or not (target / "manifest.json").exists():
            _build(target, src, ca_pem, inputs, digest)
        build.verify(target)
        build.point_current(cache, "current", digest)
        build.prune(cache, "current", 3, lambda p: True)
    return target


def install(built: Path, assets_dir: Path) -> Path:
    """Copy a build's binaries into ``<assets_dir>/ipxe/`` (replacing what was there), where
    metald's DHCP server prefers them over Debian's; returns that folder."""
    build.verify(built)
    dest = Path(assets_dir) / INSTALL_DIR
    tmp = Path(assets_dir) / f".{INSTALL_DIR}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in (*NAMES, "metald.ipxe", "ca.pem", "manifest.json"):
        shutil.copyfile(built / name, tmp / name)
    old = Path(assets_dir) / f".{INSTALL_DIR}-old-{os.getpid()}"
    if dest.exists():
        dest.rename(old)
    tmp.rename(dest)
    shutil.rmtree(old, ignore_errors=True)
    return dest


def describe(built: Path) -> str:
    manifest = json.loads((built / "manifest.json").read_text())
    rows = [f"{meta['size']:>10}  {rel}" for rel, meta in manifest["files"].items()]
    return "\n".join([*rows, str(built)])


def main(args: object) -> int:
    """``python -m bootassets ipxe`` (see __main__)."""
    try:
        built = ensure_ipxe_built(
            getattr(args, "cache", None),
            source=getattr(args, "source", None),
            ca=getattr(args, "ca", None),
            force=bool(getattr(args, "force", False)),
        )
        print(describe(built))
        into = getattr(args, "install", None)
        if into:
            print(f"installed into {install(built, Path(into))}")
    except BuildError as e:
        print(f"bootassets: {e}", file=sys.stderr)
        return 1
    return 0
