"""Alembic environment for the tenants schema; run through `tenants.migrate.migrate()`."""
