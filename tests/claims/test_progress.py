"""Agent progress on the store: events, throttling of chatty agents, and the end transitions."""

from __future__ import annotations

import pytest
from sqlmodel import select

from metald.errors import Conflict
from metald.lifecycle import State
from metald.provision.progress import Progress, record_progress
from metald.store import Store
from metald.store.models import Event
from tests.claims.helpers import claimed


def _progress_events(store: Store) -> list[dict]:
    with store.session() as s:
        evs = s.exec(
            select(Event).where(Event.kind == "provision.progress").order_by(Event.id)
        ).all()  # type: ignore[arg-type]
        return [e.data or {} for e in evs]


def test_chatty_agent_is_throttled_but_endings_never_are(store: Store) -> None:
    (mid,) = claimed(store, 1)
    with store.session() as s:
        for pct in (1, 2, 3):
            record_progress(s, mid, Progress("write", percent=pct), actor="a", min_interval_s=3600)
        record_progress(s, mid, Progress("verify", percent=0), actor="a", min_interval_s=3600)
        m = record_progress(s, mid, Progress("verify", done=True), actor="a", min_interval_s=3600)
    assert m.state == State.PROVISIONED.value
    assert [(d["phase"], d.get("percent")) for d in _progress_events(store)] == [
        ("write", 1),
        ("verify", 0),
        ("verify", None),
    ]
    with store.session() as s, pytest.raises(Conflict, match="provisioned"):
        record_progress(s, mid, Progress("write"), actor="a")
    assert len(_progress_events(store)) == 3  # a refused report writes nothing


def test_every_report_stored_without_throttle(store: Store) -> None:
    (mid,) = claimed(store, 1)
    with store.session() as s:
        for pct in (10, 20):
            record_progress(
                s, mid, Progress("write", percent=pct, bytes=pct, rate_bps=1.5), actor="a"
            )
    assert _progress_events(store) == [
        {"phase": "write", "percent": 10, "bytes": 10, "rate_bps": 1.5},
        {"phase": "write", "percent": 20, "bytes": 20, "rate_bps": 1.5},
    ]
