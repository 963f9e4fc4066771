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
from metald.healthwatch import reports
from metald.limits import TooMany
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
) -> dict[str, Any]:
    """Record one report; answers ``{"interval_s": N, ...}`` (when to send the next)."""
    table = table_for(cfg)
    try:
        accept = partial(
            reports.accept, cfg=cfg, table=table, now=datetime.now(UTC), actor="node",
            instance=instance,
        )  # fmt: skip
        got = await tx.run(accept, secret, body)
    except IntegrityError:
        # Two reports of one node at once on PostgreSQL (the first heartbeat row): one wins.
        raise TooMany(
            "another report of this node is being recorded; send the next after Retry-After",
            retry_after_s=max(1, int(cfg.report_min_interval_s) or 1),
        ) from None
    if got.remediation or got.new_faults:
        wake()  # the health watch carries the remediation forward now, not at its interval
    return {
        "interval_s": got.interval_s,
        "signals": got.signals,
        "new_faults": got.new_faults,
        "unreadable": got.unreadable,
    }
