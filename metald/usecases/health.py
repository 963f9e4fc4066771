"""Health: a tenant node's report (node token only). The witness is the node whatever the
body says (``metald.healthwatch.reports``); the report is recorded in one transaction."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from functools import partial
from typing import Any

from sqlalchemy.exc import IntegrityError

from metald.errors import Unauthorized
from metald.health.classify import Table
from metald.health.config import HealthConfig
from metald.healthwatch import pushed, reports
from metald.healthwatch.intake import Intake
from metald.limits import TooMany
from metald.tenants import mesh
from metald.usecases import Writes

_TABLES: dict[int, tuple[HealthConfig, Table]] = {}


def table_for(cfg: HealthConfig) -> Table:
    """The classification table of a configuration, built once per configuration object."""
    hit = _TABLES.get(id(cfg))
    if hit is None or hit[0] is not cfg:
        hit = (cfg, cfg.table())
        _TABLES[id(cfg)] = hit
    return hit[1]


async def node_report(
    tx: Writes,
    secret: str,
    body: dict[str, Any],
    *,
    cfg: HealthConfig,
    instance: str | None,
    wake: Callable[[], None] = lambda: None,
    memo: reports.ReportMemo | None = None,
    limit: Intake | None = None,
    source: str = "",
) -> dict[str, Any]:
    """Record one report; answers ``{"interval_s": N, ...}`` (when to send the next).
    ``memo``: the health watch's (``HealthWatch.report_memo``), where a report that says what
    the node's last clean one said is taken without a database call. ``limit``: the route's
    token buckets (per presented token, per ``source`` address, in all), checked first: 429
    before anything else is read."""
    table = table_for(cfg)
    now = datetime.now(UTC)
    key = mesh.hash_token(secret) if memo is not None or limit is not None else ""
    if limit is not None:
        limit.admit(key, source)
    got = None
    if memo is not None:  # a report that says nothing new: no database call
        got = memo.quick(key, body, cfg=cfg, table=table, now=now)
    if got is None:
        try:
            accept = partial(
                reports.accept, cfg=cfg, table=table, now=now, actor="node", instance=instance
            )
            got = await tx.run(accept, secret, body)
        except IntegrityError:
            # Two reports of one node at once on PostgreSQL (the first heartbeat row): one wins.
            raise TooMany(
                "another report of this node is being recorded; send the next after Retry-After",
                retry_after_s=max(1, int(cfg.report_min_interval_s) or 1),
            ) from None
        except TooMany:
            raise
        except Unauthorized:
            if limit is not None:
                limit.count("refused")
            raise
        except Exception:
            if memo is not None:
                memo.forget(key)
            raise
        if memo is not None:
            if got.seen is not None:
                memo.remember(key, got.seen)
            else:
                memo.forget(key)
    if limit is not None:
        limit.count("accepted")
    if got.remediation or got.new_faults:
        wake()  # the health watch carries the remediation forward now, not at its interval
    return {
        "interval_s": got.interval_s,
        "signals": got.signals,
        "new_faults": got.new_faults,
        "unreadable": got.unreadable,
    }


async def bmc_event(
    tx: Writes,
    bmc_id: str,
    secret: str | None,
    events: list[Any],
    *,
    cfg: HealthConfig,
    instance: str | None,
    wake: Callable[[], None] = lambda: None,
    limit: Intake | None = None,
    source: str = "",
) -> dict[str, Any]:
    """Record a Redfish event a BMC pushed to its subscription (``metald.healthwatch.pushed``):
    429 past the route's token buckets (per BMC id, per ``source`` address, in all: checked
    before the store is touched); 401 without that BMC's secret; the new entries as the BMC's
    signals, and the health watch woken at once where a fault opened (the remediation is
    carried forward now)."""
    if limit is not None:
        limit.admit(bmc_id, source)
    accept = partial(pushed.accept, cfg=cfg, table=table_for(cfg), now=datetime.now(UTC),
                     actor="bmc-event", instance=instance)  # fmt: skip
    try:
        got = await tx.run(accept, bmc_id, secret, events)
    except Unauthorized:
        if limit is not None:
            limit.count("refused")
        raise
    if limit is not None:
        limit.count("accepted")
    if got.new_faults:
        wake()
    return {"entries": got.entries, "signals": got.signals, "new_faults": got.new_faults}
