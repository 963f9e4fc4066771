"""machine firmware versions and BIOS settings read through the BMC

Revision ID: 0019
Revises: 0018
"""

import sqlalchemy as sa
from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("machines", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("firmware_versions", sa.JSON(), nullable=False, server_default="{}")
        )
        batch_op.add_column(sa.Column("bios", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("machines", schema=None) as batch_op:
        batch_op.drop_column("bios")
        batch_op.drop_column("firmware_versions")
