"""Log entries a Redfish BMC pushes (EventService subscription) -> signals, recorded as the
polled ones are.

Each subscription has its own secret (``new_secret``), made by the BMC's owner when it
subscribes and sent by the BMC with every event (an ``HttpHeaders`` entry, else the
subscription's ``Context``); the store keeps only its hash. An event is accepted for a BMC
only with that BMC's secret, compared in constant time: another BMC's secret, a guessed one or
none is refused alike, and nothing is recorded.

Dedup with polling: an entry's key (``entry_key``: record id and message) is the same pushed
or polled. A pushed entry whose key the BMC's cursor already holds (polled first) is not
signalled again; a pushed entry signalled here keeps its key on the subscription row, which
the polled read (``metald.healthwatch.watch.record_bmc_log``) takes as seen.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlmodel import Session

from metald.errors import Unauthorized
from metald.health import bmc as bmc_signals
from metald.health.classify import Table
from metald.health.config import HealthConfig
from metald.health.signals import Kind
from metald.healthwatch.watch import (
    MAX_PUSHED_KEYS,
    new_secret,
    record_signals,
    secret_hash,
    subscription,
)
from metald.store.models import Bmc, BmcEventSubscription, BmcLogCursor

__all__ = ["MAX_PUSHED_KEYS", "Pushed", "accept", "check", "new_secret", "secret_hash"]

#: The same answer for every refusal: which part was wrong is not told.
REFUSED = (
    "this event does not carry the secret of this BMC's subscription; only the BMC metald "
    "subscribed can push events here (metald re-subscribes it on its next read)"
)
_DUMMY = secret_hash("no subscription")


def check(sub: BmcEventSubscription | None, secret: str | None) -> None:
    """Refuse (401) unless ``secret`` is the subscription's, in constant time."""
    want = sub.secret_hash if sub is not None else _DUMMY
    got = secret_hash(secret or "")
    if not hmac.compare_digest(want, got) or sub is None or not secret:
        raise Unauthorized(REFUSED)


@dataclass(frozen=True)
class Pushed:
    entries: int
    signals: int
    new_faults: int


def accept(
    s: Session,
    bmc_id: str,
    secret: str | None,
    events: list[Any],
    *,
    cfg: HealthConfig,
    table: Table,
    now: datetime,
    actor: str,
    instance: str | None,
) -> Pushed:
    """Check the secret, then record the entries not seen (pushed or polled) as the BMC's
    signals. Committed; a refusal writes nothing."""
    sub = subscription(s, bmc_id, lock=True)
    check(sub, secret)
    assert sub is not None
    entries = bmc_signals.pushed_entries(events)
    b = s.get(Bmc, bmc_id)
    cur = s.get(BmcLogCursor, bmc_id)
    seen = [*(cur.keys if cur is not None else []), *sub.keys]
    kind = Kind.REDFISH_LOG if b is not None and b.protocol == "redfish" else Kind.SEL
    sigs, _ = bmc_signals.log_signals(entries, seen=seen, at=now, kind=kind)
    if sigs:
        fresh = [bmc_signals.entry_key(e) for e in entries]
        sub.keys = [*sub.keys, *(k for k in fresh if k not in sub.keys)][-MAX_PUSHED_KEYS:]
    sub.event_at, sub.events = now, sub.events + 1
    s.add(sub)
    if not sigs or b is None or b.machine_id is None:
        s.commit()
        return Pushed(len(entries), len(sigs), 0)
    # (a machine no longer in use: nothing is written, as for a polled entry)
    n = record_signals(s, b.machine_id, sigs, cfg=cfg, table=table, now=now, actor=actor,
                       instance=instance)  # fmt: skip
    return Pushed(len(entries), len(sigs), n)
