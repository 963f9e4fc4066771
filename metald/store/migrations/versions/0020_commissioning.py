"""commissioning runs and their per-check results

Revision ID: 0020
Revises: 0019
"""

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None

_str = sqlmodel.sql.sqltypes.AutoString


def upgrade() -> None:
    op.create_table(
        "commissioning_runs",
        sa.Column("id", _str(), nullable=False),
        sa.Column("machine_id", _str(), nullable=False),
        sa.Column("profile", _str(), nullable=False),
        sa.Column("status", _str(), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("requested_by", _str(), nullable=False),
        sa.Column("summary", _str(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["machine_id"], ["machines.id"]),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_commissioning_runs_machine_id", "commissioning_runs", ["machine_id"])
    op.create_index("ix_commissioning_runs_status", "commissioning_runs", ["status"])
    op.create_table(
        "commissioning_results",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", _str(), nullable=False),
        sa.Column("check", _str(), nullable=False),
        sa.Column("status", _str(), nullable=False),
        sa.Column("agent_status", _str(), nullable=True),
        sa.Column("duration_s", sa.Float(), nullable=True),
        sa.Column("sentence", _str(), nullable=False),
        sa.Column("values", sa.JSON(), nullable=False),
        sa.Column("raw", sa.Text(), nullable=True),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["commissioning_runs.id"]),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("run_id", "check", name="uq_commissioning_result_check"),
    )
    op.create_index("ix_commissioning_results_run_id", "commissioning_results", ["run_id"])


def downgrade() -> None:
    op.drop_index("ix_commissioning_results_run_id", table_name="commissioning_results")
    op.drop_table("commissioning_results")
    op.drop_index("ix_commissioning_runs_status", table_name="commissioning_runs")
    op.drop_index("ix_commissioning_runs_machine_id", table_name="commissioning_runs")
    op.drop_table("commissioning_runs")
