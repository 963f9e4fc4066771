"""Command-line values shared by several resources."""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from .client import Client

#: What a subcommand runs: the parsed arguments and the API client in, an exit status (None: 0).
Handler = Callable[[argparse.Namespace, Client], int | None]
#: The ``add_subparsers`` object each resource module adds its commands to.
Subparsers = Any


#: Where metalctl looks for metald without --url or METALD_URL.
DEFAULT_URL = "http://127.0.0.1:8080"


class Parser(argparse.ArgumentParser):
    """argparse with a "did you mean" for a mistyped option or subcommand."""

    def error(self, message: str) -> NoReturn:
        super().error(message + did_you_mean(self, message))


def _option_strings(parser: argparse.ArgumentParser) -> set[str]:
    """Every long option of ``parser`` and the parsers under it."""
    out: set[str] = set()
    for action in parser._actions:
        out |= {o for o in action.option_strings if o.startswith("--")}
        if isinstance(action, argparse._SubParsersAction):
            for sp in action.choices.values():
                out |= _option_strings(sp)
    return out


_UNRECOGNIZED = re.compile(r"unrecognized arguments: (.*)")
_INVALID_CHOICE = re.compile(r"invalid choice: '([^']*)' \(choose from (.*)\)")


def did_you_mean(parser: argparse.ArgumentParser, message: str) -> str:
    """ "; did you mean --state?" for the closest known option or choice, else ""."""
    if m := _UNRECOGNIZED.search(message):
        known = sorted(_option_strings(parser))
        for word in m.group(1).split():
            if word.startswith("--"):
                close = difflib.get_close_matches(word.split("=", 1)[0], known, n=1)
                if close:
                    return f"; did you mean {close[0]}?"
    if m := _INVALID_CHOICE.search(message):
        choices = re.findall(r"'([^']*)'", m.group(2))
        close = difflib.get_close_matches(m.group(1), choices, n=1)
        if close:
            return f"; did you mean {close[0]!r}?"
    return ""


class UsageError(Exception):
    """A mistake on the command line that metalctl found before asking the API (exit 2)."""


def confirm(args: argparse.Namespace, what: str) -> None:
    """Ask before a destructive step unless ``--yes``; off a terminal, refuse (exit 2) rather
    than act unasked."""
    if getattr(args, "yes", False):
        return
    if not sys.stdin.isatty():
        raise UsageError(f"{what}: add --yes to confirm (there is no terminal to ask on)")
    answer = input(f"{what}? [y/N] ").strip().lower()
    if answer not in ("y", "yes"):
        raise UsageError("not confirmed; nothing was done")


#: Power actions that interrupt what the host runs.
DISRUPTIVE_POWER = frozenset({"off", "cycle", "soft-off", "reset"})

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
            raise UsageError(f"label {item!r} must be key=value, or key- to remove it")
    return out


#: Most machine names completion offers (one page; a longer prefix narrows it).
COMPLETE_LIMIT = 200


def complete_machines(prefix: str, parsed_args: argparse.Namespace, **_: Any) -> list[str]:
    """Shell completion of a machine argument: the names (and, for a hex prefix, the ids) of
    machines the token in METALD_TOKEN can see. Nothing when the API does not answer."""
    url = getattr(parsed_args, "url", None) or os.environ.get("METALD_URL", DEFAULT_URL)
    client = Client(url, os.environ.get("METALD_TOKEN"), timeout=5.0)
    try:
        page = client.call("GET", "/api/v1/machines", query=[("limit", str(COMPLETE_LIMIT))])
    except Exception:  # noqa: BLE001 - completion must never print a traceback into a shell
        return []
    out = [m["name"] for m in page["items"] if m.get("name")]
    out += [m["id"] for m in page["items"] if len(prefix) >= 2 and m["id"].startswith(prefix)]
    return [x for x in out if x.startswith(prefix)]


def machine_ref(action: argparse.Action) -> argparse.Action:
    """Mark an argument as naming machines, for shell completion."""
    action.completer = complete_machines  # type: ignore[attr-defined]
    return action
