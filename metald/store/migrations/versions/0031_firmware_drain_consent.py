"""claims.firmware_consent; remediations.cause

A tenant's orchestrator may consent, on its claim, to machines being drained through the
Day-2 path for a firmware rollout (docs/firmware.md); a remediation says why it was opened
(``health``: a fault; ``firmware``: a rollout's drain).

Revision ID: 0031
Revises: 0030

Expand-only: two columns with defaults.
"""

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision = "0031"
down_revision = "0030"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Plain ADD COLUMN (SQLite does it in place).
    op.add_column(
        "claims",
        sa.Column("firmware_consent", sa.Boolean(), nullable=False, server_default=sa.text("false")),
    )
    op.add_column(
        "remediations",
        sa.Column(
            "cause", sqlmodel.sql.sqltypes.AutoString(), nullable=False, server_default="health"
        ),
    )


def downgrade() -> None:
    op.drop_column("remediations", "cause")
    op.drop_column("claims", "firmware_consent")
