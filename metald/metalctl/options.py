"""Command-line values shared by several resources."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from .client import Client

#: What a subcommand runs: the parsed arguments and the API client in, an exit status (None: 0).
Handler = Callable[[argparse.Namespace, Client], int | None]
#: The ``add_subparsers`` object each resource module adds its commands to.
Subparsers = Any

POWER_ACTIONS = ["status", "on", "off", "cycle", "soft-off", "reset"]


def key_values(items: list[str]) -> dict[str, str | None]:
    """``key=value`` sets a label, ``key-`` removes it (``None``)."""
    out: dict[str, str | None] = {}
    for item in items:
        if "=" in item:
            k, v = item.split("=", 1)
            out[k] = v
        elif item.endswith("-"):
            out[item[:-1]] = None
        else:
            raise SystemExit(f"metalctl: label {item!r} must be key=value, or key- to remove it")
    return out
