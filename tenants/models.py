"""SQLAlchemy tables. Times are epoch seconds (float) so SQLite and PostgreSQL compare them alike.

The migrations in `tenants/migrations/versions` create exactly these tables; a test checks that
Alembic's autogenerate finds no difference.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    Float,
    ForeignKey,
    Index,
    Integer,
    SmallInteger,
    String,
    Text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    pass


class TenantRow(Base):
    __tablename__ = "fg_tenants"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(64), unique=True, nullable=False)
    weight: Mapped[float] = mapped_column(Float, nullable=False)
    default_priority: Mapped[str] = mapped_column(String(32), nullable=False)
    allowed_priorities: Mapped[str] = mapped_column(String(128), nullable=False)  # comma list
    requests_per_min: Mapped[int | None] = mapped_column(Integer)
    tokens_per_min: Mapped[int | None] = mapped_column(Integer)
    max_concurrent: Mapped[int | None] = mapped_column(Integer)
    max_queued_requests: Mapped[int | None] = mapped_column(Integer)
    max_queued_tokens: Mapped[int | None] = mapped_column(Integer)
    max_tokens: Mapped[int | None] = mapped_column(Integer)
    queue_timeout_s: Mapped[float | None] = mapped_column(Float)
    # p99 targets (protocol.measures.SLO): TTFT and TPOT per request, ITL per gap pooled
    slo_ttft_p99_s: Mapped[float | None] = mapped_column(Float)
    slo_tpot_p99_s: Mapped[float | None] = mapped_column(Float)  # slo_itl_p99_s before 0005
    slo_itl_p99_s: Mapped[float | None] = mapped_column(Float)
    enabled: Mapped[bool] = mapped_column(Boolean, nullable=False)
    created_at: Mapped[float] = mapped_column(Float, nullable=False)
    updated_at: Mapped[float] = mapped_column(Float, nullable=False)  # its owner's lease, too


class ApiKeyRow(Base):
    __tablename__ = "fg_api_keys"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    tenant_id: Mapped[int] = mapped_column(
        Integer, ForeignKey("fg_tenants.id", ondelete="CASCADE"), nullable=False, index=True
    )
    prefix: Mapped[str] = mapped_column(String(16), nullable=False)
    key_hash: Mapped[str] = mapped_column(String(128), unique=True, nullable=False)
    created_at: Mapped[float] = mapped_column(Float, nullable=False)
    last_used_at: Mapped[float | None] = mapped_column(Float)
    revoked_at: Mapped[float | None] = mapped_column(Float)


class UsageRow(Base):
    """Usage is an audit trail: it names the tenant rather than referencing it, so deleting a
    tenant keeps its history and a flush never waits on a tenant lookup."""

    __tablename__ = "fg_usage"
    __table_args__ = (Index("ix_fg_usage_tenant_finished", "tenant", "finished_at"),
                      # every tenant's last hour (the dashboard), the retention's old rows
                      Index("ix_fg_usage_finished", "finished_at"))

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant: Mapped[str] = mapped_column(String(64), nullable=False)
    key_id: Mapped[str | None] = mapped_column(String(32))
    model: Mapped[str] = mapped_column(String(256), nullable=False)
    priority: Mapped[str] = mapped_column(String(32), nullable=False)
    prompt_tokens: Mapped[int] = mapped_column(Integer, nullable=False)
    completion_tokens: Mapped[int] = mapped_column(Integer, nullable=False)
    status: Mapped[int] = mapped_column(Integer, nullable=False)
    queue_time: Mapped[float | None] = mapped_column(Float)
    ttft: Mapped[float | None] = mapped_column(Float)
    e2e: Mapped[float | None] = mapped_column(Float)
    created_at: Mapped[float] = mapped_column(Float, nullable=False)
    finished_at: Mapped[float] = mapped_column(Float, nullable=False)
    tpot: Mapped[float | None] = mapped_column(Float)  # (last - first token) / (tokens - 1)
    # against the tenant's SLO then: 1 met, 0 missed (a failed or refused request misses),
    # NULL when it set no such target or a non-streamed answer has no first token to time
    slo_ttft: Mapped[int | None] = mapped_column(SmallInteger)
    slo_tpot: Mapped[int | None] = mapped_column(SmallInteger)  # slo_itl before 0005
    cached_tokens: Mapped[int | None] = mapped_column(Integer)  # prompt tokens from the cache
    backend: Mapped[str | None] = mapped_column(String(512))  # the engine that served it
    # its part of the pooled ITL target (RequestTiming.gaps_within): gaps within it, of its
    # gaps (a failed or refused request: 0 of its gaps + 1); NULL as for the outcomes above
    itl_gaps: Mapped[int | None] = mapped_column(Integer)
    itl_gaps_met: Mapped[int | None] = mapped_column(Integer)


class RollupCounts:
    """The counts a usage rollup keeps per tenant and period (fg_usage_minutes, _hours)."""

    requests: Mapped[int] = mapped_column(Integer, nullable=False)
    ok: Mapped[int] = mapped_column(Integer, nullable=False)  # HTTP 200
    rejected: Mapped[int] = mapped_column(Integer, nullable=False)  # 429
    failed: Mapped[int] = mapped_column(Integer, nullable=False)  # >= 500
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, nullable=False)
    completion_tokens: Mapped[int] = mapped_column(BigInteger, nullable=False)
    # requests checked against a TTFT, a TPOT target, and met it
    ttft_checked: Mapped[int] = mapped_column(Integer, nullable=False)
    ttft_met: Mapped[int] = mapped_column(Integer, nullable=False)
    tpot_checked: Mapped[int] = mapped_column(Integer, nullable=False)  # itl_checked before 0005
    tpot_met: Mapped[int] = mapped_column(Integer, nullable=False)  # itl_met before 0005
    # requests checked against a TTFT or TPOT target; those that met every one checked (goodput)
    slo_checked: Mapped[int] = mapped_column(Integer, nullable=False)
    slo_met: Mapped[int] = mapped_column(Integer, nullable=False)
    # gaps between tokens checked against an ITL target (pooled), and within it
    itl_gaps: Mapped[int] = mapped_column(BigInteger, nullable=False)
    itl_gaps_met: Mapped[int] = mapped_column(BigInteger, nullable=False)


class UsageMinuteRow(RollupCounts, Base):
    """Per tenant and minute: what the SLO dashboard reads for hours-to-30-day views, written in
    the same transaction as the raw rows, so they agree; raw rows may be pruned
    (`gateway.usage_retention_days`) without losing these."""

    __tablename__ = "fg_usage_minutes"

    tenant: Mapped[str] = mapped_column(String(64), primary_key=True)
    minute: Mapped[int] = mapped_column(Integer, primary_key=True)  # epoch seconds // 60

    __table_args__ = (Index("ix_fg_usage_minutes_minute", "minute"),)


class UsageHourRow(RollupCounts, Base):
    """The same counts per tenant and hour: the 30-day view sums 720 of these per tenant
    instead of 43,200 minutes."""

    __tablename__ = "fg_usage_hours"

    tenant: Mapped[str] = mapped_column(String(64), primary_key=True)
    hour: Mapped[int] = mapped_column(Integer, primary_key=True)  # epoch seconds // 3600

    __table_args__ = (Index("ix_fg_usage_hours_hour", "hour"),)


class UsageDeadLetterRow(Base):
    """A usage row the database refused, set aside with the reason so it never blocks the rows
    behind it. `row_json` is the row as ASCII-only JSON (every string escaped), so it always
    encodes, whatever the refused row held."""

    __tablename__ = "fg_usage_dead_letters"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    row_json: Mapped[str] = mapped_column(Text, nullable=False)
    reason: Mapped[str] = mapped_column(String(512), nullable=False)
    created_at: Mapped[float] = mapped_column(Float, nullable=False)


class TuneJobRow(Base):
    """A tuning job (control/jobs.py): its spec, its state, and what its apply did. The study
    itself is Optuna's, in its own tables (named `study`), beside this one."""

    __tablename__ = "fg_tune_jobs"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    spec_json: Mapped[str] = mapped_column(Text, nullable=False)  # as the client sent it, checked
    state: Mapped[str] = mapped_column(String(16), nullable=False, index=True)
    target: Mapped[str | None] = mapped_column(String(512))  # the engine it tunes; None: sim
    study: Mapped[str] = mapped_column(String(128), nullable=False)
    out_dir: Mapped[str] = mapped_column(String(1024), nullable=False)
    planned_trials: Mapped[int | None] = mapped_column(Integer)
    runs: Mapped[int] = mapped_column(Integer, nullable=False)  # worker processes started
    owner: Mapped[str | None] = mapped_column(String(256))  # host:pid of the gateway running it
    error: Mapped[str | None] = mapped_column(Text)
    apply_json: Mapped[str | None] = mapped_column(Text)  # the apply's steps, with their figures
    created_at: Mapped[float] = mapped_column(Float, nullable=False)
    started_at: Mapped[float | None] = mapped_column(Float)
    finished_at: Mapped[float | None] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float, nullable=False)  # its owner's lease, too
