"""Tuning jobs (control/jobs.py).

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "fg_tune_jobs",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("spec_json", sa.Text, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("target", sa.String(512)),
        sa.Column("study", sa.String(128), nullable=False),
        sa.Column("out_dir", sa.String(1024), nullable=False),
        sa.Column("planned_trials", sa.Integer),
        sa.Column("runs", sa.Integer, nullable=False),
        sa.Column("owner", sa.String(256)),
        sa.Column("error", sa.Text),
        sa.Column("apply_json", sa.Text),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("started_at", sa.Float),
        sa.Column("finished_at", sa.Float),
        sa.Column("updated_at", sa.Float, nullable=False),
    )
    op.create_index("ix_fg_tune_jobs_state", "fg_tune_jobs", ["state"])


def downgrade() -> None:
    op.drop_index("ix_fg_tune_jobs_state", table_name="fg_tune_jobs")
    op.drop_table("fg_tune_jobs")
