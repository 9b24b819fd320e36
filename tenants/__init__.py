"""fairgate-package: tenants

Tenants: SQLAlchemy models, key hashing, the tenant store, YAML import and the usage ledger.
"""

from tenants.db import DEFAULT_DATABASE_URL, normalize_url
from tenants.keys import KEY_PREFIX, generate_key, hash_key
from tenants.ledger import DeadLetter, LedgerFullError, UsageLedger
from tenants.migrate import migrate
from tenants.store import TenantStore
from tenants.values import (
    PRIORITIES,
    DuplicateTenantError,
    KeyInfo,
    KeyNotFoundError,
    Principal,
    TenantError,
    TenantInfo,
    TenantLimits,
    TenantNotFoundError,
    UsageEvent,
    slo_outcomes,
)
from tenants.yaml_io import ImportResult, export_yaml, import_yaml

__all__ = [
    "DEFAULT_DATABASE_URL",
    "KEY_PREFIX",
    "PRIORITIES",
    "DeadLetter",
    "DuplicateTenantError",
    "ImportResult",
    "KeyInfo",
    "KeyNotFoundError",
    "LedgerFullError",
    "Principal",
    "TenantError",
    "TenantInfo",
    "TenantLimits",
    "TenantNotFoundError",
    "TenantStore",
    "UsageEvent",
    "UsageLedger",
    "export_yaml",
    "generate_key",
    "hash_key",
    "import_yaml",
    "migrate",
    "normalize_url",
    "slo_outcomes",
]
