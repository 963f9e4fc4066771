"""commissioning_runs.sel_before: metald's reading of the BMC's event log before the checks

Revision ID: 0023
Revises: 0022

Expand-only: a nullable JSON column (the entries' keys, their count, when, or why the BMC
could not be read); runs from before it have none, which only matters to a run whose profile
has the ``bmc-sel`` check.
"""

import sqlalchemy as sa
from alembic import op

revision = "0023"
down_revision = "0022"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("commissioning_runs") as batch:
        batch.add_column(sa.Column("sel_before", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("commissioning_runs") as batch:
        batch.drop_column("sel_before")
