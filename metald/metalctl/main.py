"""metalctl's entry point: the parser built from the resource modules, errors to exit codes."""

from __future__ import annotations

import argparse
import os
import sys
import urllib.error

from metald import __version__

from . import bmc, claims, events, images, instances, machines, tenants, tokens, whoami
from .client import ApiError, Client

#: Resource modules in the order their commands appear in ``metalctl --help``.
RESOURCES = (machines, events, tokens, tenants, whoami, bmc, images, claims, instances)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="metalctl", description="Operate a metald fleet (METALD_URL, METALD_TOKEN)"
    )
    ap.add_argument("--version", action="version", version=f"metalctl {__version__}")
    ap.add_argument("--url", default=os.environ.get("METALD_URL", "http://127.0.0.1:8080"))
    ap.add_argument("--json", action="store_true", help="print the API's JSON")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for resource in RESOURCES:
        resource.register(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    client = Client(args.url, os.environ.get("METALD_TOKEN"))
    try:
        return args.func(args, client) or 0
    except ApiError as e:
        print(f"metalctl: {e} (HTTP {e.status})", file=sys.stderr)
        return 1
    except urllib.error.URLError as e:
        print(f"metalctl: cannot reach {args.url}: {e.reason}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
