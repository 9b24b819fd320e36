"""`fairgate keys create TENANT | list [--tenant T] | revoke ID`."""

from __future__ import annotations

import argparse
import json
import sys

from fairgate.actions import chosen_action
from fairgate.tenants_common import (
    add_database_options,
    check_name_args,
    run_with_store,
    table,
    when,
)
from tenants.store import TenantStore


def register(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION")
    create = sub.add_parser("create", help="create a key; the key alone goes to stdout, once")
    create.add_argument("tenant", help="the tenant the key authenticates as")
    listing = sub.add_parser("list", help="list keys (prefixes only; keys are not stored)")
    listing.add_argument("--tenant", help="only this tenant's keys")
    listing.add_argument("--all", action="store_true", help="include revoked keys")
    listing.add_argument("--json", action="store_true", help="JSON instead of a table")
    revoke = sub.add_parser("revoke", help="revoke a key by id")
    revoke.add_argument("key_id", metavar="ID", help="the key's id (key_..., `fairgate keys list`)")
    for p in (create, listing, revoke):
        add_database_options(p)


def run(args: argparse.Namespace) -> int:
    handlers = {"create": _create, "list": _list, "revoke": _revoke}
    action = chosen_action(args, "keys", handlers)
    if action is None:
        return 2
    check_name_args(args, "tenant")
    return run_with_store(args, lambda store: handlers[action](store, args))


async def _create(store: TenantStore, args: argparse.Namespace) -> int:
    key, plaintext = await store.create_key(args.tenant)
    # Only the key on stdout, so `KEY=$(fairgate keys create acme)` works.
    print(f"created key {key.id} for {key.tenant}; it is shown once, store it now", file=sys.stderr)
    print(plaintext)
    return 0


async def _list(store: TenantStore, args: argparse.Namespace) -> int:
    keys = [k for k in await store.list_keys(args.tenant) if args.all or not k.revoked]
    if args.json:
        print(json.dumps([
            {"id": k.id, "tenant": k.tenant, "prefix": k.prefix, "created_at": k.created_at,
             "last_used_at": k.last_used_at, "revoked_at": k.revoked_at} for k in keys
        ], indent=2))
        return 0
    rows = [
        [k.id, k.tenant, (k.prefix + "...") if k.prefix else "(imported)", when(k.created_at),
         when(k.last_used_at), "revoked" if k.revoked else "active"]
        for k in keys
    ]
    print(table(["ID", "TENANT", "PREFIX", "CREATED", "LAST USED", "STATE"], rows))
    return 0


async def _revoke(store: TenantStore, args: argparse.Namespace) -> int:
    key = await store.revoke_key(args.key_id)
    print(f"revoked key {key.id} of {key.tenant}")
    return 0
