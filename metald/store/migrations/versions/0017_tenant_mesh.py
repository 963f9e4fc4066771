"""tenant mesh (generation, node tokens, acks, registration address) and InfiniBand PKeys

Revision ID: 0017
Revises: 0016
"""

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("tenants", schema=None) as batch_op:
        batch_op.add_column(sa.Column("pkey", sa.Integer(), nullable=True))
        batch_op.add_column(
            sa.Column("mesh_generation", sa.Integer(), nullable=False, server_default="0")
        )
    op.create_index("ix_tenants_pkey", "tenants", ["pkey"], unique=True)
    with op.batch_alter_table("wg_peers", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("registered_from", sqlmodel.sql.sqltypes.AutoString(), nullable=True)
        )
        batch_op.add_column(
            sa.Column("node_token_hash", sqlmodel.sql.sqltypes.AutoString(), nullable=True)
        )
        batch_op.add_column(sa.Column("mesh_acked", sa.Integer(), nullable=True))
        batch_op.create_unique_constraint("uq_wg_peers_node_token_hash", ["node_token_hash"])


def downgrade() -> None:
    with op.batch_alter_table("wg_peers", schema=None) as batch_op:
        batch_op.drop_constraint("uq_wg_peers_node_token_hash", type_="unique")
        batch_op.drop_column("mesh_acked")
        batch_op.drop_column("node_token_hash")
        batch_op.drop_column("registered_from")
    op.drop_index("ix_tenants_pkey", table_name="tenants")
    with op.batch_alter_table("tenants", schema=None) as batch_op:
        batch_op.drop_column("mesh_generation")
        batch_op.drop_column("pkey")
