"""bmcs: owner and fencing generation; the journal of the last provisioning step's command

Revision ID: 0016
Revises: 0015
"""

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("bmcs") as b:
        b.add_column(sa.Column("owner", sqlmodel.sql.sqltypes.AutoString(), nullable=True))
        b.add_column(sa.Column("generation", sa.Integer(), nullable=False, server_default="0"))
        b.add_column(sa.Column("step", sqlmodel.sql.sqltypes.AutoString(), nullable=True))
        b.add_column(sa.Column("step_command", sqlmodel.sql.sqltypes.AutoString(), nullable=True))
        b.add_column(
            sa.Column("step_done", sa.Boolean(), nullable=False, server_default=sa.false())
        )
        b.create_index("ix_bmcs_owner", ["owner"])


def downgrade() -> None:
    with op.batch_alter_table("bmcs") as b:
        b.drop_index("ix_bmcs_owner")
        for c in ("step_done", "step_command", "step", "generation", "owner"):
            b.drop_column(c)
