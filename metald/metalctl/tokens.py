"""``metalctl tokens`` (admin): list, create and revoke API tokens."""

from __future__ import annotations

import argparse
from typing import Any

from .client import Client
from .names import machine_names, shown, tenant_names
from .options import Subparsers
from .output import emit, emit_table, machine_readable, render

ROLES = ["admin", "technician", "orchestrator", "agent"]
COLUMNS = [
    ("ID", "id"),
    ("NAME", "name"),
    ("ROLE", "role"),
    ("SCOPE", "scope_s"),
    ("STATUS", "status"),
    ("EXPIRES", "expires_at"),
]


def register(sub: Subparsers) -> None:
    t = sub.add_parser("tokens", help="API tokens (admin)")
    tsub = t.add_subparsers(dest="sub", required=True)
    tsub.add_parser("list", help="the API tokens (admin)").set_defaults(func=list_tokens)
    tc = tsub.add_parser("create", help="issue a token; its secret is printed once")
    tc.add_argument("--name", required=True)
    tc.add_argument("--role", required=True, choices=ROLES)
    tc.add_argument("--scope", action="append", default=[])
    tc.add_argument("--ttl", type=int, help="seconds")
    tc.set_defaults(func=create)
    tr = tsub.add_parser("revoke", help="revoke a token at once")
    tr.add_argument("id")
    tr.set_defaults(func=revoke)


def _row(t: dict[str, Any], names: dict[str, str] | None = None) -> dict[str, Any]:
    scope = [shown(names or {}, s) for s in t["scope"]]
    return dict(t, scope_s=",".join(scope), status="revoked" if t["revoked_at"] else "active")


def list_tokens(args: argparse.Namespace, c: Client) -> None:
    """Scopes by name: an orchestrator's tenants, an agent's machine."""
    page = c.call("GET", "/api/v1/tokens")
    scoped = [t for t in page["items"] if t["scope"]]
    names: dict[str, str] = {}
    if any(t["role"] == "orchestrator" for t in scoped):
        names |= tenant_names(c, (s for t in scoped for s in t["scope"]))
    if any(t["role"] == "agent" for t in scoped):
        names |= machine_names(c)
    emit_table(args, page, COLUMNS, row=lambda t: _row(t, names))


def create(args: argparse.Namespace, c: Client) -> None:
    scope = args.scope
    if args.role == "orchestrator":  # tenants by name or id prefix, as everywhere
        scope = [c.call("GET", f"/api/v1/tenants/{ref}")["id"] for ref in scope]
    body: dict[str, Any] = {"name": args.name, "role": args.role, "scope": scope}
    if args.ttl:
        body["ttl_seconds"] = args.ttl
    t = c.call("POST", "/api/v1/tokens", body)
    if machine_readable(args):
        print(render(args, t))
    else:
        print(
            f"token {t['name']} ({t['id'][:8]}, {t['role']}) created; the secret is shown only now:"
        )
        print(t["token"])


def revoke(args: argparse.Namespace, c: Client) -> None:
    emit(args, c.call("DELETE", f"/api/v1/tokens/{args.id}"), lambda t: f"revoked {t['id']}")
