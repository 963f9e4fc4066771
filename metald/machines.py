"""Machine records and the one place that changes a machine's state.

Every function takes an open ``Session`` and commits what it does as one transaction: a state
change and its event row land together or not at all. State changes compare-and-swap on the
``version`` column, so of two writers racing on one machine exactly one wins and the other gets
``ConcurrentUpdate`` (a 409 at the API) with nothing written.
"""

from __future__ import annotations

import re
from typing import Any

from sqlalchemy import bindparam, func
from sqlalchemy import select as sa_select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import defer
from sqlalchemy.orm.attributes import set_committed_value
from sqlmodel import Session, select

from metald import metrics
from metald.arch import from_firmware
from metald.auth import revoke_machine_tokens
from metald.errors import Conflict, NotFound, Unprocessable
from metald.lifecycle import State, Trigger, boot_on_entry, check_guards, next_state, phase_of
from metald.macaddr import normalize_mac
from metald.naming import generated_name, name_from_serial
from metald.store.models import Event, Machine, Nic, as_utc, new_id, utcnow


class ConcurrentUpdate(Conflict):
    title = "Concurrent update"


def default_name(rack: str | None, rack_position: str | None) -> str | None:
    """A machine's name from where it sits (``r07-sw1-eth12`` from rack r07 and option 82's
    ``sw1/eth12``): letters, digits, dots, dashes and underscores, at most 63 characters."""
    where = "-".join(p for p in (rack, rack_position) if p)
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", where).strip("-._")[:63].rstrip("-._")
    return slug or None


def is_generated_name(m: Machine) -> bool:
    return m.name is None or m.name == generated_name(m.id)


def name_to_take(session: Session, m: Machine, serial: str | None) -> str | None:
    """The name a machine with a generated (or no) name should take now that its serial is
    known, if no machine carries it yet; None otherwise. On SQLite the read decides (one
    writer at a time); elsewhere ``take_name`` after the transition, in a savepoint."""
    if not is_generated_name(m):
        return None
    wanted = name_from_serial(serial)
    if wanted is None or wanted == m.name:
        return None
    if not _writes_serialized(session):
        return None
    taken = session.connection().execute(_NAME_TAKEN, {"name": wanted}).first()
    return None if taken is not None else wanted


def take_name(session: Session, m: Machine, serial: str | None) -> None:
    """``name_to_take`` for stores that do not serialize writes (PostgreSQL): the rename in a
    savepoint, so a machine that took the name meanwhile (two nodes of one chassis sharing its
    serial) leaves this one with its generated name instead of failing its inventory."""
    if _writes_serialized(session) or not is_generated_name(m):
        return
    wanted = name_from_serial(serial)
    if wanted is None or wanted == m.name:
        return
    try:
        with session.begin_nested():
            session.connection().execute(
                Machine.__table__.update()  # type: ignore[attr-defined]
                .where(Machine.__table__.c.id == m.id)  # type: ignore[attr-defined]
                .values(name=wanted)
            )
    except IntegrityError:
        return


def add_event(
    session: Session,
    kind: str,
    actor: str,
    *,
    machine_id: str | None = None,
    tenant_id: str | None = None,
    from_state: str | None = None,
    to_state: str | None = None,
    reason: str | None = None,
    data: dict[str, Any] | None = None,
    instance: str | None = None,
) -> None:
    """Append an event row in the session's transaction (a Core INSERT: events are never read
    back as objects where they are written, and the ORM's unit of work cost more than the row)."""
    session.connection().execute(
        _EVENT_INSERT,
        {
            "at": utcnow(),
            "kind": kind,
            "actor": actor,
            "machine_id": machine_id,
            "tenant_id": tenant_id,
            "from_state": from_state,
            "to_state": to_state,
            "reason": reason,
            "data": data,
            "instance": instance,
        },
    )


_EVENTS = Event.__table__  # type: ignore[attr-defined]
_EVENT_INSERT = _EVENTS.insert()
_NICS = Nic.__table__  # type: ignore[attr-defined]
_NIC_INSERT = _NICS.insert()
_NICS_BY_MAC = sa_select(_NICS.c.id, _NICS.c.mac, _NICS.c.machine_id).where(
    _NICS.c.mac.in_(bindparam("macs", expanding=True))
)
_NIC_UPDATE = (
    _NICS.update()
    .where(_NICS.c.id == bindparam("nic_id"))
    .values(
        name=bindparam("v_name"),
        driver=bindparam("v_driver"),
        speed_mbps=bindparam("v_speed_mbps"),
        link=bindparam("v_link"),
    )
)


