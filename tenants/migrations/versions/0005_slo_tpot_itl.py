"""Three latency SLOs with vLLM's names: TTFT and TPOT per request, ITL per gap pooled.

Before, a tenant's `slo_itl_p99_s` bounded each request's TPOT: the value keeps that meaning
under its right name, `slo_tpot_p99_s`, and a new `slo_itl_p99_s` (NULL: no target) bounds every
gap between two tokens. The same for what was measured against it: a usage row's `slo_itl`
outcome becomes `slo_tpot`, the rollups' `itl_checked`/`itl_met` become `tpot_checked`/
`tpot_met`, and new counts of gaps (`itl_gaps`, `itl_gaps_met`) hold the ITL target's attainment
(none before: NULL per request, 0 in the rollups). A stored tune job's spec field
`slo_itl_p99_s` becomes `slo_tpot_p99_s` too.

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

import json

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

ROLLUPS = ("fg_usage_minutes", "fg_usage_hours")
GAP_COUNTS = ("itl_gaps", "itl_gaps_met")


def upgrade() -> None:
    # two batches: on SQLite one batch would rename and add a column of the same name at once
    with op.batch_alter_table("fg_tenants") as batch:
        batch.alter_column("slo_itl_p99_s", new_column_name="slo_tpot_p99_s")
    with op.batch_alter_table("fg_tenants") as batch:
        batch.add_column(sa.Column("slo_itl_p99_s", sa.Float))
    with op.batch_alter_table("fg_usage") as batch:
        batch.alter_column("slo_itl", new_column_name="slo_tpot")
        for name in GAP_COUNTS:
            batch.add_column(sa.Column(name, sa.Integer))
    for table in ROLLUPS:
        with op.batch_alter_table(table) as batch:
            batch.alter_column("itl_checked", new_column_name="tpot_checked")
            batch.alter_column("itl_met", new_column_name="tpot_met")
            for name in GAP_COUNTS:  # the rows there counted no gap
                batch.add_column(sa.Column(name, sa.BigInteger, nullable=False,
                                           server_default="0"))
        with op.batch_alter_table(table) as batch:  # as the models declare them: no default
            for name in GAP_COUNTS:
                batch.alter_column(name, server_default=None)
    _rename_spec_field("slo_itl_p99_s", "slo_tpot_p99_s")


def downgrade() -> None:
    _rename_spec_field("slo_tpot_p99_s", "slo_itl_p99_s")
    for table in ROLLUPS:
        with op.batch_alter_table(table) as batch:
            for name in GAP_COUNTS:
                batch.drop_column(name)
            batch.alter_column("tpot_met", new_column_name="itl_met")
            batch.alter_column("tpot_checked", new_column_name="itl_checked")
    with op.batch_alter_table("fg_usage") as batch:
        for name in GAP_COUNTS:
            batch.drop_column(name)
        batch.alter_column("slo_tpot", new_column_name="slo_itl")
    with op.batch_alter_table("fg_tenants") as batch:
        batch.drop_column("slo_itl_p99_s")
    with op.batch_alter_table("fg_tenants") as batch:
        batch.alter_column("slo_tpot_p99_s", new_column_name="slo_itl_p99_s")


def _rename_spec_field(old: str, new: str) -> None:
    """Stored tune job specs (JSON text): `old` becomes `new`, its value kept."""
    jobs = sa.table("fg_tune_jobs", sa.column("id", sa.String), sa.column("spec_json", sa.Text))
    conn = op.get_bind()
    for job_id, text in conn.execute(sa.select(jobs.c.id, jobs.c.spec_json)).all():
        try:
            spec = json.loads(text)
        except ValueError:  # not ours to judge here: the jobs API reports it
            continue
        if not isinstance(spec, dict) or old not in spec or new in spec:
            continue
        spec[new] = spec.pop(old)
        conn.execute(jobs.update().where(jobs.c.id == job_id).values(
            spec_json=json.dumps(spec, sort_keys=True)))  # as tenants/jobs.py writes it
