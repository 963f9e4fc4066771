"""machines.arch: the CPU architecture (amd64, arm64), for claims and boot images

Revision ID: 0037
Revises: 0036

Expand-only: one new nullable column and its index. Machines DHCP saw are filled in from the
firmware it recorded (uefi-arm64: arm64; bios, uefi-x64: amd64); the agent's next inventory
sets it on the others.
"""

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision = "0037"
down_revision = "0036"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("machines", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("arch", sqlmodel.sql.sqltypes.AutoString(), nullable=True)
        )
    op.create_index("ix_machines_arch", "machines", ["arch"], unique=False)
    op.execute("UPDATE machines SET arch = 'arm64' WHERE firmware = 'uefi-arm64'")
    op.execute("UPDATE machines SET arch = 'amd64' WHERE firmware IN ('bios', 'uefi-x64')")


def downgrade() -> None:
    op.drop_index("ix_machines_arch", table_name="machines")
    with op.batch_alter_table("machines", schema=None) as batch_op:
        batch_op.drop_column("arch")
