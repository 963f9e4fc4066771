"""``python -m bootassets build|node [--cache DIR] [--force] [--arch amd64|arm64]``: build (or
reuse) the boot assets (``build``: discovery image and Debian's iPXE binaries; ``--arch arm64
--install ASSETS_DIR``: the arm64 image, copied into ASSETS_DIR/arm64/) or the tenant node image
(``node``); ``debian``: the Debian 12 tenant disk image (``bootassets.debian``);
``ipxe --ca PEM [--source TARBALL|TREE] [--install ASSETS_DIR]``: metald's own iPXE, built from
source (``bootassets.ipxe``); ``iso --boot-url URL --out PATH``: the virtual-media boot ISO
(``bootassets.iso``); ``sign --key K --cert C FILE...``: UEFI Secure Boot signatures
(``bootassets.secureboot``)."""

from __future__ import annotations

import argparse
import json
import sys

from bootassets.build import BuildError, ensure_built


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bootassets")
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="build the discovery image and copy the iPXE binaries")
    build.add_argument("--cache", help="cache folder (default: <repo>/.cache/bootassets)")
    build.add_argument(
        "--force", action="store_true", help="rebuild even if the inputs are unchanged"
    )
    build.add_argument(
        "--arch",
        default="amd64",
        choices=("amd64", "arm64"),
        help="build from Debian's packages of this architecture (arm64: into arm64-<hash>/)",
    )
    build.add_argument(
        "--install",
        metavar="ASSETS_DIR",
        help="(--arch arm64) copy the build into ASSETS_DIR/arm64/, where metald serves it",
    )
    node = sub.add_parser("node", help="build the tenant node image (stateless and disk forms)")
    node.add_argument("--cache", help="cache folder (default: <repo>/.cache/bootassets)")
    node.add_argument(
        "--force", action="store_true", help="rebuild even if the inputs are unchanged"
    )
    node.add_argument(
        "--arch",
        default="amd64",
        choices=("amd64", "arm64"),
        help="build from Debian's packages of this architecture (arm64: stateless form only)",
    )
    debian = sub.add_parser(
        "debian", help="build the Debian 12 tenant disk image (systemd, cloud-init; root)"
    )
    debian.add_argument("--cache", help="cache folder (default: <repo>/.cache/bootassets)")
    debian.add_argument(
        "--force", action="store_true", help="rebuild even if the inputs are unchanged"
    )
    ipxe = sub.add_parser(
        "ipxe", help="build iPXE from source with metald's CA, config and embedded script"
    )
    ipxe.add_argument("--cache", help="cache folder (default: <repo>/.cache/bootassets)")
    ipxe.add_argument(
        "--source",
        help="an iPXE source tarball or tree, e.g. an upstream clone (default: "
        "$BOOTASSETS_IPXE_SOURCE, else the newest <repo>/.cache/vendor/ipxe-*.tar.xz)",
    )
    ipxe.add_argument(
        "--ca",
        help="metald's CA certificate, PEM: the only root trusted for HTTPS "
        "(default: $BOOTASSETS_IPXE_CA)",
    )
    ipxe.add_argument(
        "--install", metavar="ASSETS_DIR", help="copy the binaries into ASSETS_DIR/ipxe/"
    )
    ipxe.add_argument(
        "--force", action="store_true", help="rebuild even if the inputs are unchanged"
    )
    iso = sub.add_parser("iso", help="build the virtual-media boot ISO for a metald boot URL")
    iso.add_argument("--boot-url", required=True, help="metald's boot HTTP URL (boot.http_url)")
    iso.add_argument("--out", required=True, help="where to write it: <boot.assets_dir>/...")
    sign = sub.add_parser(
        "sign", help="sign EFI binaries (iPXE, kernels) for UEFI Secure Boot, in place"
    )
    sign.add_argument("--key", help="the signing key, PEM")
    sign.add_argument("--cert", help="its certificate, PEM (the one enrolled in the db)")
    sign.add_argument("--new-key", metavar="DIR", help="make DIR/db.key and DIR/db.crt first")
    sign.add_argument("files", nargs="*", help="PE/COFF files to sign in place")
    args = parser.parse_args(argv)
    if args.command == "sign":
        from pathlib import Path

        from bootassets.secureboot import SignError, new_key
        from bootassets.secureboot import sign as sign_file

        key, cert = (Path(args.key) if args.key else None), (Path(args.cert) if args.cert else None)
        if args.new_key:
            key, cert = new_key(Path(args.new_key))
            print(f"key {key}\ncertificate {cert} (enroll it in the firmware's db)")
        if args.files and (key is None or cert is None):
            parser.error("sign needs --key and --cert (or --new-key DIR)")
        try:
            for f in args.files:
                assert key is not None and cert is not None
                sign_file(Path(f), key, cert)
                print(f"signed {f}")
        except SignError as e:
            print(f"bootassets: {e}", file=sys.stderr)
            return 1
        return 0
    if args.command == "ipxe":
        from bootassets.ipxe import main as ipxe_main

        return ipxe_main(args)
    if args.command == "iso":
        from pathlib import Path

        from bootassets.iso import IsoError, build_iso

        try:
            print(build_iso(args.boot_url, Path(args.out)))
        except IsoError as e:
            print(f"bootassets: {e}", file=sys.stderr)
            return 1
        return 0
    if args.command == "debian":
        from bootassets.debian import ensure_debian_built

        try:
            path = ensure_debian_built(args.cache, force=args.force)
        except BuildError as e:
            print(f"bootassets: {e}", file=sys.stderr)
            return 1
        manifest = json.loads((path / "manifest.json").read_text())
        meta = manifest["files"]["disk.raw"]
        print(f"{meta['size']:>10}  disk.raw  sha256 {meta['sha256']}")
        print(f"{len(manifest['installed']):>10}  packages, kernel {manifest['kernel_version']}")
        print(path)
        return 0
    try:
        if args.command == "node":
            from bootassets.node import ensure_node_built

            path = ensure_node_built(args.cache, force=args.force, arch=args.arch)
        else:
            path = ensure_built(args.cache, force=args.force, arch=args.arch)
            if args.install:
                from pathlib import Path

                from bootassets.build import install_arch

                print(f"installed into {install_arch(path, Path(args.install))}")
    except BuildError as e:
        print(f"bootassets: {e}", file=sys.stderr)
        return 1
    manifest = json.loads((path / "manifest.json").read_text())
    for rel, meta in manifest["files"].items():
        print(f"{meta['size']:>10}  {rel}")
    arch = manifest.get("arch", "amd64")
    print(f"{manifest['total_bytes']:>10}  total, kernel {manifest['kernel_version']} ({arch})")
    if "initrd_unpacked_bytes" in manifest:
        print(f"{manifest['initrd_unpacked_bytes']:>10}  initrd contents, unpacked")
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
