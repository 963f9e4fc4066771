"""ui_sessions: the web console's server-side sessions, each bound to an API token

Revision ID: 0022
Revises: 0021

Expand-only: a new table; older instances never read it.
"""

import sqlalchemy as sa
from alembic import op

revision = "0022"
down_revision = "0021"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "ui_sessions",
        sa.Column("id_hash", sa.String(), primary_key=True),
        sa.Column("token_id", sa.String(), nullable=False),
        sa.Column("csrf", sa.String(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_seen_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_ui_sessions_token_id", "ui_sessions", ["token_id"])


def downgrade() -> None:
    op.drop_index("ix_ui_sessions_token_id", table_name="ui_sessions")
    op.drop_table("ui_sessions")