#: The inventory document (~9 KB of JSON on a GPU server) is read only where it is used: the
#: machine reads on every request path leave it unloaded. Reading ``m.inventory`` inside the
#: session loads it; outside, SQLAlchemy raises DetachedInstanceError (never a silent None).
_NO_INVENTORY = (defer(Machine.inventory),)  # type: ignore[arg-type]


def get_machine(session: Session, machine_id: str) -> Machine:
    # populate_existing: always read the row as stored now, never a stale identity-map copy.
    # One statement built once (as _BY_MAC): Session.get builds and keys a new one per call,
    # about half of this function's cost, and it runs several times per machine in a storm.
    m = session.exec(_BY_ID, params={"id": machine_id}).first()  # type: ignore[call-overload]
    if m is None:
        raise NotFound(f"no machine with id {machine_id!r}")
    return m


def find_by_mac(session: Session, mac: str) -> Machine | None:
    return session.exec(_BY_MAC, params={"mac": normalize_mac(mac)}).first()  # type: ignore[call-overload]


_BY_ID = (
    select(Machine)
    .where(Machine.id == bindparam("id"))
    .options(*_NO_INVENTORY)
    .execution_options(populate_existing=True)
)

_BY_MAC = (
    select(Machine)
    .join(Nic, Nic.machine_id == Machine.id)  # type: ignore[arg-type]
    .where(Nic.mac == bindparam("mac"))
    .options(*_NO_INVENTORY)
    .execution_options(populate_existing=True)
)

_NAME_TAKEN = (
    sa_select(Machine.__table__.c.id)
    .where(  # type: ignore[attr-defined]
        Machine.__table__.c.name == bindparam("name")  # type: ignore[attr-defined]
    )
    .limit(1)
)


def _writes_serialized(session: Session) -> bool:
    """Whether the store serializes write transactions (SQLite's BEGIN IMMEDIATE)."""
    return session.get_bind().dialect.name == "sqlite"


def create_machine(
    session: Session,
    *,
    macs: list[str],
    actor: str,
    name: str | None = None,
    labels: dict[str, str] | None = None,
    rack: str | None = None,
    rack_position: str | None = None,
    firmware: str | None = None,
    reason: str = "registered",
    instance: str | None = None,
    commit: bool = True,
) -> Machine:
    """A new machine in ``discovered``, with its NICs. Refuses MACs or names already known."""
    mid = insert_machine(
        session,
        macs=macs,
        actor=actor,
        name=name,
        labels=labels,
        rack=rack,
        rack_position=rack_position,
        firmware=firmware,
        reason=reason,
        instance=instance,
    )
    m = get_machine(session, mid)
    if commit:
        session.commit()
    return m


