"""``metalctl whoami``: the token in use, its role and scope."""

from __future__ import annotations

import argparse

from .client import Client
from .options import Subparsers
from .output import emit


def register(sub: Subparsers) -> None:
    sub.add_parser("whoami", help="show the token in use").set_defaults(func=whoami)


def whoami(args: argparse.Namespace, c: Client) -> None:
    emit(
        args,
        c.call("GET", "/api/v1/whoami"),
        lambda w: f"{w['name']} ({w['role']}) scope={','.join(w['scope']) or '-'}",
    )
