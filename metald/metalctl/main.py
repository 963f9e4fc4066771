"""metalctl's entry point: the parser built from the resource modules, errors to exit codes."""

from __future__ import annotations

import argparse
import os
import sys
import urllib.error

import argcomplete

from metald import __version__

from . import (
    attestation_skus,
    bmc,
    claims,
    events,
    firmware,
    images,
    instances,
    machines,
    tenants,
    tokens,
    topology,
    whoami,
)
from .client import ApiError, Client
from .options import DEFAULT_URL, Parser, UsageError
from .output import UnknownField, output_format

#: Resource modules in the order their commands appear in ``metalctl --help``.
RESOURCES = (
    machines,
    events,
    tokens,
    tenants,
    whoami,
    bmc,
    firmware,
    attestation_skus,
    images,
    claims,
    instances,
    topology,
)


def build_parser() -> argparse.ArgumentParser:
    ap = Parser(prog="metalctl", description="Operate a metald fleet (METALD_URL, METALD_TOKEN)")
    ap.add_argument("--version", action="version", version=f"metalctl {__version__}")
    ap.add_argument("--url", default=os.environ.get("METALD_URL", DEFAULT_URL))
    ap.add_argument(
        "-o",
        "--output",
        type=output_format,
        default="table",
        metavar="FORMAT",
        help="table (default), wide, json, yaml, name, custom-columns=NAME:name,RACK:labels.rack"
        ",DISK:disks[0].name or jsonpath={.items[*].name}; may stand anywhere on the line",
    )
    ap.add_argument("--json", action="store_true", help="the same as -o json")
    ap.add_argument("-y", "--yes", action="store_true", help="do destructive steps without asking")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for resource in RESOURCES:
        resource.register(sub)
    comp = sub.add_parser(
        "completion",
        help="print the shell code that completes metalctl (eval it from your shell's rc file)",
    )
    comp.add_argument("shell", choices=["bash", "zsh", "fish", "tcsh", "powershell"])
    comp.set_defaults(func=completion)
    return ap


def completion(args: argparse.Namespace, _c: Client) -> None:
    """``eval "$(metalctl completion bash)"``: subcommands, options and machine names."""
    print(argcomplete.shellcode(["metalctl"], shell=args.shell))


def hoist_output(argv: list[str]) -> list[str]:
    """Move ``-o X``/``--output X``/``--output=X``/``-oX`` and ``--json`` to the front, so they
    may stand anywhere on the line (after the subcommand too) and the top parser reads them."""
    front: list[str] = []
    rest: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--":
            rest += argv[i:]
            break
        if a in ("-o", "--output") and i + 1 < len(argv):
            front += [a, argv[i + 1]]
            i += 2
            continue
        if a.startswith("--output=") or (a.startswith("-o") and len(a) > 2 and a[2] != "-"):
            front.append(a)
        elif a == "--json":
            front += ["-o", "json"]
        elif a in ("-y", "--yes"):
            front.append("--yes")
        else:
            rest.append(a)
        i += 1
    return front + rest


#: The kind ``-o name`` prints before each name (``machine/r07-u12``), by command.
NOUNS = {
    "machines": "machine",
    "events": "event",
    "tokens": "token",
    "tenants": "tenant",
    "bmcs": "bmc",
    "images": "image",
    "claims": "claim",
    "instances": "instance",
}

#: What to tell someone who cannot reach metald.
URL_HINT = (
    "is metald running there? Point metalctl at it with METALD_URL "
    "(export METALD_URL=http://metald.example:8080) or --url"
)

#: What to tell someone whose token is missing or refused.
TOKEN_HINT = (
    "set METALD_TOKEN to an API token (export METALD_TOKEN=mtd_...); an admin issues one with "
    "'metalctl tokens create --name <you> --role technician'"
)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # Only when a shell asks (it sets _ARGCOMPLETE): prints the candidates and exits.
    argcomplete.autocomplete(parser)
    argv = firmware.fix_argv(hoist_output(list(sys.argv[1:] if argv is None else argv)))
    args = parser.parse_args(argv)
    args.json = args.output == "json"
    args.noun = NOUNS.get(args.cmd, args.cmd)  # -o name: machine/r07-u12
    token = os.environ.get("METALD_TOKEN")
    client = Client(args.url, token)
    try:
        return args.func(args, client) or 0
    except (UsageError, UnknownField) as e:
        print(f"metalctl: {e}", file=sys.stderr)
        return 2
    except ApiError as e:
        print(f"metalctl: {e} (HTTP {e.status})", file=sys.stderr)
        if e.status == 401:
            why = "no METALD_TOKEN is set" if not token else "the token was refused"
            print(f"metalctl: {why}: {TOKEN_HINT}", file=sys.stderr)
        return 1
    except urllib.error.URLError as e:
        print(f"metalctl: cannot reach {args.url}: {e.reason}", file=sys.stderr)
        print(f"metalctl: {URL_HINT}", file=sys.stderr)
        return 2
    except ConnectionError as e:  # refused or reset after the URL was opened
        print(f"metalctl: cannot reach {args.url}: {e}", file=sys.stderr)
        print(f"metalctl: {URL_HINT}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