def insert_machine(
    session: Session,
    *,
    macs: list[str],
    actor: str,
    name: str | None = None,
    labels: dict[str, str] | None = None,
    rack: str | None = None,
    rack_position: str | None = None,
    firmware: str | None = None,
    reason: str = "registered",
    instance: str | None = None,
    macs_unknown: bool = False,
) -> str:
    """``create_machine`` without loading the new row (no commit): its id. Core INSERTs, not
    the ORM's unit of work (a DHCP sighting in a power-on storm creates every machine here, and
    building and flushing a 40-column ``Machine`` object was about half of that transaction's
    cost). ``macs_unknown``: the caller just read, in this transaction, that no machine has
    these MACs (``sighting_by_mac``), so they are not looked up again; the unique index on
    ``nics.mac`` still refuses a MAC another writer added meanwhile."""
    norm = [normalize_mac(m) for m in macs]
    if len(set(norm)) != len(norm):
        raise Unprocessable("the same MAC address is listed twice")
    conn = session.connection()
    if norm and not macs_unknown:
        taken = conn.execute(_NICS_BY_MAC, {"macs": norm}).all()
        if taken:
            raise Conflict(
                f"MAC {taken[0].mac} already belongs to machine {taken[0].machine_id}",
                machine_id=taken[0].machine_id,
            )
    if name and conn.execute(_NAME_TAKEN, {"name": name}).first() is not None:
        raise Conflict(f"a machine named {name!r} already exists")
    default = default_name(rack, rack_position) if name is None else None

    mid = new_id()
    now = utcnow()
    row: dict[str, Any] = {
        "id": mid,
        "name": name if name is not None else generated_name(mid),
        "state": State.DISCOVERED.value,
        "version": 1,
        "labels": dict(labels or {}),
        "rack": rack,
        "rack_position": rack_position,
        "firmware": firmware,
        "arch": from_firmware(firmware),
        "gpu_count": 0,
        # As the ORM writes them: JSON's null (not SQL NULL) in the JSON columns left empty.
        "inventory": None,
        "bios": None,
        "secure_boot": None,
        "boot_intent": None,
        "firmware_versions": {},
        "wipe_required": False,
        "nvlink_ready": False,
        "state_changed_at": now,
        "created_at": now,
        "updated_at": now,
    }

    # Named after where it sits, unless a machine already carries that name (the unique
    # index says so: no SELECT first, which every enrollment of a storm paid for the rare
    # replaced machine). Two machines enrolling at once behind one switch port (several
    # instances, or a flood) may both pick it: the loser gets a generated name instead of
    # failing. Without a rack position: a generated name (``generated_name``), replaced by
    # its serial once the inventory gives one (``better_name``).
    if default and _writes_serialized(session):
        # SQLite: the store's write transactions begin IMMEDIATE (one writer at a time), so
        # nobody can take the name between this read and the insert; one indexed read is
        # cheaper than a savepoint (two statements and SQLAlchemy's nested-transaction work).
        if conn.execute(_NAME_TAKEN, {"name": default}).first() is None:
            row["name"] = default
        conn.execute(_MACHINE_INSERT, row)
    elif default:
        try:
            with session.begin_nested():  # its SAVEPOINT goes out with the next connection()
                session.connection().execute(_MACHINE_INSERT, {**row, "name": default})
        except IntegrityError:
            conn.execute(_MACHINE_INSERT, row)
    else:
        conn.execute(_MACHINE_INSERT, row)
    if norm:
        conn.execute(
            _NIC_INSERT,
            [
                {
                    "id": new_id(),
                    "machine_id": mid,
                    "mac": mac,
                    "name": None,
                    "driver": None,
                    "speed_mbps": None,
                    "link": None,
                    "pxe": i == 0,
                }
                for i, mac in enumerate(norm)
            ],
        )
    add_event(
        session,
        "machine.created",
        actor,
        machine_id=mid,
        to_state=State.DISCOVERED.value,
        reason=reason,
        data={"macs": norm},
        instance=instance,
    )
    return mid


_MACHINE_INSERT = Machine.__table__.insert()  # type: ignore[attr-defined]

#: What a DHCP sighting needs of the machine that has a MAC: a Core read of four columns.
_SIGHTING = (
    sa_select(
        Machine.__table__.c.id,  # type: ignore[attr-defined]
        Machine.__table__.c.rack_position,  # type: ignore[attr-defined]
        Machine.__table__.c.firmware,  # type: ignore[attr-defined]
        Machine.__table__.c.arch,  # type: ignore[attr-defined]
    )
    .join_from(
        Machine.__table__,  # type: ignore[attr-defined]
        _NICS,
        _NICS.c.machine_id == Machine.__table__.c.id,  # type: ignore[attr-defined]
    )
    .where(_NICS.c.mac == bindparam("mac"))
)


def sighting_by_mac(session: Session, mac: str) -> Any:
    """The id, rack position, firmware and arch of the machine with this MAC (a row), or
    None: ``find_by_mac`` for the DHCP sighting, without loading a ``Machine``."""
    return session.connection().execute(_SIGHTING, {"mac": normalize_mac(mac)}).first()


def sync_nics(session: Session, machine_id: str, nics: list[Any]) -> None:
    """Record what an inventory says of the machine's NICs (name, driver, speed, link); a NIC
    seen for the first time is added. A MAC that belongs to another machine is left alone (an
    event would be noise on every boot). No commit."""
    conn = session.connection()
    macs = [normalize_mac(x.mac) for x in nics]
    known = {r.mac: r for r in conn.execute(_NICS_BY_MAC, {"macs": macs})}
    for mac, nic in zip(macs, nics, strict=True):
        row = known.get(mac)
        if row is not None and row.machine_id != machine_id:
            continue
        values = {"name": nic.name, "driver": nic.driver, "speed_mbps": nic.speed_mbps}
        values["link"] = nic.link
        if row is None:
            conn.execute(
                _NIC_INSERT,
                {"id": new_id(), "machine_id": machine_id, "mac": mac, "pxe": False, **values},
            )
        else:
            conn.execute(
                _NIC_UPDATE, {"nic_id": row.id, **{f"v_{k}": v for k, v in values.items()}}
            )


