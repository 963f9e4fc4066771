"""Measured-boot attestation: machines' attestation keys, nonces, attestations, golden values

Revision ID: 0036
Revises: 0035

Expand-only: four new tables and one nullable machines column.
"""

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision = "0036"
down_revision = "0035"
branch_labels = None
depends_on = None

_str = sqlmodel.sql.sqltypes.AutoString
_ts = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "attestation_keys",
        sa.Column("machine_id", _str(), nullable=False),
        sa.Column("ak_public", _str(), nullable=False),
        sa.Column("ak_name", _str(), nullable=False),
        sa.Column("ek_public", _str(), nullable=True),
        sa.Column("ek_certificate", _str(), nullable=True),
        sa.Column("ek_check", _str(), nullable=False),
        sa.Column("enrolled_at", _ts, nullable=False),
        sa.Column("enrolled_boot", _str(), nullable=True),
        sa.ForeignKeyConstraint(["machine_id"], ["machines.id"]),
        sa.PrimaryKeyConstraint("machine_id"),
    )
    op.create_table(
        "attestation_nonces",
        sa.Column("nonce", _str(), nullable=False),
        sa.Column("machine_id", _str(), nullable=False),
        sa.Column("boot", _str(), nullable=True),
        sa.Column("issued_at", _ts, nullable=False),
        sa.Column("expires_at", _ts, nullable=False),
        sa.Column("used_at", _ts, nullable=True),
        sa.ForeignKeyConstraint(["machine_id"], ["machines.id"]),
        sa.PrimaryKeyConstraint("nonce"),
    )
    op.create_index("ix_attestation_nonces_machine_id", "attestation_nonces", ["machine_id"])
    op.create_table(
        "attestations",
        sa.Column("id", _str(), nullable=False),
        sa.Column("machine_id", _str(), nullable=False),
        sa.Column("at", _ts, nullable=False),
        sa.Column("boot", _str(), nullable=True),
        sa.Column("machine_state", _str(), nullable=False),
        sa.Column("status", _str(), nullable=False),
        sa.Column("reason", _str(), nullable=True),
        sa.Column("summary", _str(), nullable=False),
        sa.Column("verdict", sa.JSON(), nullable=True),
        sa.Column("measured", sa.JSON(), nullable=True),
        sa.Column("accepted_by", _str(), nullable=True),
        sa.Column("accepted_reason", _str(), nullable=True),
        sa.Column("accepted_at", _ts, nullable=True),
        sa.ForeignKeyConstraint(["machine_id"], ["machines.id"]),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_attestations_machine_id", "attestations", ["machine_id", "at"])
    op.create_table(
        "attestation_golden",
        sa.Column("subject", _str(), nullable=False),
        sa.Column("golden", sa.JSON(), nullable=False),
        sa.Column("source", _str(), nullable=False),
        sa.Column("set_by", _str(), nullable=False),
        sa.Column("reason", _str(), nullable=True),
        sa.Column("set_at", _ts, nullable=False),
        sa.Column("attestation_id", _str(), nullable=True),
        sa.PrimaryKeyConstraint("subject"),
    )
    with op.batch_alter_table("machines") as b:
        b.add_column(sa.Column("attested_boot", _str(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("machines") as b:
        b.drop_column("attested_boot")
    op.drop_table("attestation_golden")
    op.drop_index("ix_attestations_machine_id", "attestations")
    op.drop_table("attestations")
    op.drop_index("ix_attestation_nonces_machine_id", "attestation_nonces")
    op.drop_table("attestation_nonces")
    op.drop_table("attestation_keys")
