"""The audit trail as the API reads it: pages in delivery (commit) order or newest first,
and what a live stream needs to catch up from the store. An orchestrator sees its tenants'
events only (and a machine filter naming another tenant's machine is a 404)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

from sqlmodel import Session, col

from metald.auth import Principal, Role
from metald.errors import NotFound
from metald.events import Position, final_events, position, position_of, read_events
from metald.store.models import Event, Machine
from metald.usecases import Transactions


class EventFilter(Protocol):
    """What an event list or stream is narrowed by (``api.schemas.EventQuery``)."""

    machine_id: str | None
    kind: str | None
    #: Only events recorded at or after this time.
    since: datetime | None
    #: "id": delivery order; "-id": the newest first.
    sort: str


def event_view(ev: Event) -> dict[str, Any]:
    return ev.model_dump()


def _filters(p: Principal, f: EventFilter) -> list[Any]:
    where: list[Any] = []
    if f.machine_id:
        where.append(col(Event.machine_id) == f.machine_id)
    if f.kind:
        where.append(col(Event.kind) == f.kind)
    if f.since is not None:
        where.append(col(Event.at) >= f.since)
    if p.role is Role.ORCHESTRATOR:
        where.append(col(Event.tenant_id).in_(sorted(p.scope)))
    return where


def matches(p: Principal, f: EventFilter, ev: Any) -> bool:
    """Whether a live event (from the bus) is one the caller's filtered stream shows."""
    if f.machine_id and ev.machine_id != f.machine_id:
        return False
    if f.kind and ev.kind != f.kind:
        return False
    if f.since is not None and _aware(ev.at) < f.since:
        return False
    return p.role is not Role.ORCHESTRATOR or ev.tenant_id in p.scope


def _aware(at: datetime) -> datetime:
    return at if at.tzinfo is not None else at.replace(tzinfo=UTC)


def _check_machine_scope(s: Session, p: Principal, machine_id: str | None) -> None:
    if machine_id and p.role is Role.ORCHESTRATOR:
        m = s.get(Machine, machine_id)
        if m is None or not p.can_see_machine(m.id, m.tenant_id):
            raise NotFound(f"no machine with id {machine_id!r}")


def _catch_up(
    s: Session, p: Principal, f: EventFilter, after: Position, limit: int
) -> tuple[list[dict[str, Any]], Position]:
    rows, cursor = read_events(s, after, limit, _filters(p, f))
    return [event_view(r) for r in rows], cursor


@dataclass
class Events:
    store: Transactions

    async def page(
        self, p: Principal, f: EventFilter, after: int, limit: int
    ) -> tuple[list[dict[str, Any]], int]:
        """A page in delivery order after event ``after``, or with ``sort=-id`` the newest
        events, newest first; and ``next_after`` (the last event's id: the cursor of the next
        page). Only events whose transaction and every older one has finished are listed
        (metald.events): a later page never holds one that sorts before this one's cursor."""

        def run(s: Session) -> tuple[list[dict[str, Any]], int]:
            _check_machine_scope(s, p, f.machine_id)
            if f.sort == "-id":
                rows = final_events(s, position_of(s, after), limit, _filters(p, f))
                last = max(rows, key=position, default=None)
            else:
                rows, _ = read_events(s, position_of(s, after), limit, _filters(p, f))
                last = rows[-1] if rows else None
            return [event_view(r) for r in rows], last.id if last and last.id else after

        return await self.store.run(run)

    async def stream_start(self, p: Principal, f: EventFilter, after: int) -> Position:
        """Where a stream resuming after event ``after`` starts (its filter checked)."""

        def start(s: Session) -> Position:
            _check_machine_scope(s, p, f.machine_id)
            return position_of(s, after)

        return await self.store.read(start)

    async def catch_up(
        self, p: Principal, f: EventFilter, after: Position, limit: int
    ) -> tuple[list[dict[str, Any]], Position]:
        """The caller's events after ``after`` and the position up to which it has seen all."""
        return await self.store.read(_catch_up, p, f, after, limit)