def transition(
    session: Session,
    machine_id: str,
    trigger: Trigger | str,
    *,
    actor: str,
    reason: str | None = None,
    data: dict[str, Any] | None = None,
    expected_version: int | None = None,
    updates: dict[str, Any] | None = None,
    instance: str | None = None,
    commit: bool = True,
    machine: Machine | None = None,
) -> Machine:
    """Apply ``trigger`` to the machine, with its event, atomically.

    ``expected_version`` makes the caller's read part of the check (optimistic concurrency);
    without it the version just read here is used. ``updates`` are further column changes that
    belong to the same transition (tenant, boot intent, last error ...). ``machine`` is the row
    as the caller just read it in this session (saves reading it again); the compare-and-swap
    on its version still refuses it if anyone changed the row since.
    """
    m = machine if machine is not None else get_machine(session, machine_id)
    version = m.version if expected_version is None else expected_version
    if m.version != version:
        raise ConcurrentUpdate(
            f"machine {machine_id} changed since it was read (version {version}, now {m.version}); "
            "read it again and retry"
        )
    src = State(m.state)
    dst = next_state(src, trigger)
    check_guards(
        src, trigger, tenant_attached=m.tenant_id is not None, wipe_owed=bool(m.wipe_required)
    )
    now = utcnow()
    entered = m.state_changed_at
    values: dict[str, Any] = {
        "state": dst.value,
        "version": version + 1,
        "state_changed_at": now,
        "updated_at": now,
        **boot_on_entry(dst, new_id),
    }
    values.update(updates or {})
    if phase_of(src) != phase_of(dst):
        # An agent token works in the phase it was minted for only (metald.lifecycle.PHASES).
        revoke_machine_tokens(session, machine_id, commit=False)
    result = _cas_update(session, machine_id, version, values)
    if result.rowcount != 1:  # type: ignore[attr-defined]
        session.rollback()
        raise ConcurrentUpdate(
            f"machine {machine_id} was changed by another writer at the same time; "
            "read it again and retry"
        )
    add_event(
        session,
        "machine.state",
        actor,
        machine_id=machine_id,
        tenant_id=values.get("tenant_id", m.tenant_id),
        from_state=src.value,
        to_state=dst.value,
        reason=reason or Trigger(trigger).value,
        data={"trigger": Trigger(trigger).value, **(data or {})},
        instance=instance,
    )
    if commit:
        session.commit()
    _set_committed(m, values)
    metrics.observe_phase(src.value, dst.value, (now - as_utc(entered)).total_seconds())
    return m


def _cas_update(session: Session, machine_id: str, version: int, values: dict[str, Any]) -> Any:
    """UPDATE the row only if its version is still ``version`` (Core: no ORM bookkeeping; the
    SET clause comes from the parameters' keys, so each set of columns compiles once)."""
    return session.connection().execute(
        _CAS, {**values, "cas_id": machine_id, "cas_version": version}
    )


_MACHINES = Machine.__table__  # type: ignore[attr-defined]
_CAS = _MACHINES.update().where(
    _MACHINES.c.id == bindparam("cas_id"), _MACHINES.c.version == bindparam("cas_version")
)


def _set_committed(m: Machine, values: dict[str, Any]) -> None:
    """Put what was just written into the loaded object, as if read back (no second SELECT)."""
    for key, value in values.items():
        set_committed_value(m, key, value)


def update_fields(
    session: Session,
    machine_id: str,
    *,
    actor: str,
    kind: str,
    values: dict[str, Any],
    expected_version: int | None = None,
    data: dict[str, Any] | None = None,
    instance: str | None = None,
) -> Machine:
    """Change non-state columns (labels, inventory ...) with an event, compare-and-swap."""
    m = get_machine(session, machine_id)
    version = m.version if expected_version is None else expected_version
    values = {**values, "version": version + 1, "updated_at": utcnow()}
    try:
        res = _cas_update(session, machine_id, version, values)
        if res.rowcount != 1:  # type: ignore[attr-defined]
            session.rollback()
            raise ConcurrentUpdate(
                f"machine {machine_id} changed since it was read; read it again and retry"
            )
        add_event(
            session,
            kind,
            actor,
            machine_id=machine_id,
            tenant_id=m.tenant_id,
            data=data,
            instance=instance,
        )
        session.commit()
    except IntegrityError:  # a unique column (the name) taken by a commit after the caller's check
        session.rollback()
        what = f"the name {values['name']!r}" if "name" in values else "a unique value"
        raise Conflict(
            f"another machine took {what} at the same moment; pick another name and retry"
        ) from None
    _set_committed(m, values)
    return m


def count_by_state(session: Session) -> dict[str, int]:
    rows = session.exec(select(Machine.state, func.count()).group_by(Machine.state)).all()
    return {state: n for state, n in rows}
