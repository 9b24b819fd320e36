"""Usage rows say what the SLO dashboard needs (TPOT, SLO outcomes, cached tokens, backend);
per-minute and per-hour rollups per tenant.

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

COUNTS = ("requests", "ok", "rejected", "failed")
SLO_COUNTS = ("ttft_checked", "ttft_met", "itl_checked", "itl_met", "slo_checked", "slo_met")


def upgrade() -> None:
    with op.batch_alter_table("fg_usage") as batch:
        batch.add_column(sa.Column("tpot", sa.Float))
        batch.add_column(sa.Column("slo_ttft", sa.SmallInteger))
        batch.add_column(sa.Column("slo_itl", sa.SmallInteger))
        batch.add_column(sa.Column("cached_tokens", sa.Integer))
        batch.add_column(sa.Column("backend", sa.String(512)))
    op.create_index("ix_fg_usage_finished", "fg_usage", ["finished_at"])
    for table, column in (("fg_usage_minutes", "minute"), ("fg_usage_hours", "hour")):
        op.create_table(
            table,
            sa.Column("tenant", sa.String(64), primary_key=True),
            sa.Column(column, sa.Integer, primary_key=True),
            *[sa.Column(name, sa.Integer, nullable=False) for name in COUNTS],
            sa.Column("prompt_tokens", sa.BigInteger, nullable=False),
            sa.Column("completion_tokens", sa.BigInteger, nullable=False),
            *[sa.Column(name, sa.Integer, nullable=False) for name in SLO_COUNTS],
        )
        op.create_index(f"ix_{table}_{column}", table, [column])
    pg = op.get_bind().dialect.name == "postgresql"
    for table, unit, column in (("fg_usage_minutes", 60, "minute"), ("fg_usage_hours", 3600,
                                                                      "hour")):
        at = (f"CAST(FLOOR(finished_at / {unit}) AS INTEGER)" if pg
              else f"CAST(finished_at / {unit} AS INTEGER)")
        op.execute(
            f"INSERT INTO {table} (tenant, {column}, requests, ok, rejected, failed, "
            "prompt_tokens, completion_tokens, ttft_checked, ttft_met, itl_checked, itl_met, "
            f"slo_checked, slo_met) SELECT tenant, {at}, COUNT(*), "
            "SUM(CASE WHEN status = 200 THEN 1 ELSE 0 END), "
            "SUM(CASE WHEN status = 429 THEN 1 ELSE 0 END), "
            "SUM(CASE WHEN status >= 500 THEN 1 ELSE 0 END), "
            "SUM(prompt_tokens), SUM(completion_tokens), 0, 0, 0, 0, 0, 0 "
            f"FROM fg_usage GROUP BY tenant, {at}")


def downgrade() -> None:
    op.drop_index("ix_fg_usage_hours_hour", table_name="fg_usage_hours")
    op.drop_table("fg_usage_hours")
    op.drop_index("ix_fg_usage_minutes_minute", table_name="fg_usage_minutes")
    op.drop_table("fg_usage_minutes")
    op.drop_index("ix_fg_usage_finished", table_name="fg_usage")
    with op.batch_alter_table("fg_usage") as batch:
        for name in ("backend", "cached_tokens", "slo_itl", "slo_ttft", "tpot"):
            batch.drop_column(name)
