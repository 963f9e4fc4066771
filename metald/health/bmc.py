"""What the BMC witnesses -> signals: its event log read incrementally, and its sensors.

Entries and sensors come as ``metald.bmc.base.LogEntry`` / ``Sensor`` rendered to dicts (as
the commissioning SEL check takes them). An entry is new when its key (record id and message,
``metald.commissioning.parsers.bmc_sel.entry_key``) was not seen in the earlier readings.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

from metald.commissioning.parsers.bmc_sel import MAX_KEYS, entry_key
from metald.health.signals import OK, Kind, Signal, Witness

#: Sensor healths that are a finding; ``ok`` is the BMC's clear.
_SENSOR_FINDINGS = frozenset({"warning", "critical"})


def log_signals(
    entries: Iterable[Mapping[str, Any]],
    *,
    seen: Iterable[str],
    at: datetime,
    kind: Kind = Kind.SEL,
) -> tuple[list[Signal], list[str]]:
    """The signals of the entries not seen before, and the keys to keep for the next read
    (bounded to the newest ``MAX_KEYS``). The code is ``<severity>: <message>``."""
    known = set(seen)
    items = list(entries)
    out = []
    for e in items:
        key = entry_key(e)
        if key in known:
            continue
        known.add(key)
        sev = str(e.get("severity") or "unknown").lower()
        msg = " ".join(str(e.get("message") or "").split())
        when = e.get("at")
        stamp = when.isoformat() if isinstance(when, datetime) else str(when or "")
        out.append(
            Signal(
                kind,
                Witness.BMC,
                "bmc",
                f"{sev}: {msg}"[:300],
                at,
                f"#{e.get('id', '?')} {stamp} {sev} {msg}".strip(),
            )  # fmt: skip
        )
    keys = [entry_key(e) for e in items[-MAX_KEYS:]]
    return out, keys


def sensor_signals(sensors: Iterable[Mapping[str, Any]], *, at: datetime) -> list[Signal]:
    """One signal per sensor with a health: ``<kind>:<health>`` for warning and critical, and
    a clear for ok (the BMC may clear the degraded faults its own sensors raised)."""
    out = []
    for s in sensors:
        health = str(s.get("health") or "unknown").lower()
        if health not in _SENSOR_FINDINGS and health != "ok":
            continue
        name, kind = str(s.get("name") or "?"), str(s.get("kind") or "other").lower()
        value, unit = s.get("value"), s.get("unit") or ""
        code = OK if health == "ok" else f"{kind}:{health}"
        out.append(
            Signal(
                Kind.SENSOR,
                Witness.BMC,
                name,
                code,
                at,
                f"sensor {name} ({kind}) {health} at {value} {unit}".strip(),
                None if value is None else float(value),
            )  # fmt: skip
        )
    return out


#: Events one pushed Redfish Event payload may carry that are read (the rest are ignored).
MAX_PUSHED_EVENTS = 32


def pushed_entries(events: Iterable[Any]) -> list[dict[str, Any]]:
    """The log entries a pushed Redfish ``Event`` (``#Event.v1_x_x.Event``) names, as the
    polled log renders them (``id``, ``at``, ``severity``, ``message``), so that an entry
    pushed and later polled has the same ``entry_key``: its id is the ``LogEntry`` (or
    ``OriginOfCondition``) link's last segment where that link is a log entry, else the
    ``EventId``. Events that are not objects, or carry no message, are skipped; unknown
    fields are ignored; at most ``MAX_PUSHED_EVENTS`` are read."""
    out: list[dict[str, Any]] = []
    for ev in list(events)[:MAX_PUSHED_EVENTS]:
        if not isinstance(ev, Mapping):
            continue
        msg = ev.get("Message")
        if not isinstance(msg, str) or not msg.strip():
            continue
        rid = None
        for link in (ev.get("LogEntry"), ev.get("OriginOfCondition")):
            uri = link.get("@odata.id") if isinstance(link, Mapping) else None
            if isinstance(uri, str) and "/Entries/" in uri:
                rid = uri.rstrip("/").rsplit("/", 1)[-1]
                break
        if rid is None:
            rid = ev.get("EventId")
        sev = ev.get("Severity") or ev.get("MessageSeverity") or "OK"
        at = ev.get("EventTimestamp")
        out.append(
            {
                "id": str(rid if rid is not None else "?")[:64],
                "at": at[:64] if isinstance(at, str) else None,
                "severity": str(sev).lower()[:32],
                "message": msg,  # whole: the key is the polled entry's (the body is bounded)
            }
        )
    return out
