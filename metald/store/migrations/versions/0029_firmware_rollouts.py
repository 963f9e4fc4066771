"""firmware rollouts (waves across the fleet with a failure budget) and their targets

Revision ID: 0029
Revises: 0028

Expand-only: two new tables.
"""

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision = "0029"
down_revision = "0028"
branch_labels = None
depends_on = None

_str = sqlmodel.sql.sqltypes.AutoString


def upgrade() -> None:
    op.create_table(
        "firmware_rollouts",
        sa.Column("id", _str(), nullable=False),
        sa.Column("profile", _str(), nullable=False),
        sa.Column("baseline_version", sa.Integer(), nullable=False),
        sa.Column("selector", sa.JSON(), nullable=False),
        sa.Column("batch_size", sa.Integer(), nullable=False),
        sa.Column("max_unavailable", sa.Integer(), nullable=False),
        sa.Column("failure_budget", sa.Integer(), nullable=False),
        sa.Column("in_use", _str(), nullable=False),
        sa.Column("state", _str(), nullable=False),
        sa.Column("reason", _str(), nullable=True),
        sa.Column("owner", _str(), nullable=True),
        sa.Column("lease_until", sa.DateTime(timezone=True), nullable=True),
        sa.Column("created_by", _str(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_firmware_rollouts_profile", "firmware_rollouts", ["profile"])
    op.create_index("ix_firmware_rollouts_state", "firmware_rollouts", ["state"])
    op.create_index("ix_firmware_rollouts_finished_at", "firmware_rollouts", ["finished_at"])
    op.create_table(
        "firmware_rollout_targets",
        sa.Column("rollout_id", _str(), nullable=False),
        sa.Column("machine_id", _str(), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("status", _str(), nullable=False),
        sa.Column("wave", sa.Integer(), nullable=True),
        sa.Column("prior_state", _str(), nullable=True),
        sa.Column("error", _str(), nullable=True),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["rollout_id"], ["firmware_rollouts.id"]),
        sa.PrimaryKeyConstraint("rollout_id", "machine_id"),
    )
    op.create_index(
        "ix_firmware_rollout_targets_machine_id", "firmware_rollout_targets", ["machine_id"]
    )


def downgrade() -> None:
    op.drop_index("ix_firmware_rollout_targets_machine_id", table_name="firmware_rollout_targets")
    op.drop_table("firmware_rollout_targets")
    op.drop_index("ix_firmware_rollouts_finished_at", table_name="firmware_rollouts")
    op.drop_index("ix_firmware_rollouts_state", table_name="firmware_rollouts")
    op.drop_index("ix_firmware_rollouts_profile", table_name="firmware_rollouts")
    op.drop_table("firmware_rollouts")
