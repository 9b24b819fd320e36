"""`tenants.yaml` import and export.

Format::

    tenants:
      - name: acme                       # required
        weight: 2.0                      # fair-share weight, > 0
        default_priority: interactive    # interactive | batch
        allowed_priorities: [interactive, batch]
        limits:                          # each > 0, or null for unlimited
          requests_per_min: 600
          tokens_per_min: 200000
          max_concurrent: 16
          max_queued_requests: 64
          max_queued_tokens: 100000
          max_tokens: 4096
          queue_timeout_s: 30
        slo_ttft_p99_s: 1.5              # p99 of each request's time to first token
        slo_tpot_p99_s: 0.1              # p99 of each request's time per output token
        slo_itl_p99_s: 0.25              # p99 of every gap between two tokens, pooled
        enabled: true
        keys:
          - create: true                 # a generated key, printed once
          - hash: "sha256:<64 hex>"      # an existing key, by its stored hash

Semantics (import is one transaction: it all applies or nothing does):

* A tenant in the file that is not in the database is created (absent fields take defaults).
  A tenant that exists is updated with the fields the file gives; absent fields keep their
  current values and an explicit `null` limit means unlimited. Tenants not in the file are left
  alone; import never deletes.
* `hash:` entries add that key to the tenant unless the database already has it (a revoked key
  stays revoked; a hash owned by another tenant is an error). The hash scheme must match the
  store's (`sha256:` without a server secret, `hmac-sha256:` with one).
* Idempotence of `create: true`: N `create` entries mean "this tenant has N generated keys". The
  importer counts the tenant's active keys that the file does not list by hash and creates only
  the shortfall. The first import creates N keys (printed once); importing the same file again
  creates none; after one of them is revoked, the next import creates one replacement.
* Export writes every tenant with all fields (unset limits as `null`) and its active keys as
  `hash:` entries, so importing an export reproduces the tenants and their working keys (given
  the same server secret).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from sqlalchemy import select, text
from sqlalchemy.ext.asyncio import AsyncSession

from protocol.yaml_files import YamlError, load_yaml
from tenants.keys import display_prefix, generate_key, hash_scheme, is_valid_hash
from tenants.models import ApiKeyRow, TenantRow
from tenants.store import (
    TenantStore,
    add_key_row,
    apply_changes,
    find_tenant_row,
    insert_tenant,
    row_to_info,
    update_tenant_row,
)
from tenants.values import KeyInfo, TenantError, TenantInfo, limits_mapping, tenant_mapping

_PG_IMPORT_LOCK = 0x46470002


@dataclass
class ImportResult:
    created: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    new_keys: list[tuple[KeyInfo, str]] = field(default_factory=list)  # (info, plaintext)
    imported_hashes: int = 0

    @property
    def changed(self) -> bool:
        return bool(self.created or self.updated or self.new_keys or self.imported_hashes)


@dataclass(frozen=True)
class TenantSpec:
    """One validated tenant entry of the file."""

    name: str
    fields: dict[str, Any]
    creates: int
    hashes: tuple[str, ...]
    line: int


def _line(node: object, default: int = 1) -> int:
    return int(getattr(node, "line", default))


def read_source(text_or_path: str | Path) -> tuple[str, str]:
    """(YAML text, name for messages). A str without a newline that names a file is read."""
    if isinstance(text_or_path, Path) or (
        text_or_path.strip()
        and "\n" not in text_or_path
        and (os.path.exists(text_or_path) or ":" not in text_or_path)
    ):
        path = Path(text_or_path)
        if path.is_dir():
            raise IsADirectoryError(f"{path} is a directory, not a tenants file")
        if not path.is_file():
            raise FileNotFoundError(f"no such file: {path}")
        return path.read_text(encoding="utf-8"), str(path)
    return text_or_path, "<yaml>"


def parse_yaml(text: str, source: str = "<yaml>") -> list[TenantSpec]:
    """Parse and validate a whole file before anything touches the database."""
    try:
        doc = load_yaml(source, text=text, lines=True)  # mappings know their lines
    except YamlError as exc:
        raise TenantError(str(exc)) from None
    if doc is None:
        return []
    if not isinstance(doc, dict) or set(doc) - {"tenants"}:
        raise TenantError(f"{source}: line 1: the file must be a mapping with one key, 'tenants'")
    entries = doc.get("tenants") or []
    if not isinstance(entries, list):
        raise TenantError(f"{source}: line {_line(doc)}: 'tenants' must be a list")
    specs: list[TenantSpec] = []
    for i, entry in enumerate(entries):
        line = _line(entry, default=_line(doc))
        try:
            specs.append(_parse_tenant(entry, line))
        except TenantError as exc:
            raise TenantError(f"{source}: line {line}: tenant #{i + 1}: {exc}") from None
    seen: set[str] = set()
    for spec in specs:
        if spec.name in seen:
            raise TenantError(f"{source}: line {spec.line}: tenant {spec.name!r} is listed twice")
        seen.add(spec.name)
    return specs


def _parse_tenant(entry: Any, line: int) -> TenantSpec:
    if not isinstance(entry, dict):
        raise TenantError("each tenant must be a mapping with at least 'name'")
    settings = tenant_mapping(entry, extra=("keys",))
    name = settings.pop("name")
    creates, hashes = _parse_keys(settings.pop("keys", None) or [])
    if "limits" in settings:
        settings["limits"] = limits_mapping(settings["limits"])
    # Validate against defaults now, so errors carry the line number and nothing is written.
    apply_changes(TenantInfo(name=name), settings)
    return TenantSpec(name, settings, creates, hashes, line)


def _parse_keys(keys: Any) -> tuple[int, tuple[str, ...]]:
    if not isinstance(keys, list):
        raise TenantError("'keys' must be a list of {create: true} or {hash: ...}")
    creates, hashes = 0, []
    for k in keys:
        if k == {"create": True}:
            creates += 1
        elif isinstance(k, dict) and set(k) == {"hash"} and is_valid_hash(k["hash"]):
            hashes.append(k["hash"])
        else:
            raise TenantError(
                f"bad key entry {dict(k) if isinstance(k, dict) else k!r}: use {{create: true}} "
                "or {hash: 'sha256:<64 hex digits>'}"
            )
    return creates, tuple(hashes)


async def import_yaml(store: TenantStore, text_or_path: str | Path) -> ImportResult:
    """Apply a tenants file in one transaction; see the module docstring for the semantics."""
    text_, source = read_source(text_or_path)
    return await import_specs(store, parse_yaml(text_, source), source)


async def import_specs(
    store: TenantStore, specs: list[TenantSpec], source: str = "<yaml>"
) -> ImportResult:
    """Apply already parsed entries (see `parse_yaml`) in one transaction."""
    for spec in specs:
        for h in spec.hashes:
            if hash_scheme(h) != store.hash_scheme:
                raise TenantError(
                    f"{source}: line {spec.line}: key hash scheme {hash_scheme(h)!r} does not "
                    f"match this store's {store.hash_scheme!r} (server secret set or not?)"
                )

    async def op(s: AsyncSession) -> ImportResult:
        if store.db.is_postgres:  # serialise concurrent imports (SQLite: BEGIN IMMEDIATE)
            await s.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _PG_IMPORT_LOCK})
        result = ImportResult()  # built afresh if the transaction is retried
        for spec in specs:
            row = await _apply_tenant(s, spec, result)
            await _apply_keys(s, store, row, spec, result)
        return result

    result = await store.db.run(op)
    store.forget_all()
    return result


async def _apply_tenant(s: AsyncSession, spec: TenantSpec, result: ImportResult) -> TenantRow:
    row = await find_tenant_row(s, spec.name)
    if row is None:
        result.created.append(spec.name)
        return await insert_tenant(s, apply_changes(TenantInfo(name=spec.name), spec.fields))
    current = row_to_info(row)
    fields_ = dict(spec.fields)
    if "limits" in fields_:  # a partial limits mapping changes only the limits it names
        fields_["limits"] = dataclasses.replace(current.limits, **fields_["limits"])
    wanted = apply_changes(current, fields_)
    if wanted == current:
        result.unchanged.append(spec.name)
    else:
        await update_tenant_row(s, row, wanted)
        result.updated.append(spec.name)
    return row


async def _apply_keys(
    s: AsyncSession, store: TenantStore, row: TenantRow, spec: TenantSpec, result: ImportResult
) -> None:
    for h in spec.hashes:
        existing = await s.scalar(select(ApiKeyRow).where(ApiKeyRow.key_hash == h))
        if existing is None:
            await add_key_row(s, row, h, prefix="")
            result.imported_hashes += 1
        elif existing.tenant_id != row.id:
            raise TenantError(f"line {spec.line}: key hash {h[:20]}... belongs to another tenant")
    active = (
        await s.scalars(
            select(ApiKeyRow.key_hash).where(
                ApiKeyRow.tenant_id == row.id, ApiKeyRow.revoked_at.is_(None)
            )
        )
    ).all()
    generated = [h for h in active if h not in spec.hashes]
    for _ in range(spec.creates - len(generated)):
        plaintext = generate_key()
        info = await add_key_row(s, row, store.hash_key(plaintext), display_prefix(plaintext))
        result.new_keys.append((info, plaintext))


async def export_yaml(store: TenantStore) -> str:
    """Every tenant with all its fields and its active keys as hashes."""

    async def op(s: AsyncSession) -> list[dict[str, Any]]:
        rows = (await s.scalars(select(TenantRow).order_by(TenantRow.name))).all()
        out = []
        for row in rows:
            hashes = (
                await s.scalars(
                    select(ApiKeyRow.key_hash)
                    .where(ApiKeyRow.tenant_id == row.id, ApiKeyRow.revoked_at.is_(None))
                    .order_by(ApiKeyRow.created_at, ApiKeyRow.id)
                )
            ).all()
            out.append(tenant_to_dict(row_to_info(row), list(hashes)))
        return out

    tenants = await store.db.run(op, write=False)
    return yaml.safe_dump({"tenants": tenants}, sort_keys=False, default_flow_style=False)


def tenant_to_dict(info: TenantInfo, hashes: list[str]) -> dict[str, Any]:
    return {
        "name": info.name,
        "weight": info.weight,
        "default_priority": info.default_priority,
        "allowed_priorities": list(info.allowed_priorities),
        "limits": dataclasses.asdict(info.limits),
        "slo_ttft_p99_s": info.slo_ttft_p99_s,
        "slo_tpot_p99_s": info.slo_tpot_p99_s,
        "slo_itl_p99_s": info.slo_itl_p99_s,
        "enabled": info.enabled,
        "keys": [{"hash": h} for h in hashes],
    }
