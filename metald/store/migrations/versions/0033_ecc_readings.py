"""health: a node's correctable-ECC readings kept on its heartbeat row

Revision ID: 0033
Revises: 0032

Expand-only: one nullable column. ``node_heartbeats.ecc_readings`` holds, per GPU, the
correctable-ECC counts of the node's reports within ``[health] ecc_window_s``
(``metald.healthwatch.reports``), so that a storm (a rate over the window) is seen across
reports.
"""

import sqlalchemy as sa
from alembic import op

revision = "0033"
down_revision = "0032"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("node_heartbeats") as b:
        b.add_column(sa.Column("ecc_readings", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("node_heartbeats") as b:
        b.drop_column("ecc_readings")
