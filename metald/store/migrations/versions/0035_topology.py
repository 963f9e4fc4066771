"""Topology: a machine's NVLink domain, InfiniBand leaf and power domain; a claim's placement;
the InfiniBand links (host port GUID -> leaf switch) from the fabric's discovery

Revision ID: 0035
Revises: 0034

Expand-only: nullable columns (nvlink_ready defaults to false) and one new table.
"""

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision = "0035"
down_revision = "0034"
branch_labels = None
depends_on = None

_str = sqlmodel.sql.sqltypes.AutoString


def upgrade() -> None:
    with op.batch_alter_table("machines") as b:
        b.add_column(sa.Column("nvlink_domain", _str(), nullable=True))
        b.add_column(
            sa.Column("nvlink_ready", sa.Boolean(), nullable=False, server_default=sa.false())
        )
        b.add_column(sa.Column("ib_leaf", _str(), nullable=True))
        b.add_column(sa.Column("power_domain", _str(), nullable=True))
        b.create_index("ix_machines_nvlink_domain", ["nvlink_domain"])
        b.create_index("ix_machines_ib_leaf", ["ib_leaf"])
        b.create_index("ix_machines_power_domain", ["power_domain"])
    with op.batch_alter_table("claims") as b:
        b.add_column(sa.Column("placement", sa.JSON(), nullable=True))
    op.create_table(
        "ib_links",
        sa.Column("port_guid", _str(), nullable=False),
        sa.Column("switch_guid", _str(), nullable=False),
        sa.Column("switch_name", _str(), nullable=True),
        sa.Column("switch_port", sa.Integer(), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("port_guid"),
    )


def downgrade() -> None:
    op.drop_table("ib_links")
    with op.batch_alter_table("claims") as b:
        b.drop_column("placement")
    with op.batch_alter_table("machines") as b:
        b.drop_index("ix_machines_power_domain")
        b.drop_index("ix_machines_ib_leaf")
        b.drop_index("ix_machines_nvlink_domain")
        b.drop_column("power_domain")
        b.drop_column("ib_leaf")
        b.drop_column("nvlink_ready")
        b.drop_column("nvlink_domain")
