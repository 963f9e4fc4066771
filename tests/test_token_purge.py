"""The token purge: long-revoked and long-expired tokens are deleted; everything else stays."""

from __future__ import annotations

from datetime import timedelta

from sqlmodel import select

from metald.auth import TOKEN_RETENTION, authenticate, issue_token
from metald.store.models import ApiToken, Event, utcnow
from metald.token_sweep import TokenSweeper


async def test_sweep_deletes_only_long_dead_tokens(store) -> None:  # type: ignore[no-untyped-def]
    now = utcnow()
    long_ago = now - TOKEN_RETENTION - timedelta(hours=1)
    recently = now - timedelta(minutes=5)
    with store.session() as s:
        rows = {}
        for name, revoked, expires in [
            ("live", None, None),
            ("expires-later", None, now + timedelta(days=30)),
            ("revoked-recently", recently, None),
            ("expired-recently", None, recently),
            ("revoked-long-ago", long_ago, None),
            ("expired-long-ago", None, long_ago),
            ("agent-of-an-old-boot", long_ago, long_ago + timedelta(minutes=30)),
        ]:
            row, secret = issue_token(s, name=name, role="technician", commit=False)
            row.revoked_at, row.expires_at = revoked, expires
            s.add(row)
            rows[name] = secret
        s.commit()

    sweeper = TokenSweeper(store, "test")
    assert await sweeper.sweep_once() == 3
    assert await sweeper.sweep_once() == 0  # nothing left to purge; no second event

    with store.session() as s:
        left = sorted(t.name for t in s.exec(select(ApiToken)))
        assert left == ["expired-recently", "expires-later", "live", "revoked-recently"]
        assert authenticate(s, rows["live"]) is not None
        assert authenticate(s, rows["revoked-long-ago"]) is None
        (ev,) = s.exec(select(Event).where(Event.kind == "tokens.purged")).all()
        assert ev.data is not None and ev.data["count"] == 3
