"""Usage dead letters: rows the database refused, kept with the reason.

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "fg_usage_dead_letters",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("row_json", sa.Text, nullable=False),
        sa.Column("reason", sa.String(512), nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("fg_usage_dead_letters")
