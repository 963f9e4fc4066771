"""Whether a machine has a BMC, and whether any BMC waits to be linked: one Core read, in the
caller's transaction. The BMC registry links by identity with it (``registry.link_by_identity``)
and the inventory's use case asks it before it commits, so a power-on storm's machine (no BMC,
none unlinked) costs no BMC transaction of its own. Store only: no protocol, no driver."""

from __future__ import annotations

from sqlalchemy import bindparam, exists
from sqlalchemy import select as sa_select
from sqlmodel import Session

from metald.store.models import Bmc, Machine

_BMCS = Bmc.__table__  # type: ignore[attr-defined]
_MACHINES = Machine.__table__  # type: ignore[attr-defined]

LINK_PROBE = sa_select(
    _MACHINES.c.id,
    exists().where(_BMCS.c.machine_id == _MACHINES.c.id).label("linked"),
    exists().where(_BMCS.c.machine_id.is_(None)).label("unlinked"),
).where(_MACHINES.c.id == bindparam("m"))


def link_probe(s: Session, machine_id: str) -> tuple[bool, bool]:
    """(a BMC is linked to the machine, some BMC is unlinked at all); (False, False) for a
    machine that does not exist."""
    row = s.connection().execute(LINK_PROBE, {"m": machine_id}).first()
    return (bool(row.linked), bool(row.unlinked)) if row is not None else (False, False)
