"""firmware baselines (per SKU profile, versioned) and firmware updates (journaled steps)

Revision ID: 0027
Revises: 0026

Expand-only: two new tables.
"""

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision = "0027"
down_revision = "0026"
branch_labels = None
depends_on = None

_str = sqlmodel.sql.sqltypes.AutoString


def upgrade() -> None:
    op.create_table(
        "firmware_baselines",
        sa.Column("id", _str(), nullable=False),
        sa.Column("profile", _str(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("components", sa.JSON(), nullable=False),
        sa.Column("note", _str(), nullable=True),
        sa.Column("created_by", _str(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("profile", "version", name="uq_firmware_baseline_version"),
    )
    op.create_index("ix_firmware_baselines_profile", "firmware_baselines", ["profile"])
    op.create_table(
        "firmware_updates",
        sa.Column("id", _str(), nullable=False),
        sa.Column("machine_id", _str(), nullable=False),
        sa.Column("bmc_id", _str(), nullable=False),
        sa.Column("profile", _str(), nullable=False),
        sa.Column("baseline_version", sa.Integer(), nullable=False),
        sa.Column("component", _str(), nullable=False),
        sa.Column("item", _str(), nullable=False),
        sa.Column("version_before", _str(), nullable=True),
        sa.Column("version", _str(), nullable=False),
        sa.Column("sha256", _str(), nullable=False),
        sa.Column("apply", _str(), nullable=False),
        sa.Column("transfer", _str(), nullable=True),
        sa.Column("phase", _str(), nullable=False),
        sa.Column("task_uri", _str(), nullable=True),
        sa.Column("percent", sa.Integer(), nullable=True),
        sa.Column("journal", sa.JSON(), nullable=False),
        sa.Column("error", _str(), nullable=True),
        sa.Column("requested_by", _str(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["machine_id"], ["machines.id"]),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_firmware_updates_machine_id", "firmware_updates", ["machine_id"])
    op.create_index("ix_firmware_updates_bmc_id", "firmware_updates", ["bmc_id"])
    op.create_index("ix_firmware_updates_phase", "firmware_updates", ["phase"])
    op.create_index(
        "ix_firmware_updates_machine_phase", "firmware_updates", ["machine_id", "phase"]
    )


def downgrade() -> None:
    op.drop_index("ix_firmware_updates_machine_phase", table_name="firmware_updates")
    op.drop_index("ix_firmware_updates_phase", table_name="firmware_updates")
    op.drop_index("ix_firmware_updates_bmc_id", table_name="firmware_updates")
    op.drop_index("ix_firmware_updates_machine_id", table_name="firmware_updates")
    op.drop_table("firmware_updates")
    op.drop_index("ix_firmware_baselines_profile", table_name="firmware_baselines")
    op.drop_table("firmware_baselines")
