"""Checks an instance passes before it serves: one process per SQLite file, and a secrets key
that can read what the other instances stored."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import IO

from sqlalchemy.engine import make_url
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session

from metald.secrets import SecretBox, SecretError
from metald.store.models import StoreMeta

KEY_CHECK = "secrets_key_check"
_PLAINTEXT = "metald secrets key check"


class StartupRefused(Exception):
    """This instance must not start; the message says why and what to do."""


def hold_sqlite_lock(store_url: str) -> IO[bytes] | None:
    """Take an exclusive lock beside a SQLite database for this process's life (None for other
    stores). A second metald on the same file is refused: SQLite serves one instance."""
    u = make_url(store_url)
    if not u.drivername.startswith("sqlite") or not u.database or u.database == ":memory:":
        return None
    path = Path(u.database).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(f"{path}.instance-lock", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    f = os.fdopen(fd, "ab")  # held until the process exits
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise StartupRefused(
            f"another metald process already uses the SQLite store {path}; SQLite is for one "
            "instance: stop the other one, or run several instances on one PostgreSQL "
            "([store] url = postgresql://...) as docs/fleet.md describes"
        ) from None
    os.set_inheritable(f.fileno(), False)
    return f


def verify_secrets_key(s: Session, box: SecretBox, key_path: Path) -> bool:
    """Check this instance's key against the store's check value, writing it on first use.
    Returns True when the check value was written now."""
    row = s.get(StoreMeta, KEY_CHECK)
    if row is None:
        s.add(StoreMeta(key=KEY_CHECK, value=box.encrypt(_PLAINTEXT)))
        try:
            s.commit()
            return True
        except IntegrityError:  # another instance wrote it first: check against theirs
            s.rollback()
            row = s.get(StoreMeta, KEY_CHECK)
            assert row is not None
    try:
        ok = box.decrypt(row.value) == _PLAINTEXT
    except SecretError:
        ok = False
    if not ok:
        raise StartupRefused(
            f"the secrets key {key_path} cannot decrypt this store's secrets (BMC passwords, "
            "tenant keys): every instance on one database needs the same key. Copy secrets.key "
            "(mode 0600) from an instance that already uses this database into this instance's "
            "state_dir, then start again"
        )
    return False
