"""SQLAlchemy tables. Times are epoch seconds (float) so SQLite and PostgreSQL compare them alike.

The migrations in `tenants/migrations/versions` create exactly these tables; a test checks that
Alembic's autogenerate finds no difference.
"""

from __future__ import annotations

from sqlalchemy import Boolean, Float, ForeignKey, Index, Integer, String, Text
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
    slo_ttft_p99_s: Mapped[float | None] = mapped_column(Float)
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
    __table_args__ = (Index("ix_fg_usage_tenant_finished", "tenant", "finished_at"),)

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
    """A tuning job (gateway/jobs.py): its spec, its state, and what its apply did. The study
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
