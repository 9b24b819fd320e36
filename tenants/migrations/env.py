"""Alembic env: always online, on the connection `tenants.migrate` hands over.

The caller owns the transaction (and, on PostgreSQL, the advisory lock held inside it), so this
file only configures the context and runs the migrations inside that transaction.
"""

from __future__ import annotations

from alembic import context

from tenants.models import Base

# Not Alembic's default `alembic_version`: Optuna's storage keeps its own schema version in a
# table of that name, and studies share this database (`fairgate tune`'s default storage, the
# gateway's tune jobs).
VERSION_TABLE = "fg_alembic_version"

connection = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError("run migrations through tenants.migrate.migrate(), not the alembic CLI")

context.configure(
    connection=connection,
    target_metadata=Base.metadata,
    version_table=VERSION_TABLE,
    render_as_batch=connection.dialect.name == "sqlite",  # SQLite ALTER goes through table copies
)
with context.begin_transaction():
    context.run_migrations()
