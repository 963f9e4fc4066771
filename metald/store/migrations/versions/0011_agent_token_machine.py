"""api_tokens.machine_id: an agent token's machine, indexed (revocation without a scan)

Revision ID: 0011
Revises: 0010
"""

import json

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("api_tokens", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("machine_id", sqlmodel.sql.sqltypes.AutoString(), nullable=True)
        )
        batch_op.create_index(batch_op.f("ix_api_tokens_machine_id"), ["machine_id"], unique=False)
    # Agent tokens already issued: their scope is [machine id].
    conn = op.get_bind()
    tokens = sa.table(
        "api_tokens", sa.column("id"), sa.column("role"), sa.column("scope"), sa.column("machine_id")
    )
    rows = conn.execute(sa.select(tokens.c.id, tokens.c.scope).where(tokens.c.role == "agent"))
    for token_id, scope in rows.all():
        ids = json.loads(scope) if isinstance(scope, str) else scope
        if ids:
            conn.execute(
                tokens.update().where(tokens.c.id == token_id).values(machine_id=str(ids[0]))
            )


def downgrade() -> None:
    with op.batch_alter_table("api_tokens", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_api_tokens_machine_id"))
        batch_op.drop_column("machine_id")
