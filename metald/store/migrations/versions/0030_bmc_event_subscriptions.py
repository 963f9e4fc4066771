"""Redfish EventService subscriptions metald holds on BMCs (pushed log entries)

Revision ID: 0030
Revises: 0029

Expand-only: one new table.
"""

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision = "0030"
down_revision = "0029"
branch_labels = None
depends_on = None

_str = sqlmodel.sql.sqltypes.AutoString


def upgrade() -> None:
    op.create_table(
        "bmc_event_subscriptions",
        sa.Column("bmc_id", _str(), nullable=False),
        sa.Column("secret_hash", _str(), nullable=False),
        sa.Column("uri", _str(), nullable=True),
        sa.Column("owner", _str(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("event_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("events", sa.Integer(), nullable=False),
        sa.Column("keys", sa.JSON(), nullable=False),
        sa.ForeignKeyConstraint(["bmc_id"], ["bmcs.id"]),
        sa.PrimaryKeyConstraint("bmc_id"),
    )


def downgrade() -> None:
    op.drop_table("bmc_event_subscriptions")
