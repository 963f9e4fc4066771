"""repairs: the technicians' repair queue

Revision ID: 0026
Revises: 0025

One row per repair of a machine (``metald.repairs``). ``open_machine_id`` carries the
machine's id while the repair is open and is unique, so one machine has one open repair.
Expand-only: a new table.
"""

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision = "0026"
down_revision = "0025"
branch_labels = None
depends_on = None

_str = sqlmodel.sql.sqltypes.AutoString


def upgrade() -> None:
    op.create_table(
        "repairs",
        sa.Column("id", _str(), nullable=False),
        sa.Column("machine_id", _str(), nullable=False),
        sa.Column("open_machine_id", _str(), nullable=True),
        sa.Column("status", _str(), nullable=False),
        sa.Column("source", _str(), nullable=False),
        sa.Column("remediation_id", _str(), nullable=True),
        sa.Column("opened_by", _str(), nullable=False),
        sa.Column("opened_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("summary", _str(), nullable=False),
        sa.Column("faults", sa.JSON(), nullable=False),
        sa.Column("parts", sa.JSON(), nullable=False),
        sa.Column("taken_by", _str(), nullable=True),
        sa.Column("taken_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("notes", sa.JSON(), nullable=False),
        sa.Column("repaired_by", _str(), nullable=True),
        sa.Column("repaired_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("commission_failures", sa.Integer(), nullable=False),
        sa.Column("closed_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("outcome", _str(), nullable=True),
        sa.Column("outcome_reason", _str(), nullable=True),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(["machine_id"], ["machines.id"]),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("open_machine_id"),
        sa.UniqueConstraint("remediation_id"),
    )
    op.create_index("ix_repairs_machine_id", "repairs", ["machine_id"])
    op.create_index("ix_repairs_status", "repairs", ["status"])


def downgrade() -> None:
    op.drop_index("ix_repairs_status", table_name="repairs")
    op.drop_index("ix_repairs_machine_id", table_name="repairs")
    op.drop_table("repairs")
