"""machines.secure_boot: UEFI Secure Boot as the machine's BMC last reported it

Revision ID: 0039
Revises: 0038

Expand-only: one new nullable JSON column, filled in at the next read through the BMC.
"""

import sqlalchemy as sa
from alembic import op

revision = "0039"
down_revision = "0038"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("machines", schema=None) as batch_op:
        batch_op.add_column(sa.Column("secure_boot", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("machines", schema=None) as batch_op:
        batch_op.drop_column("secure_boot")
