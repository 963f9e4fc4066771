"""elastic_pools, elastic_quotas

A tenant's elastic pool: Slurm CLOUD nodes resumed into claims and suspended into releases
(docs/elastic.md).

Revision ID: 0038
Revises: 0037

Expand-only: two new tables.
"""

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision = "0038"
down_revision = "0037"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "elastic_pools",
        sa.Column("id", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("tenant_id", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("name", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("prefix", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("min_nodes", sa.Integer(), nullable=False),
        sa.Column("max_nodes", sa.Integer(), nullable=False),
        sa.Column("selector", sa.JSON(), nullable=False),
        sa.Column("image", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("suspend_time_s", sa.Integer(), nullable=False),
        sa.Column("resume_timeout_s", sa.Integer(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("created_by", sqlmodel.sql.sqltypes.AutoString(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"]),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("tenant_id", "name", name="uq_elastic_pools_tenant_name"),
        sa.UniqueConstraint("tenant_id", "prefix", name="uq_elastic_pools_tenant_prefix"),
    )
    op.create_index("ix_elastic_pools_tenant_id", "elastic_pools", ["tenant_id"])
    op.create_table(
        "elastic_quotas",
        sa.Column("tenant_id", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("max_machines", sa.Integer(), nullable=True),
        sa.Column("per_sku", sa.JSON(), nullable=False),
        sa.Column("updated_by", sqlmodel.sql.sqltypes.AutoString(), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"]),
        sa.PrimaryKeyConstraint("tenant_id"),
    )


def downgrade() -> None:
    op.drop_table("elastic_quotas")
    op.drop_index("ix_elastic_pools_tenant_id", table_name="elastic_pools")
    op.drop_table("elastic_pools")
