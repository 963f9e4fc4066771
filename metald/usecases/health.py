"""Health: a tenant node's report (node token only). The witness is the node whatever the
body says (``metald.healthwatch.reports``); the report is recorded in one transaction."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from functools import partial
from typing import Any

from sqlalchemy.exc import IntegrityError

from metald.health.classify import Table
from metald.health.config import HealthConfig
from metald.healthwatch import pushed, reports
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
) -> dict[str, Any]:
    """Record one report; answers ``{"interval_s": N, ...}`` (when to send the next).
    ``memo``: the health watch's (``HealthWatch.report_memo``), where a report that says what
    the node's last clean one said is taken without a database call."""
    table = table_for(cfg)
    now = datetime.now(UTC)
    key = mesh.hash_token(secret) if memo is not None else ""
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
        except Exception:
            if memo is not None:
                memo.forget(key)
            raise
        if memo is not None:
            if got.seen is not None:
                memo.remember(key, got.seen)
            else:
                memo.forget(key)
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
) -> dict[str, Any]:
    """Record a Redfish event a BMC pushed to its subscription (``metald.healthwatch.pushed``):
    401 without that BMC's secret; the new entries as the BMC's signals, and the health watch
    woken at once where a fault opened (the remediation is carried forward now)."""
    accept = partial(pushed.accept, cfg=cfg, table=table_for(cfg), now=datetime.now(UTC),
                     actor="bmc-event", instance=instance)  # fmt: skip
    got = await tx.run(accept, bmc_id, secret, events)
    if got.new_faults:
        wake()
    return {"entries": got.entries, "signals": got.signals, "new_faults": got.new_faults}
