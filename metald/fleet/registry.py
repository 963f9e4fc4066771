"""The instances table: register at start, heartbeat, list who is alive. Store functions.

Liveness is judged with the database's clock on PostgreSQL (``now()``), so instances whose
clocks disagree still agree on who is alive. SQLite holds one instance only (see
``metald.fleet.startup``), so its own clock is the only one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import select, text, update
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session

from metald.errors import MetaldError
from metald.store.models import Instance, as_utc, utcnow


class InstanceNameInUse(MetaldError):
    status = 409
    title = "Instance name in use"


@dataclass(frozen=True)
class Member:
    """One instance as the fleet sees it now."""

    name: str
    alive: bool
    heartbeat_age_s: float
    version: str
    api_url: str | None = None
    host: str | None = None
    started_at: datetime | None = None
    serves: dict[str, Any] = field(default_factory=dict)


def db_now(s: Session) -> datetime:
    """The database's clock (PostgreSQL), or this host's for SQLite."""
    if s.get_bind().dialect.name == "postgresql":
        return as_utc(s.execute(text("SELECT statement_timestamp()")).scalar_one())
    return utcnow()


def register(
    s: Session,
    *,
    name: str,
    incarnation: str,
    version: str,
    api_url: str | None,
    host: str | None,
    serves: dict[str, Any],
    dead_after_s: float,
    pid: int | None = None,
    sole_user: bool = False,
) -> None:
    """Record this process as instance ``name``. Refuses while another live process holds the
    name (two processes under one name would both believe they own its share). A holder known
    to be gone is taken over at once: ``sole_user`` (this process holds the store alone: SQLite's
    lock) or the holder's process on this same host no longer runs (a crash, then a restart)."""
    now = db_now(s)
    row = s.execute(
        select(Instance).where(Instance.name == name).with_for_update()  # type: ignore[arg-type]
    ).scalar_one_or_none()
    if row is not None and row.incarnation != incarnation and row.stopped_at is None:
        age = (now - as_utc(row.heartbeat_at)).total_seconds()
        gone = sole_user or (row.host == host and row.pid is not None and not pid_alive(row.pid))
        if age < dead_after_s and not gone:
            s.rollback()
            raise InstanceNameInUse(
                f"instance name {name!r} is held by a live metald (host {row.host or '?'}, "
                f"last heartbeat {age:.1f} s ago): give each instance its own `instance` name, "
                f"or wait {dead_after_s - age:.0f} s if that process has died"
            )
    values: dict[str, Any] = dict(
        incarnation=incarnation,
        version=version,
        api_url=api_url,
        host=host,
        pid=pid,
        serves=serves,
        started_at=now,
        heartbeat_at=now,
        stopped_at=None,
    )
    if row is None:
        s.add(Instance(name=name, **values))
    else:
        for k, v in values.items():
            setattr(row, k, v)
    try:
        s.commit()
    except IntegrityError:  # another process registered the name in the same instant
        s.rollback()
        raise InstanceNameInUse(
            f"instance name {name!r} was registered by another process at the same time: "
            "give each instance its own `instance` name"
        ) from None


def pid_alive(pid: int) -> bool:
    """Whether a process with this id runs on this host. A reused id counts as alive: the
    name is then held until dead_after_s, the safe side."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def beat(s: Session, name: str, incarnation: str) -> bool:
    """Heartbeat. False when the row no longer belongs to this process (taken over after this
    process was judged dead): it must stop acting as the instance."""
    res = s.execute(
        update(Instance)
        .where(Instance.name == name, Instance.incarnation == incarnation)  # type: ignore[arg-type]
        .values(heartbeat_at=db_now(s), stopped_at=None)
    )
    s.commit()
    return bool(res.rowcount == 1)  # type: ignore[attr-defined]


def mark_stopped(s: Session, name: str, incarnation: str) -> None:
    s.execute(
        update(Instance)
        .where(Instance.name == name, Instance.incarnation == incarnation)  # type: ignore[arg-type]
        .values(stopped_at=db_now(s))
    )
    s.commit()


def members(s: Session, dead_after_s: float) -> list[Member]:
    """Every recorded instance, alive or not, by name."""
    now = db_now(s)
    rows = s.execute(select(Instance).order_by(Instance.name)).scalars().all()
    out = []
    for r in rows:
        age = max(0.0, (now - as_utc(r.heartbeat_at)).total_seconds())
        out.append(
            Member(
                name=r.name,
                alive=r.stopped_at is None and age < dead_after_s,
                heartbeat_age_s=round(age, 3),
                version=r.version,
                api_url=r.api_url,
                host=r.host,
                started_at=as_utc(r.started_at),
                serves=dict(r.serves or {}),
            )
        )
    return out
