"""Name every unnamed machine (issue 31): after its rack position, else its serial number,
else a readable generated name; unique.

Revision ID: 0034
Revises: 0033

Data only: machines enlisted from now on are named by metald.machines.create_machine and
renamed after their serial by the inventory; this names those enlisted before.
"""

import re

import sqlalchemy as sa
from alembic import op

from metald.naming import generated_name, name_from_serial

revision = "0034"
down_revision = "0033"
branch_labels = None
depends_on = None


def _slug(text: str) -> str | None:
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-._")[:63].rstrip("-._")
    return slug or None


def upgrade() -> None:
    conn = op.get_bind()
    machines = sa.table(
        "machines",
        sa.column("id", sa.String),
        sa.column("name", sa.String),
        sa.column("rack", sa.String),
        sa.column("rack_position", sa.String),
        sa.column("serial", sa.String),
    )
    taken = {n for (n,) in conn.execute(sa.select(machines.c.name)) if n}
    unnamed = conn.execute(
        sa.select(machines.c.id, machines.c.rack, machines.c.rack_position, machines.c.serial)
        .where(machines.c.name.is_(None))
        .order_by(machines.c.id)
    ).all()
    for mid, rack, position, serial in unnamed:
        where = "-".join(p for p in (rack, position) if p)
        for candidate in (_slug(where) if position else None, name_from_serial(serial)):
            if candidate and candidate not in taken:
                name = candidate
                break
        else:
            name = generated_name(mid)
        taken.add(name)
        conn.execute(machines.update().where(machines.c.id == mid).values(name=name))


def downgrade() -> None:
    pass  # names given stay: nothing to undo
