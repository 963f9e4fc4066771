"""machines(state, gpu_count, memory_mb, id): the order claim allocation takes machines in

Revision ID: 0010
Revises: 0009
"""

from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index(
        "ix_machines_alloc", "machines", ["state", "gpu_count", "memory_mb", "id"], unique=False
    )


def downgrade() -> None:
    op.drop_index("ix_machines_alloc", table_name="machines")
