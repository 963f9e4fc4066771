"""The console's sessions without a browser: idle and absolute expiry, the bound token's
revocation and expiry, who may log in, and the CSRF comparison."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlmodel import select

from metald.auth import issue_token, revoke_token
from metald.store import Store
from metald.store.models import UiSession, utcnow
from metald.usecases import ui_sessions as sessions


@pytest.fixture
def sqlite_store(tmp_path) -> Store:  # type: ignore[no-untyped-def]
    s = Store(f"sqlite:///{tmp_path / 'm.db'}")
    s.migrate()
    return s


def test_idle_and_absolute_expiry(sqlite_store: Store) -> None:
    with sqlite_store.session() as s:
        row, secret = issue_token(s, name="t", role="technician")
        t0 = utcnow()
        opened = sessions.open_session(s, secret, now=t0)
        assert opened.principal.token_id == row.id
        stored = s.exec(select(UiSession)).one()
        assert opened.session_id not in (stored.id_hash, stored.csrf)  # only its hash is kept
        # Used just inside the idle window, it lives on (and is touched) ...
        t = t0
        for _ in range(20):
            t += sessions.IDLE - timedelta(seconds=1)
            if t >= t0 + sessions.ABSOLUTE:
                break
            assert sessions.load_session(s, opened.session_id, now=t) is not None
        # ... until its absolute end, however busy.
        assert sessions.load_session(s, opened.session_id, now=t0 + sessions.ABSOLUTE) is None
        assert s.exec(select(UiSession)).all() == []
        idle = sessions.open_session(s, secret, now=t0)
        assert sessions.load_session(s, idle.session_id, now=t0 + sessions.IDLE) is None
        # A session nobody comes back to goes at the next login.
        sessions.open_session(s, secret, now=t0)
        sessions.open_session(s, secret, now=t0 + sessions.IDLE)
        assert len(s.exec(select(UiSession)).all()) == 1


def test_the_bound_token_ends_the_session(sqlite_store: Store) -> None:
    with sqlite_store.session() as s:
        row, secret = issue_token(s, name="t", role="admin")
        opened = sessions.open_session(s, secret)
        assert sessions.load_session(s, opened.session_id) is not None
        revoke_token(s, row.id)
        assert sessions.load_session(s, opened.session_id) is None
        _row, short = issue_token(s, name="s", role="admin", ttl=timedelta(minutes=5))
        brief = sessions.open_session(s, short)
        later = utcnow() + timedelta(minutes=6)
        assert sessions.load_session(s, brief.session_id, now=later) is None


def test_who_may_log_in(sqlite_store: Store) -> None:
    with sqlite_store.session() as s:
        from metald.store.models import Machine

        m = Machine(state="ready")
        s.add(m)
        s.commit()
        _row, agent = issue_token(s, name="a", role="agent", scope=[m.id])
        with pytest.raises(sessions.LoginRefused, match="agent tokens cannot log in"):
            sessions.open_session(s, agent)
        with pytest.raises(sessions.LoginRefused, match="not valid"):
            sessions.open_session(s, "mtd_nope")


def test_csrf_is_compared_whole() -> None:
    assert sessions.csrf_matches("abc", "abc")
    assert not sessions.csrf_matches("abc", "abd")
    assert not sessions.csrf_matches("abc", "ab")
    assert not sessions.csrf_matches("abc", None)
    assert not sessions.csrf_matches("abc", "")
