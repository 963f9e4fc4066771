"""images.tenants (empty: public) and machines.approved_at/approved_by (enroll.require_bmc)

Revision ID: 0013
Revises: 0012
"""

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("images", schema=None) as batch_op:
        batch_op.add_column(sa.Column("tenants", sa.JSON(), nullable=False, server_default="[]"))
    with op.batch_alter_table("machines", schema=None) as batch_op:
        batch_op.add_column(sa.Column("approved_at", sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(
            sa.Column("approved_by", sqlmodel.sql.sqltypes.AutoString(), nullable=True)
        )


def downgrade() -> None:
    with op.batch_alter_table("machines", schema=None) as batch_op:
        batch_op.drop_column("approved_by")
        batch_op.drop_column("approved_at")
    with op.batch_alter_table("images", schema=None) as batch_op:
        batch_op.drop_column("tenants")
