"""`fairgate tenants create|list|update|delete|import|export`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from fairgate.actions import chosen_action
from fairgate.tenants_common import add_database_options, check_name_args, run_with_store, table
from protocol.priority import PRIORITIES
from tenants.store import TenantStore, apply_changes
from tenants.values import NAME_RULE, TenantError, TenantInfo, TenantLimits
from tenants.yaml_io import (
    ImportResult,
    export_yaml,
    import_specs,
    parse_yaml,
    read_source,
)

# option -> (field, kind, help); parsed in run() so a bad value is one error line, not argparse
# usage. A limit or SLO given as 'none' is unset.
_FIELD_OPTIONS: dict[str, tuple[str, str, str]] = {
    "--weight": ("weight", "float", "share of the engine against other tenants' weights (> 0)"),
    "--default-priority": ("default_priority", "priority",
                           f"priority of a request that names none: {' or '.join(PRIORITIES)}"),
    "--allowed-priorities": ("allowed_priorities", "list",
                             f"priorities its requests may ask for: {','.join(PRIORITIES)}"),
    "--requests-per-min": ("requests_per_min", "int?",
                           "requests per sliding minute ('none': unlimited)"),
    "--tokens-per-min": ("tokens_per_min", "int?",
                         "prompt + output tokens per sliding minute ('none': unlimited)"),
    "--max-concurrent": ("max_concurrent", "int?",
                         "requests in flight at once ('none': unlimited)"),
    "--max-queued-requests": ("max_queued_requests", "int?",
                              "requests waiting in the queue ('none': the gateway's bound)"),
    "--max-queued-tokens": ("max_queued_tokens", "int?",
                            "estimated tokens waiting in the queue ('none': the gateway's bound)"),
    "--max-tokens": ("max_tokens", "int?",
                     "largest max_tokens one request may ask for ('none': unlimited)"),
    "--queue-timeout": ("queue_timeout_s", "float?",
                        "seconds a request may wait in the queue ('none': the gateway's)"),
    "--slo-ttft-p99": ("slo_ttft_p99_s", "float?",
                       "p99 target of each request's TTFT, seconds ('none': no target)"),
    "--slo-tpot-p99": ("slo_tpot_p99_s", "float?",
                       "p99 target of each request's TPOT, seconds ('none': no target)"),
    "--slo-itl-p99": ("slo_itl_p99_s", "float?",
                      "p99 target of all gaps between tokens, pooled, seconds ('none': no target)"),
}
_UNSET = ("none", "unlimited", "null")
ACTIONS = ("create", "list", "update", "delete", "import", "export")


def register(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION")
    create = sub.add_parser("create", help="create a tenant")
    create.add_argument("name", help=f"the tenant's name: {NAME_RULE}")
    _add_field_options(create)
    create.add_argument("--key", action="store_true", help="also create an API key (printed once)")
    update = sub.add_parser("update", help="change a tenant's fields ('none' unsets a limit)")
    update.add_argument("name", help="the tenant to change")
    _add_field_options(update)
    listing = sub.add_parser("list", help="list tenants")
    listing.add_argument("--json", action="store_true", help="JSON instead of a table")
    delete = sub.add_parser("delete", help="delete a tenant and its keys (usage is kept)")
    delete.add_argument("name", help="the tenant to delete")
    imp = sub.add_parser("import", help="create/update tenants from a tenants.yaml (idempotent)")
    imp.add_argument("file", help="tenants.yaml, or - for standard input")
    exp = sub.add_parser("export", help="write all tenants as tenants.yaml")
    exp.add_argument("-o", "--output", metavar="FILE", help="write here instead of stdout")
    for p in (create, update, listing, delete, imp, exp):
        add_database_options(p)


def _add_field_options(p: argparse.ArgumentParser) -> None:
    for option, (field, _, help_text) in _FIELD_OPTIONS.items():
        p.add_argument(option, dest=field, metavar="VALUE", default=argparse.SUPPRESS,
                       help=help_text)
    state = p.add_mutually_exclusive_group()
    state.add_argument("--enable", dest="enabled", action="store_true", default=argparse.SUPPRESS,
                       help="serve its keys' requests (the default)")
    state.add_argument("--disable", dest="enabled", action="store_false", default=argparse.SUPPRESS,
                       help="refuse its keys' requests, keeping the tenant and its keys")


def _convert(option: str, kind: str, raw: str) -> Any:
    if kind.endswith("?") and raw.strip().lower() in _UNSET:
        return None
    try:
        if kind.startswith("int"):
            return int(raw)
        if kind.startswith("float"):
            return float(raw)
    except ValueError:
        wanted = "an integer" if kind.startswith("int") else "a number"
        raise TenantError(f"{option}: expected {wanted}, got {raw!r}") from None
    if kind == "list":
        return tuple(p.strip() for p in raw.split(",") if p.strip())
    return raw


def field_changes(args: argparse.Namespace) -> dict[str, Any]:
    changes = {
        field: _convert(option, kind, getattr(args, field))
        for option, (field, kind, _) in _FIELD_OPTIONS.items()
        if hasattr(args, field)
    }
    if hasattr(args, "enabled"):
        changes["enabled"] = args.enabled
    return changes


def run(args: argparse.Namespace) -> int:
    action = chosen_action(args, "tenants", ACTIONS)
    if action is None:
        return 2
    if action == "import":
        return _import(args)
    check_name_args(args, "name")
    if action == "create":
        # Every value checked before the database is opened (or made): a bad one leaves
        # neither a half-made tenant nor a new database file.
        info = apply_changes(TenantInfo(name=args.name), field_changes(args))
        return run_with_store(args, lambda store: _create(store, args, info))
    if action == "export":  # written once the database is closed: its errors are the file's
        text, count = run_with_store(args, _export)
        if args.output:
            Path(args.output).write_text(text, encoding="utf-8")
            print(f"wrote {count} tenants to {args.output}", file=sys.stderr)
        else:
            sys.stdout.write(text)
        return 0
    handlers = {"update": _update, "list": _list, "delete": _delete}
    return run_with_store(args, lambda store: handlers[action](store, args))


async def _create(store: TenantStore, args: argparse.Namespace, info: TenantInfo) -> int:
    created = await store.create_tenant(info.name, **info.settings())
    print(f"created tenant {created.name}")
    if args.key:
        key, plaintext = await store.create_key(created.name)
        print(f"key {key.id} (shown once, store it now): {plaintext}")
    return 0


async def _update(store: TenantStore, args: argparse.Namespace) -> int:
    changes = field_changes(args)
    if not changes:
        raise TenantError("nothing to change; give at least one option such as --weight")
    info = await store.update_tenant(args.name, **changes)
    print(f"updated tenant {info.name}")
    return 0


async def _delete(store: TenantStore, args: argparse.Namespace) -> int:
    await store.delete_tenant(args.name)
    print(f"deleted tenant {args.name}")
    return 0


def _limits_text(limits: TenantLimits) -> str:
    return " ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
                    for k, v in dataclasses.asdict(limits).items() if v is not None)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:g}s"


# The table's SLO columns: vLLM's metric names (TTFT, TPOT, ITL) at p99.
_SLO_COLUMNS = {"TTFT_P99": "slo_ttft_p99_s", "TPOT_P99": "slo_tpot_p99_s",
                "ITL_P99": "slo_itl_p99_s"}


def listed_tenant_json(info: TenantInfo, active_keys: int) -> dict[str, Any]:
    """A tenant as `GET /admin/tenants` answers it, and its number of active keys."""
    from gateway.admin import tenant_json  # aiohttp: only for --json

    return {**tenant_json(info), "active_keys": active_keys}


async def _list(store: TenantStore, args: argparse.Namespace) -> int:
    tenants = await store.list_tenants()
    keys = await store.list_keys()
    active = {t.name: sum(1 for k in keys if k.tenant == t.name and not k.revoked) for t in tenants}
    if args.json:
        print(json.dumps([listed_tenant_json(t, active[t.name]) for t in tenants], indent=2))
        return 0
    rows = [
        [t.name, f"{t.weight:g}", t.default_priority, ",".join(t.allowed_priorities),
         "yes" if t.enabled else "no", active[t.name], _limits_text(t.limits) or "-",
         *(_seconds(getattr(t, field)) for field in _SLO_COLUMNS.values())]
        for t in tenants
    ]
    print(table(["NAME", "WEIGHT", "PRIORITY", "ALLOWED", "ENABLED", "KEYS", "LIMITS",
                 *_SLO_COLUMNS], rows))
    return 0


async def _export(store: TenantStore) -> tuple[str, int]:
    return await export_yaml(store), await store.count_tenants()


def _import(args: argparse.Namespace) -> int:
    # Read and validate the whole file before touching (or creating) the database.
    if args.file == "-":
        text, source = sys.stdin.read(), "<stdin>"
    else:
        text, source = read_source(Path(args.file))
    specs = parse_yaml(text, source)
    result = run_with_store(args, lambda store: import_specs(store, specs, source))
    _print_import(result)
    return 0


def _print_import(result: ImportResult) -> None:
    print(f"tenants: {len(result.created)} created, {len(result.updated)} updated, "
          f"{len(result.unchanged)} unchanged; keys: {len(result.new_keys)} created, "
          f"{result.imported_hashes} imported by hash")
    for key, plaintext in result.new_keys:
        print(f"key {key.id} for {key.tenant} (shown once, store it now): {plaintext}")

