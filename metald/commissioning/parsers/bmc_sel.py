"""The BMC's system event log before and after the checks (the ``bmc-sel`` check).

metald, not the agent, reads the log through the machine's BMC: once when the agent asks for
its plan (before any check runs) and once when the last check is in. The host can lie; the BMC
is the independent witness of what the hardware did during the burn-in. New entries of critical
severity fail the run with a sentence naming them; a BMC that could not be read is an error,
never a pass.

Entries come as ``metald.bmc.base.LogEntry`` rendered to dicts (``id``, ``at``, ``severity``,
``message``): the IPMI driver's severity is pyghmi's per sensor type and event offset (memory
uncorrectable ECC, processor IERR and uncorrectable machine checks, non-recoverable and
critical thresholds...), the Redfish driver's the LogEntry's ``Severity``. A message naming a
well-known fatal event is critical whatever severity the BMC gave it (some BMCs log everything
as OK); a deassertion never is.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping
from typing import Any

from metald.commissioning.verdict import Verdict, error, failed, judge

#: Keys kept from the first reading (a SEL holds at most a few thousand records; a hostile BMC
#: cannot make the stored reading unbounded).
MAX_KEYS = 20_000
#: New entries named in the result's values and raw output.
MAX_LISTED = 50

_CRITICAL_SEVERITIES = frozenset({"critical", "failed", "fatal"})
#: Fatal events by name, for BMCs whose severity says nothing (IPMI event offsets as ipmitool
#: and pyghmi print them; Redfish messages that quote them).
_FATAL = re.compile(
    r"uncorrectable (?:ecc|error|machine check)|\bierr\b|non-recoverable|"
    r"thermal trip|critical over temperature|frb[123]|machine check exception",
    re.IGNORECASE,
)
_CORRECTABLE = re.compile(r"(?<!un)correctable machine check", re.IGNORECASE)
_DEASSERTED = re.compile(r"deassert|recovered|no longer|restored", re.IGNORECASE)


def entry_key(e: Mapping[str, Any]) -> str:
    """What identifies an entry across two readings: its record id and message. Not its time:
    pyghmi rewrites pre-init timestamps from the BMC's clock at every read."""
    raw = f"{e.get('id', '')}\x00{e.get('message', '')}".encode()
    return hashlib.sha256(raw).hexdigest()[:20]


def is_critical(e: Mapping[str, Any]) -> bool:
    msg = str(e.get("message") or "")
    if _DEASSERTED.search(msg):
        return False
    if str(e.get("severity") or "").lower() in _CRITICAL_SEVERITIES:
        return True
    return bool(_FATAL.search(msg)) and not _CORRECTABLE.search(msg)


def reading(
    entries: Iterable[Mapping[str, Any]] | None, *, at: str, error_text: str | None = None
) -> dict[str, Any]:
    """What metald stores from one read: the entries' keys (bounded), their count, when, and
    why it failed if it did."""
    if entries is None:
        return {"at": at, "error": (error_text or "the BMC's event log could not be read")[:500]}
    items = list(entries)
    return {
        "at": at,
        "error": None,
        "count": len(items),
        "keys": [entry_key(e) for e in items[-MAX_KEYS:]],
    }


def _name(e: Mapping[str, Any]) -> str:
    when = f" at {e['at']}" if e.get("at") else ""
    return f"#{e.get('id', '?')} {str(e.get('message') or '').strip()[:120]}{when}"


def judge_sel(
    before: Mapping[str, Any] | None,
    after: Iterable[Mapping[str, Any]] | None,
    *,
    after_error: str | None = None,
) -> tuple[Verdict, str]:
    """The verdict and the raw text to keep: entries that appeared between the two readings,
    the critical ones named. Unreadable before or after is an error; a log that lost every entry
    of the first reading (cleared during the run) cannot pass, and fails if what is left holds a
    critical entry."""
    if before is None:
        return error("metald has no reading of the BMC's event log from before the checks"), ""
    if before.get("error"):
        return error(
            f"the BMC's event log could not be read before the checks: {before['error']}"
        ), ""
    if after is None:
        why = after_error or "the BMC's event log could not be read"
        return error(f"the BMC's event log could not be read after the checks: {why}"), ""
    items = list(after)
    seen = set(before.get("keys") or [])
    new = [e for e in items if entry_key(e) not in seen]
    kept = len(items) - len(new)
    cleared = bool(seen) and kept == 0
    critical = [e for e in new if is_critical(e)]
    values = {
        "entries_before": before.get("count", 0),
        "entries_after": len(items),
        "new": len(new),
        "new_critical": len(critical),
        "cleared": cleared,
        "critical": [_name(e) for e in critical[:MAX_LISTED]],
    }
    raw = "\n".join(
        f"{'CRITICAL ' if is_critical(e) else ''}{e.get('severity', '?')} {_name(e)}"
        for e in new[-MAX_LISTED:]
    )
    if critical:
        listed = "; ".join(_name(e) for e in critical[:5])
        more = f" and {len(critical) - 5} more" if len(critical) > 5 else ""
        note = " (the log was also cleared during the run)" if cleared else ""
        return (
            failed([f"{len(critical)} new critical BMC event(s): {listed}{more}{note}"], **values),
            raw,
        )
    if cleared:
        return (
            error(
                f"the BMC's event log was cleared during the run ({before.get('count', 0)} "
                f"entries before, none of them after): what happened in between is unknown",
                **values,
            ),
            raw,
        )
    return judge([], f"no new critical BMC event ({len(new)} new entries)", **values), raw
