"""``metalctl attestation skus|set-sku|remove-sku``: golden boot measurements an operator gives
per SKU (the SMBIOS product), checked instead of trust on first use (docs/attestation.md)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any
from urllib.parse import quote

from .client import Client
from .options import Subparsers, UsageError
from .output import emit, emit_table

COLUMNS = [("PRODUCT", "product"), ("SOURCE", "source"), ("SET_BY", "set_by"),
           ("SET_AT", "set_at"), ("REASON", "reason")]  # fmt: skip


def register(sub: Subparsers) -> None:
    at = sub.add_parser("attestation", help="golden boot measurements per SKU")
    asub = at.add_subparsers(dest="sub", required=True)
    asub.add_parser("skus", help="the SKUs with golden values").set_defaults(func=list_skus)
    shw = asub.add_parser("sku", help="one SKU's golden values")
    shw.add_argument("product", help="the SMBIOS product, as machines report it")
    shw.set_defaults(func=show_sku)
    st = asub.add_parser(
        "set-sku",
        help="set a SKU's golden values: from a reference machine's last measured boot "
        "(--from-machine, e.g. after a firmware rollout) or a JSON file (--file); held "
        "machines of the SKU measuring them go back to ready",
    )
    st.add_argument("product", help="the SMBIOS product, as machines report it")
    src = st.add_mutually_exclusive_group(required=True)
    src.add_argument("--from-machine", metavar="ID", help="a machine of this SKU")
    src.add_argument(
        "--file", type=Path, help='JSON: {"pcrs": {"0": "<sha256 hex>", ...}, "events": {...}}'
    )
    st.add_argument("--reason", required=True)
    st.set_defaults(func=set_sku)
    rm = asub.add_parser("remove-sku", help="forget a SKU's golden values")
    rm.add_argument("product")
    rm.add_argument("--reason", required=True)
    rm.set_defaults(func=remove_sku)


def _path(product: str) -> str:
    return f"/api/v1/attestation/skus/{quote(product, safe='')}"


def _text(g: dict[str, Any]) -> str:
    lines = [f"{g['product']}: {g['source']} by {g['set_by']} ({g['reason']})"]
    lines += [f"    PCR {k}: {v}" for k, v in sorted(g["pcrs"].items(), key=lambda kv: int(kv[0]))]
    if g.get("released"):
        lines.append(f"back to ready: {', '.join(g['released'])}")
    return "\n".join(lines)


def list_skus(args: argparse.Namespace, c: Client) -> None:
    emit_table(args, c.call("GET", "/api/v1/attestation/skus"), COLUMNS)


def show_sku(args: argparse.Namespace, c: Client) -> None:
    emit(args, c.call("GET", _path(args.product)), _text)


def set_sku(args: argparse.Namespace, c: Client) -> None:
    body: dict[str, Any] = {"reason": args.reason}
    if args.from_machine:
        body["machine_id"] = args.from_machine
    else:
        try:
            body["golden"] = json.loads(args.file.read_text())
        except (OSError, ValueError) as e:
            raise UsageError(f"--file {args.file}: {e}") from None
    emit(args, c.call("PUT", _path(args.product), body), _text)


def remove_sku(args: argparse.Namespace, c: Client) -> None:
    c.call("DELETE", _path(args.product), {"reason": args.reason})
    emit(args, {"product": args.product, "removed": True}, lambda _: f"{args.product}: removed")
