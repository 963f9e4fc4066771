"""events.txid: the writing transaction's id on PostgreSQL, so readers follow commit order

Revision ID: 0021
Revises: 0020

Expand-only: a nullable column with a server default and an index. On PostgreSQL the default
fills the existing rows too (they are all committed, so any value orders them before every
later transaction's rows); on SQLite the column stays NULL (ids are in commit order there).
"""

import sqlalchemy as sa
from alembic import op

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None


def upgrade() -> None:
    pg = op.get_bind().dialect.name == "postgresql"
    default = sa.text("(pg_current_xact_id()::text::bigint)") if pg else None
    with op.batch_alter_table("events") as batch:
        batch.add_column(sa.Column("txid", sa.BigInteger(), nullable=True, server_default=default))
    op.create_index("ix_events_txid_id", "events", ["txid", "id"])


def downgrade() -> None:
    op.drop_index("ix_events_txid_id", table_name="events")
    with op.batch_alter_table("events") as batch:
        batch.drop_column("txid")
