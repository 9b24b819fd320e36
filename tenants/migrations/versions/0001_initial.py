"""Initial schema: tenants, API keys, usage ledger.

Revision ID: 0001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "fg_tenants",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("name", sa.String(64), nullable=False, unique=True),
        sa.Column("weight", sa.Float, nullable=False),
        sa.Column("default_priority", sa.String(32), nullable=False),
        sa.Column("allowed_priorities", sa.String(128), nullable=False),
        sa.Column("requests_per_min", sa.Integer),
        sa.Column("tokens_per_min", sa.Integer),
        sa.Column("max_concurrent", sa.Integer),
        sa.Column("max_queued_requests", sa.Integer),
        sa.Column("max_queued_tokens", sa.Integer),
        sa.Column("max_tokens", sa.Integer),
        sa.Column("queue_timeout_s", sa.Float),
        sa.Column("slo_ttft_p99_s", sa.Float),
        sa.Column("slo_itl_p99_s", sa.Float),
        sa.Column("enabled", sa.Boolean, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("updated_at", sa.Float, nullable=False),
    )
    op.create_table(
        "fg_api_keys",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column(
            "tenant_id",
            sa.Integer,
            sa.ForeignKey("fg_tenants.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("prefix", sa.String(16), nullable=False),
        sa.Column("key_hash", sa.String(128), nullable=False, unique=True),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("last_used_at", sa.Float),
        sa.Column("revoked_at", sa.Float),
    )
    op.create_index("ix_fg_api_keys_tenant_id", "fg_api_keys", ["tenant_id"])
    op.create_table(
        "fg_usage",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("tenant", sa.String(64), nullable=False),
        sa.Column("key_id", sa.String(32)),
        sa.Column("model", sa.String(256), nullable=False),
        sa.Column("priority", sa.String(32), nullable=False),
        sa.Column("prompt_tokens", sa.Integer, nullable=False),
        sa.Column("completion_tokens", sa.Integer, nullable=False),
        sa.Column("status", sa.Integer, nullable=False),
        sa.Column("queue_time", sa.Float),
        sa.Column("ttft", sa.Float),
        sa.Column("e2e", sa.Float),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("finished_at", sa.Float, nullable=False),
    )
    op.create_index("ix_fg_usage_tenant_finished", "fg_usage", ["tenant", "finished_at"])


def downgrade() -> None:
    op.drop_table("fg_usage")
    op.drop_table("fg_api_keys")
    op.drop_table("fg_tenants")
