"""commissioning_runs: an index on (machine_id, status) for a machine's open run

Revision ID: 0024
Revises: 0023

Every agent request of a commissioning machine looks up its open run by machine and status.
With only the single-column indexes SQLite's planner (no statistics) took the status index and
read every running run of the fleet per request (quadratic in a storm). Expand-only.
"""

from alembic import op

revision = "0024"
down_revision = "0023"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index(
        "ix_commissioning_runs_machine_status", "commissioning_runs", ["machine_id", "status"]
    )


def downgrade() -> None:
    op.drop_index("ix_commissioning_runs_machine_status", table_name="commissioning_runs")
