"""health: faults of machines in use, BMC log cursors, node heartbeats, remediations

Revision ID: 0025
Revises: 0024

Expand-only: four new tables for the Day-2 loop (docs/health.md). ``open_key`` and
``open_machine`` are NULL once a fault is cleared or a remediation done, so their unique
constraints hold one open row per key on SQLite and PostgreSQL alike (NULLs are distinct).
"""

import sqlalchemy as sa
from alembic import op

revision = "0025"
down_revision = "0024"
branch_labels = None
depends_on = None

_TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "health_faults",
        sa.Column("id", sa.String(), primary_key=True),
        sa.Column("machine_id", sa.String(), sa.ForeignKey("machines.id"), nullable=False),
        sa.Column("open_key", sa.String(), nullable=True),
        sa.Column("witness", sa.String(), nullable=False),
        sa.Column("kind", sa.String(), nullable=False),
        sa.Column("subject", sa.String(), nullable=False),
        sa.Column("code", sa.String(), nullable=False),
        sa.Column("severity", sa.String(), nullable=False),
        sa.Column("rule", sa.String(), nullable=False),
        sa.Column("why", sa.String(), nullable=False),
        sa.Column("part", sa.String(), nullable=False),
        sa.Column("evidence", sa.Text(), nullable=False),
        sa.Column("table_version", sa.String(), nullable=False),
        sa.Column("first_at", _TS, nullable=False),
        sa.Column("last_at", _TS, nullable=False),
        sa.Column("count", sa.Integer(), nullable=False),
        sa.Column("cleared_at", _TS, nullable=True),
        sa.Column("cleared_by", sa.String(), nullable=True),
        sa.UniqueConstraint("open_key", name="uq_health_faults_open_key"),
    )
    op.create_index(
        "ix_health_faults_machine_cleared", "health_faults", ["machine_id", "cleared_at"]
    )
    op.create_table(
        "bmc_log_cursors",
        sa.Column("bmc_id", sa.String(), sa.ForeignKey("bmcs.id"), primary_key=True),
        sa.Column("last_id", sa.String(), nullable=True),
        sa.Column("keys", sa.JSON(), nullable=False),
        sa.Column("entries", sa.Integer(), nullable=False),
        sa.Column("read_at", _TS, nullable=True),
        sa.Column("reader", sa.String(), nullable=True),
    )
    op.create_table(
        "node_heartbeats",
        sa.Column("machine_id", sa.String(), sa.ForeignKey("machines.id"), primary_key=True),
        sa.Column("claim_id", sa.String(), nullable=True),
        sa.Column("last_at", _TS, nullable=False),
        sa.Column("reports", sa.Integer(), nullable=False),
        sa.Column("unreadable", sa.JSON(), nullable=False),
    )
    op.create_table(
        "remediations",
        sa.Column("id", sa.String(), primary_key=True),
        sa.Column("machine_id", sa.String(), sa.ForeignKey("machines.id"), nullable=False),
        sa.Column("open_machine", sa.String(), nullable=True),
        sa.Column("claim_id", sa.String(), sa.ForeignKey("claims.id"), nullable=False),
        sa.Column("tenant_id", sa.String(), sa.ForeignKey("tenants.id"), nullable=False),
        sa.Column("rack", sa.String(), nullable=True),
        sa.Column("node", sa.String(), nullable=False),
        sa.Column("step", sa.String(), nullable=False),
        sa.Column("severity", sa.String(), nullable=False),
        sa.Column("evidence", sa.Text(), nullable=False),
        sa.Column("policy", sa.JSON(), nullable=False),
        sa.Column("drained_at", _TS, nullable=True),
        sa.Column("replacement_id", sa.String(), nullable=True),
        sa.Column("reason", sa.String(), nullable=False),
        sa.Column("owner", sa.String(), nullable=True),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("created_at", _TS, nullable=False),
        sa.Column("updated_at", _TS, nullable=False),
        sa.Column("done_at", _TS, nullable=True),
        sa.UniqueConstraint("open_machine", name="uq_remediations_open_machine"),
        sa.UniqueConstraint("replacement_id", name="uq_remediations_replacement"),
    )
    op.create_index("ix_remediations_machine_id", "remediations", ["machine_id"])
    op.create_index("ix_remediations_claim_id", "remediations", ["claim_id"])
    op.create_index("ix_remediations_tenant_id", "remediations", ["tenant_id"])
    op.create_index("ix_remediations_step", "remediations", ["step"])


def downgrade() -> None:
    op.drop_table("remediations")
    op.drop_table("node_heartbeats")
    op.drop_table("bmc_log_cursors")
    op.drop_index("ix_health_faults_machine_cleared", table_name="health_faults")
    op.drop_table("health_faults")
