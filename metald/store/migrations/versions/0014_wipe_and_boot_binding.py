"""machines.wipe_required / boot_armed / boot_current; api_tokens.phase / boot

A machine that held a tenant's data owes a wipe; a boot metald started is armed once; an agent
token records the phase and boot it was minted for.

Revision ID: 0014
Revises: 0013
"""

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None

#: States in which a machine holds (or held, unwiped) a tenant's data.
_OWING = (
    "claimed", "provisioning", "provision-failed", "provisioned", "joining", "join-failed",
    "active", "releasing", "wiping", "wipe-failed",
)  # fmt: skip


def upgrade() -> None:
    # Plain ADD COLUMN (SQLite does it in place; a batch copy of machines would trip over the
    # tables that reference it).
    op.add_column(
        "machines",
        sa.Column("wipe_required", sa.Boolean(), nullable=False, server_default=sa.text("false")),
    )
    for table, column in (
        ("machines", "boot_armed"),
        ("machines", "boot_current"),
        ("api_tokens", "phase"),
        ("api_tokens", "boot"),
    ):
        op.add_column(table, sa.Column(column, sqlmodel.sql.sqltypes.AutoString(), nullable=True))
    machines = sa.table(
        "machines", sa.column("state"), sa.column("tenant_id"), sa.column("wipe_required")
    )
    op.get_bind().execute(
        machines.update()
        .where(sa.or_(machines.c.state.in_(_OWING), machines.c.tenant_id.is_not(None)))
        .values(wipe_required=True)
    )
    # Released machines are detached from their tenant at release now (they keep the claim
    # id until wiped): a wipe in flight at upgrade time leaves its tenant the same way.
    op.get_bind().execute(
        machines.update()
        .where(machines.c.state.in_(("releasing", "wiping", "wipe-failed")))
        .values(tenant_id=None)
    )
    # Agent tokens from before phases were recorded have none: every endpoint that checks a
    # phase refuses them, and the next boot metald starts mints new ones.


def downgrade() -> None:
    with op.batch_alter_table("api_tokens", schema=None) as batch_op:
        batch_op.drop_column("boot")
        batch_op.drop_column("phase")
    with op.batch_alter_table("machines", schema=None) as batch_op:
        batch_op.drop_column("boot_current")
        batch_op.drop_column("boot_armed")
        batch_op.drop_column("wipe_required")
