"""`fairgate tenants list` shows each tenant's weight, priorities, the limits it sets and its
p99 SLO targets; `--json` is the admin API's tenant JSON (gateway.admin.tenant_json, the same
fields read from the same store) plus the number of active keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fairgate.cli import main
from gateway.admin import tenant_json
from tenants import TenantStore
from tests.support.postgres import run


@pytest.fixture
def database(tmp_path: Path) -> tuple[str, str]:
    return "--database", f"sqlite+aiosqlite:///{tmp_path / 'tenants.db'}"


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(list(argv)) == 0, capsys.readouterr().err
    return capsys.readouterr().out


def create_two(capsys: pytest.CaptureFixture[str], database: tuple[str, str]) -> None:
    cli(capsys, "tenants", "create", "acme", "--weight", "2", "--requests-per-min", "600",
        "--max-tokens", "4096", "--queue-timeout", "30", "--slo-ttft-p99", "0.5",
        "--slo-itl-p99", "0.05", "--key", *database)
    cli(capsys, "tenants", "create", "bob", "--allowed-priorities", "batch",
        "--default-priority", "batch", "--disable", *database)


def test_the_table_shows_weights_priorities_limits_and_slos(
        database: tuple[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    create_two(capsys, database)
    header, acme, bob = (line.split() for line in
                         cli(capsys, "tenants", "list", *database).splitlines())
    assert header == ["NAME", "WEIGHT", "PRIORITY", "ALLOWED", "ENABLED", "KEYS", "LIMITS",
                      "TTFT_P99", "TPOT_P99", "ITL_P99"]
    assert acme == ["acme", "2", "interactive", "interactive,batch", "yes", "1",
                    "requests_per_min=600", "max_tokens=4096", "queue_timeout_s=30",
                    "0.5s", "-", "0.05s"]
    assert bob == ["bob", "1", "batch", "batch", "no", "0", "-", "-", "-", "-"]


def test_json_has_the_admin_apis_fields_and_values(
        database: tuple[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    create_two(capsys, database)
    listed = json.loads(cli(capsys, "tenants", "list", "--json", *database))

    async def stored() -> list[dict[str, object]]:
        store = TenantStore(database[1])
        try:
            return [tenant_json(t) for t in await store.list_tenants()]
        finally:
            await store.close()

    admin = run(stored())
    assert [{k: v for k, v in t.items() if k != "active_keys"} for t in listed] == admin
    assert [t["active_keys"] for t in listed] == [1, 0]
    acme = listed[0]
    assert acme["limits"]["requests_per_min"] == 600 and acme["limits"]["tokens_per_min"] is None
    assert (acme["slo_ttft_p99_s"], acme["slo_tpot_p99_s"], acme["slo_itl_p99_s"]) == (
        0.5, None, 0.05)
