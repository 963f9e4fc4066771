"""Tenant OS: user-data per claim or machine, network and storage requests, static addresses

Revision ID: 0032
Revises: 0031

Expand-only: two nullable columns on claims, two new tables.
"""

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision = "0032"
down_revision = "0031"
branch_labels = None
depends_on = None

_str = sqlmodel.sql.sqltypes.AutoString


def upgrade() -> None:
    with op.batch_alter_table("claims") as b:
        b.add_column(sa.Column("network", sa.JSON(), nullable=True))
        b.add_column(sa.Column("storage", sa.JSON(), nullable=True))
    op.create_table(
        "claim_user_data",
        sa.Column("id", _str(), nullable=False),
        sa.Column("claim_id", _str(), nullable=False),
        sa.Column("machine_id", _str(), nullable=True),
        sa.Column("user_data", sa.Text(), nullable=True),
        sa.Column("meta_data", sa.JSON(), nullable=False),
        sa.Column("sha256", _str(), nullable=True),
        sa.Column("form", _str(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["claim_id"], ["claims.id"]),
        sa.ForeignKeyConstraint(["machine_id"], ["machines.id"]),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_claim_user_data_claim_id", "claim_user_data", ["claim_id"])
    op.create_table(
        "ip_allocations",
        sa.Column("network", _str(), nullable=False),
        sa.Column("address", _str(), nullable=False),
        sa.Column("claim_id", _str(), nullable=False),
        sa.Column("machine_id", _str(), nullable=False),
        sa.Column("interface", _str(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["claim_id"], ["claims.id"]),
        sa.ForeignKeyConstraint(["machine_id"], ["machines.id"]),
        sa.PrimaryKeyConstraint("network", "address"),
    )
    op.create_index("ix_ip_allocations_claim_id", "ip_allocations", ["claim_id"])
    op.create_index("ix_ip_allocations_machine_id", "ip_allocations", ["machine_id"])


def downgrade() -> None:
    op.drop_table("ip_allocations")
    op.drop_table("claim_user_data")
    with op.batch_alter_table("claims") as b:
        b.drop_column("storage")
        b.drop_column("network")
