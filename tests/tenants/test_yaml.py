from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tenants import TenantError, TenantStore, export_yaml, hash_key, import_yaml

FILE = """\
tenants:
  - name: acme
    weight: 2
    allowed_priorities: [interactive, batch]
    limits: {requests_per_min: 600, max_tokens: 4096, queue_timeout_s: 30}
    slo_ttft_p99_s: 1.5
    keys:
      - create: true
  - name: batchco
    default_priority: batch
    allowed_priorities: [batch]
    enabled: false
"""


async def test_import_creates_and_is_idempotent(store: TenantStore) -> None:
    first = await import_yaml(store, FILE)
    assert first.created == ["acme", "batchco"] and first.changed
    assert [k.tenant for k, _ in first.new_keys] == ["acme"]
    plaintext = first.new_keys[0][1]
    tenant = await store.authenticate(plaintext)
    assert tenant is not None and tenant.weight == 2 and tenant.limits.max_tokens == 4096
    batchco = await store.get_tenant("batchco")
    assert batchco is not None and not batchco.enabled and batchco.default_priority == "batch"

    before = (await store.list_tenants(), await store.list_keys())
    again = await import_yaml(store, FILE)
    assert not again.changed and again.unchanged == ["acme", "batchco"] and again.new_keys == []
    assert (await store.list_tenants(), await store.list_keys()) == before


async def test_create_entries_replace_revoked_keys_only(store: TenantStore) -> None:
    text = FILE.replace("      - create: true\n", "      - create: true\n      - create: true\n")
    first = await import_yaml(store, text)
    assert len(first.new_keys) == 2
    await store.revoke_key(first.new_keys[0][0].id)
    second = await import_yaml(store, text)
    assert len(second.new_keys) == 1  # one replacement for the revoked key
    assert len([k for k in await store.list_keys("acme") if not k.revoked]) == 2


async def test_the_three_slo_fields_round_trip(store: TenantStore) -> None:
    """slo_ttft_p99_s and slo_tpot_p99_s (per request) and slo_itl_p99_s (per gap) import,
    export and import again as they were."""
    await import_yaml(store, "tenants:\n  - name: acme\n    slo_ttft_p99_s: 1.5\n"
                             "    slo_tpot_p99_s: 0.1\n    slo_itl_p99_s: 0.25\n")
    acme = await store.get_tenant("acme")
    assert acme is not None
    assert (acme.slo_ttft_p99_s, acme.slo_tpot_p99_s, acme.slo_itl_p99_s) == (1.5, 0.1, 0.25)
    [exported] = yaml.safe_load(await export_yaml(store))["tenants"]
    assert {k: v for k, v in exported.items() if k.startswith("slo_")} == {
        "slo_ttft_p99_s": 1.5, "slo_tpot_p99_s": 0.1, "slo_itl_p99_s": 0.25}
    again = await import_yaml(store, yaml.safe_dump({"tenants": [exported]}))
    assert not again.changed
    with pytest.raises(TenantError, match="slo_itl_p99_s must be > 0"):
        await import_yaml(store, "tenants:\n  - name: acme\n    slo_itl_p99_s: 0\n")


async def test_update_merges_fields(store: TenantStore) -> None:
    await import_yaml(store, FILE)
    await store.update_tenant("acme", max_concurrent=4)
    result = await import_yaml(store, "tenants:\n  - name: acme\n    weight: 5\n"
                                      "    limits: {max_tokens: null}\n")
    assert result.updated == ["acme"] and result.new_keys == []
    acme = await store.get_tenant("acme")
    assert acme is not None and acme.weight == 5 and acme.limits.max_tokens is None
    assert acme.limits.max_concurrent == 4 and acme.limits.requests_per_min == 600  # untouched


async def test_export_round_trip_keeps_keys_working(store: TenantStore, tmp_path: Path) -> None:
    plaintext = (await import_yaml(store, FILE)).new_keys[0][1]
    exported = await export_yaml(store)
    doc = yaml.safe_load(exported)
    assert doc["tenants"][0]["keys"] == [{"hash": hash_key(plaintext)}]
    assert plaintext not in exported
    path = tmp_path / "tenants.yaml"
    path.write_text(exported)

    other = TenantStore(f"sqlite+aiosqlite:///{tmp_path / 'copy.db'}")
    try:
        await other.init()
        result = await import_yaml(other, path)
        assert result.created == ["acme", "batchco"] and result.imported_hashes == 1
        assert result.new_keys == []
        assert (await other.authenticate(plaintext)) is not None
        assert await export_yaml(other) == exported
        assert not (await import_yaml(other, str(path))).changed
    finally:
        await other.close()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("tenants:\n  - name: a\n    weight: [1\n", r"^<yaml>:4: invalid YAML: .*flow sequence on line 3\)$"),
        ("tenants:\n  - name: a\n    weight: 1\n   bad: x\n", "^<yaml>:4: invalid YAML"),
        ("tenants:\n  - name: a\n  - name: b\n    weight: 0\n", "line 3: tenant #2: weight"),
        ("tenants:\n  - name: a\n  - name: b\n    limits: {max_tokens: -1}\n", "line 3.*max_tokens"),
        ("tenants:\n  - name: a\n  - name: a\n", "line 3: tenant 'a' is listed twice"),
        ("tenants:\n  - name: a\n    wieght: 2\n", "line 2: .*unknown tenant setting.*wieght; did you mean weight"),
        ("tenants:\n  - name: a\n    weight: 1\n    weight: 2\n", "^<yaml>:4: duplicate key 'weight'$"),
        ("tenants:\n  - name: a\n    keys: [{hash: md5:abc}]\n", "bad key entry"),
        ("tenants:\n  - weight: 2\n", "missing 'name'"),
        ("users: []\n", "one key, 'tenants'"),
    ],
)
async def test_bad_files_write_nothing(sqlite_store: TenantStore, text: str, message: str) -> None:
    # Parsing happens before any database work, so one backend covers it; the rollback of a
    # database-level conflict is tested on both below.
    with pytest.raises(TenantError, match=message) as info:
        await import_yaml(sqlite_store, text)
    assert "\n" not in str(info.value)
    assert await sqlite_store.count_tenants() == 0


async def test_database_conflict_rolls_back_whole_import(store: TenantStore) -> None:
    await store.create_tenant("owner")
    _, plaintext = await store.create_key("owner")
    stolen = hash_key(plaintext)
    text = (f"tenants:\n  - name: first\n    keys: [{{create: true}}]\n"
            f"  - name: thief\n    keys: [{{hash: '{stolen}'}}]\n")
    with pytest.raises(TenantError, match="belongs to another tenant"):
        await import_yaml(store, text)
    assert [t.name for t in await store.list_tenants()] == ["owner"]  # 'first' rolled back too
    assert len(await store.list_keys()) == 1


async def test_hash_scheme_must_match_secret(database_url: str) -> None:
    store = TenantStore(database_url, secret="s")
    try:
        await store.init()
        text = f"tenants:\n  - name: a\n    keys: [{{hash: '{hash_key('fg-x')}'}}]\n"
        with pytest.raises(TenantError, match="scheme 'sha256'.*'hmac-sha256'"):
            await import_yaml(store, text)
    finally:
        await store.close()


async def test_missing_file(store: TenantStore, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        await import_yaml(store, str(tmp_path / "nope.yaml"))
    assert (await import_yaml(store, "")).created == []  # an empty document is a no-op
