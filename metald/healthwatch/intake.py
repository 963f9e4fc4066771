"""How fast BMCs and nodes may push to metald: token buckets in front of the two routes that
take what a machine sends on its own (``POST /api/v1/bmc-events/{bmc_id}``, a Redfish BMC's
pushed events, and ``POST /api/v1/health/report``, a node's report).

Both are reached without a user's token: a BMC proves itself with its subscription's secret, a
node with its node token, and checking either costs a database transaction. A hostile BMC (or
anything on the management network) that floods a route must not buy database work or CPU
with it: a request is refused with 429 and ``Retry-After`` *before* the store is touched
unless every bucket that applies has a token:

- ``key``: the BMC id in the path (events) or the presented token's hash (reports): one
  sender, well-behaved or not, gets its own small budget;
- ``source``: the connection's address: one host inventing BMC ids or tokens still shares one;
- ``total``: everything this instance takes on the route; never evicted.

A refusal takes no token and is counted (``metald_machine_pushes_total``, by route and
outcome). Buckets are per instance, in memory; forgotten keys are full buckets, bounded by
``MAX_KEYS`` each (``metald.boot.dhcp.enroll_limit.TokenBuckets``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Hashable

from metald.boot.dhcp.enroll_limit import MAX_KEYS, Rate, TokenBuckets
from metald.health.config import IntakeConfig
from metald.limits import TooMany
from metald.metrics import machine_pushes


class Intake:
    """The three buckets of one route (``what``: ``bmc-events`` or ``health-reports``)."""

    def __init__(
        self,
        what: str,
        *,
        key: Rate,
        source: Rate,
        total: Rate,
        clock: Callable[[], float] = time.monotonic,
        max_keys: int = MAX_KEYS,
    ) -> None:
        self.what = what
        self.clock = clock
        self.buckets: list[tuple[str, TokenBuckets]] = [
            ("key", TokenBuckets(key, max_keys)),
            ("source", TokenBuckets(source, max_keys)),
            ("total", TokenBuckets(total, 1)),
        ]

    def admit(self, key: Hashable, source: Hashable) -> None:
        """Take a token from each bucket, or none and raise the 429 (counted)."""
        now = self.clock()
        keys = {"key": key, "source": source, "total": None}
        for name, b in self.buckets:
            k = keys[name]
            if not b.has(k, now):
                machine_pushes.labels(self.what, f"limited-{name}").inc()
                lack = 1.0 - b.tokens(k, now)
                wait = math.ceil(lack / b.rate.per_s) if b.rate.per_s > 0 else 60
                raise TooMany(_SENTENCE[name].format(what=self.what), retry_after_s=max(1, wait))
        for name, b in self.buckets:
            b.take(keys[name], now)

    def count(self, outcome: str) -> None:
        machine_pushes.labels(self.what, outcome).inc()


_SENTENCE = {
    "key": "this sender pushes {what} faster than metald takes them; send again after "
    "Retry-After (a healthy BMC or node is far below the limit: check it is not looping)",
    "source": "this address pushes {what} faster than metald takes them; send again after "
    "Retry-After",
    "total": "this metald takes no more {what} right now; send again after Retry-After",
}


def for_events(cfg: IntakeConfig) -> Intake:
    return Intake(
        "bmc-events",
        key=Rate(cfg.bmc_event_burst, cfg.bmc_event_per_s),
        source=Rate(cfg.source_burst, cfg.source_per_s),
        total=Rate(cfg.total_burst, cfg.total_per_s),
    )


def for_reports(cfg: IntakeConfig) -> Intake:
    """Per node the report route's own limit (``report_min_interval_s``, read from the store)
    still holds; this one bounds what an unknown or guessed token costs before that read."""
    return Intake(
        "health-reports",
        key=Rate(cfg.report_burst, cfg.report_per_s),
        source=Rate(cfg.source_burst, cfg.source_per_s),
        total=Rate(cfg.total_burst, cfg.total_per_s),
    )
