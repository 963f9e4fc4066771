"""tenancy: WireGuard hubs and peers, one-time join tokens

Revision ID: 0007
Revises: 0006
"""

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

_str = sqlmodel.sql.sqltypes.AutoString


def upgrade() -> None:
    op.create_table(
        "wg_hubs",
        sa.Column("id", _str(), nullable=False),
        sa.Column("tenant_id", _str(), nullable=False),
        sa.Column("ifname", _str(), nullable=False),
        sa.Column("public_key", _str(), nullable=False),
        sa.Column("private_key_enc", sa.LargeBinary(), nullable=False),
        sa.Column("endpoint", _str(), nullable=False),
        sa.Column("listen_port", sa.Integer(), nullable=False),
        sa.Column("address", _str(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"]),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("tenant_id"),
        sa.UniqueConstraint("ifname"),
    )
    op.create_table(
        "wg_peers",
        sa.Column("id", _str(), nullable=False),
        sa.Column("tenant_id", _str(), nullable=False),
        sa.Column("machine_id", _str(), nullable=False),
        sa.Column("public_key", _str(), nullable=False),
        sa.Column("address", _str(), nullable=False),
        sa.Column("last_handshake_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["machine_id"], ["machines.id"]),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"]),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("machine_id"),
        sa.UniqueConstraint("public_key"),
        sa.UniqueConstraint("tenant_id", "address", name="uq_wg_peers_tenant_address"),
    )
    op.create_index("ix_wg_peers_tenant_id", "wg_peers", ["tenant_id"])
    op.create_table(
        "join_tokens",
        sa.Column("id", _str(), nullable=False),
        sa.Column("token_hash", _str(), nullable=False),
        sa.Column("machine_id", _str(), nullable=False),
        sa.Column("tenant_id", _str(), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("used_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("created_by", _str(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["machine_id"], ["machines.id"]),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"]),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("token_hash"),
    )
    op.create_index("ix_join_tokens_machine_id", "join_tokens", ["machine_id"])
    op.create_index("ix_join_tokens_tenant_id", "join_tokens", ["tenant_id"])


def downgrade() -> None:
    op.drop_index("ix_join_tokens_tenant_id", table_name="join_tokens")
    op.drop_index("ix_join_tokens_machine_id", table_name="join_tokens")
    op.drop_table("join_tokens")
    op.drop_index("ix_wg_peers_tenant_id", table_name="wg_peers")
    op.drop_table("wg_peers")
    op.drop_table("wg_hubs")
