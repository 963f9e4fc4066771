"""wg_peers.last_endpoint: where the hub last saw each node

Revision ID: 0009
Revises: 0008
"""

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("wg_peers", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("last_endpoint", sqlmodel.sql.sqltypes.AutoString(), nullable=True)
        )


def downgrade() -> None:
    with op.batch_alter_table("wg_peers", schema=None) as batch_op:
        batch_op.drop_column("last_endpoint")
