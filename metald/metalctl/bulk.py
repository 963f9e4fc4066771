"""Acting on many machines at once: pick them by ``--selector`` (or name them), confirm once
for the lot, act on each, print one line of result per machine, and exit 1 when any failed."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from .client import ApiError, Client, Query
from .options import UsageError, confirm
from .output import emit_table

#: Selector keys that are machine fields (the list endpoint's filters); any other key is a
#: label (``team=ml``).
FIELD_KEYS = {"rack": "rack", "state": "state", "gpu_model": "gpu_model", "tenant": "tenant_id"}
#: How many names the confirmation question lists before "and N more".
LISTED = 8


class Failed(Exception):
    """One machine's step failed on metalctl's side (it did not get there in time)."""


RESULT_COLUMNS = [("NAME", "name"), ("ID", "short_id"), ("RESULT", "result"), ("DETAIL", "detail")]


def parse_selector(text: str) -> Query:
    """``rack=r07,team=ml`` as the list endpoint's query (every term must hold)."""
    query: Query = []
    for term in text.split(","):
        key, sep, value = term.strip().partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key or not value:
            raise UsageError(
                f"selector term {term.strip()!r}: write key=value (rack, state, gpu_model, "
                "tenant or a label key), several joined by commas"
            )
        field = FIELD_KEYS.get(key)
        query.append((field, value) if field else ("label", f"{key}={value}"))
    return query


def select(c: Client, refs: list[str], selector: str | None) -> list[dict[str, Any]]:
    """The machines the command names: each ``refs`` entry (id, name or prefix), or every
    machine ``selector`` matches (all pages). Exactly one of the two."""
    if bool(refs) == bool(selector):
        raise UsageError("name machines or give --selector key=value (one of the two)")
    if selector:
        found = list(c.iterate("/api/v1/machines", parse_selector(selector)))
        if not found:
            raise UsageError(f"no machine matches --selector {selector}; nothing was done")
        return found
    return [c.call("GET", f"/api/v1/machines/{r}") for r in refs]


def label(m: dict[str, Any]) -> str:
    return m.get("name") or m["id"]


def confirm_many(args: argparse.Namespace, what: str, machines: list[dict[str, Any]]) -> None:
    names = ", ".join(label(m) for m in machines[:LISTED])
    more = f" and {len(machines) - LISTED} more" if len(machines) > LISTED else ""
    noun = "machine" if len(machines) == 1 else "machines"
    confirm(args, f"{what} {len(machines)} {noun} ({names}{more})")


def apply(
    machines: list[dict[str, Any]], act: Callable[[dict[str, Any]], str]
) -> list[dict[str, Any]]:
    """``act`` on every machine (one failure does not stop the rest): a result row each."""
    results: list[dict[str, Any]] = []
    for m in machines:
        r = {"id": m["id"], "short_id": m["id"][:8], "name": m.get("name") or "-"}
        try:
            r.update(result="ok", detail=act(m))
        except ApiError as e:
            r.update(result="failed", detail=f"{e.detail} (HTTP {e.status})")
        except Failed as e:
            r.update(result="failed", detail=str(e))
        results.append(r)
    return results


def report(args: argparse.Namespace, results: list[dict[str, Any]]) -> int:
    """A table of what happened to each machine; 1 when any failed."""
    failed = sum(r["result"] != "ok" for r in results)
    emit_table(
        args,
        {"items": results, "total": len(results), "failed": failed},
        RESULT_COLUMNS,
        footer=lambda d: f"({d['total'] - d['failed']} ok, {d['failed']} failed)",
    )
    if failed:
        print(f"metalctl: {failed} of {len(results)} failed", file=sys.stderr)
    return 1 if failed else 0


def run_each(
    args: argparse.Namespace,
    machines: list[dict[str, Any]],
    act: Callable[[dict[str, Any]], str],
) -> int:
    """``apply`` then ``report``."""
    return report(args, apply(machines, act))
