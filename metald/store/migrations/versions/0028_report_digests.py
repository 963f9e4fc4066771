"""health: the node report's GPU digest on its heartbeat row

Revision ID: 0028
Revises: 0027

Expand-only: one nullable column. ``node_heartbeats.digests`` holds what the last fully read
report of a machine left to compare with (``metald.healthwatch.reports``): a report whose
nvidia-smi part says the same as one found clean is not parsed again.
"""

import sqlalchemy as sa
from alembic import op

revision = "0028"
down_revision = "0027"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("node_heartbeats") as b:
        b.add_column(sa.Column("digests", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("node_heartbeats") as b:
        b.drop_column("digests")
