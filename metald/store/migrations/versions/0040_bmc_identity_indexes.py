"""bmcs: indexes on lower(system_uuid) and serial, which link a machine's first inventory to
its BMC

Revision ID: 0040
Revises: 0039

Expand-only: two new indexes. Without them every inventory scanned every unlinked BMC row
(bench/fleet.py at 10,000 BMCs registered ahead of their machines).
"""

import sqlalchemy as sa
from alembic import op

revision = "0040"
down_revision = "0039"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_bmcs_system_uuid_lower", "bmcs", [sa.text("lower(system_uuid)")])
    op.create_index("ix_bmcs_serial", "bmcs", ["serial"])


def downgrade() -> None:
    op.drop_index("ix_bmcs_serial", table_name="bmcs")
    op.drop_index("ix_bmcs_system_uuid_lower", table_name="bmcs")
