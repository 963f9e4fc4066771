"""tenant VLAN id (for switch automation)

Revision ID: 0008
Revises: 0007
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("tenants", schema=None) as batch_op:
        batch_op.add_column(sa.Column("vlan", sa.Integer(), nullable=True))
    op.create_index("ix_tenants_vlan", "tenants", ["vlan"], unique=True)


def downgrade() -> None:
    op.drop_index("ix_tenants_vlan", table_name="tenants")
    with op.batch_alter_table("tenants", schema=None) as batch_op:
        batch_op.drop_column("vlan")
