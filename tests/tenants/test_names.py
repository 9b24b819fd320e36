"""Tenant names on every surface that takes one: TenantInfo, the store's lookups, YAML import and
the CLI (the admin API's are in tests/gateway/test_admin_input.py). A name is matched whole, so
`demo\\n` is not a second "demo"; control characters and look-alikes are refused; and every
message shows the name escaped, so no raw control character reaches a log line or a terminal."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from fairgate.cli import main
from tenants import TenantError, TenantStore, import_yaml
from tenants.values import INT_COLUMN_MAX, NAME_RULE, InvalidTenantNameError, TenantInfo

REPO = Path(__file__).resolve().parents[2]

# name -> how a message must spell it
BAD_NAMES = {
    "demo\n": r"'demo\n'",  # `$` matched before a trailing newline
    "demo\r\n": r"'demo\r\n'",
    "de\rmo": r"'de\rmo'",
    "demo\x00": r"'demo\x00'",
    "de\tmo": r"'de\tmo'",
    "demo\x1b[31m": r"'demo\x1b[31m'",  # a terminal escape
    "d\u0435mo": r"'d\u0435mo'",  # a Cyrillic e
    "\uff44emo": r"'\uff44emo'",  # a fullwidth d
    "demo\u200b": r"'demo\u200b'",  # a zero-width space
    "demo\u202e": r"'demo\u202e'",  # a right-to-left override
}


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_safe(message: str, spelled: str) -> None:
    """One printable ASCII line that names the name escaped."""
    assert message.isascii() and message.isprintable(), repr(message)
    assert "invalid tenant name" in message and spelled in message, message


@pytest.mark.parametrize("name", BAD_NAMES)
def test_tenant_info_refuses(name: str) -> None:
    with pytest.raises(InvalidTenantNameError) as info:
        TenantInfo(name=name)
    assert_safe(str(info.value), BAD_NAMES[name])
    assert info.value.field == "name"


def test_long_names_are_cut_in_messages() -> None:
    with pytest.raises(TenantError) as info:
        TenantInfo(name="x" * 10_000)
    assert len(str(info.value)) < 300
    assert TenantInfo(name="A" + "b" * 63).name == "A" + "b" * 63  # 64 characters is the most


@pytest.mark.parametrize("name", BAD_NAMES)
async def test_store_lookups_say_the_name_is_invalid(store: TenantStore, name: str) -> None:
    await store.create_tenant("demo")
    with pytest.raises(InvalidTenantNameError) as info:
        await store.create_tenant(name)
    assert_safe(str(info.value), BAD_NAMES[name])
    lookups: list[Callable[[str], Awaitable[object]]] = [
        store.get_tenant, store.delete_tenant, store.create_key, store.list_keys,
        lambda n: store.update_tenant(n, weight=2)]
    for lookup in lookups:
        with pytest.raises(InvalidTenantNameError) as info:
            await lookup(name)
        assert_safe(str(info.value), BAD_NAMES[name])
    assert [t.name for t in await store.list_tenants()] == ["demo"]


@pytest.mark.parametrize("name", BAD_NAMES)
async def test_yaml_import_refuses(sqlite_store: TenantStore, name: str) -> None:
    # A JSON-style double-quoted YAML string spells every character with an escape.
    spelled = name.encode("unicode_escape").decode("ascii").replace('"', '\\"')
    text = f'tenants:\n  - name: ok\n  - name: "{spelled}"\n'
    with pytest.raises(TenantError, match="line 3: tenant #2: invalid tenant name") as info:
        await import_yaml(sqlite_store, text)
    assert_safe(str(info.value), BAD_NAMES[name])
    assert await sqlite_store.count_tenants() == 0


@pytest.mark.parametrize("name", BAD_NAMES)
@pytest.mark.parametrize("command", [
    ["tenants", "create"], ["tenants", "update", "--weight", "2"], ["tenants", "delete"],
    ["keys", "create"], ["keys", "list", "--tenant"],
])
def test_cli_refuses_before_opening_the_database(
    name: str, command: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = tmp_path / "fairgate.db"
    code, out, err = cli(capsys, *command, name, "--database", f"sqlite:///{db}")
    assert code == 2 and out == ""
    assert err.startswith(f"fairgate {command[0]}: error: ") and err.endswith("\n")
    assert_safe(err.removesuffix("\n"), BAD_NAMES[name])
    assert not db.exists()


# -- the value rules every surface shares (the admin API's: tests/gateway/test_admin_input.py)


def test_integer_limits_fit_their_column_in_yaml_and_cli(
    database_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = ("--database", database_url)
    path = tmp_path / "tenants.yaml"
    for value in (INT_COLUMN_MAX + 1, 2**64):
        code, _, err = cli(capsys, "tenants", "create", "cli", "--max-queued-tokens", str(value),
                           *db)
        assert code == 2 and err.count("\n") == 1 and "at most 2147483647" in err
        path.write_text(f"tenants:\n  - name: file\n    limits: {{tokens_per_min: {value}}}\n")
        code, _, err = cli(capsys, "tenants", "import", str(path), *db)
        assert code == 2 and err.count("\n") == 1
        assert "line 2: tenant #1: tokens_per_min must be at most 2147483647" in err
    assert json.loads(cli(capsys, "tenants", "list", "--json", *db)[1]) == []

    code, _, err = cli(capsys, "tenants", "create", "cli", "--max-queued-tokens",
                       str(INT_COLUMN_MAX), *db)
    assert code == 0, err
    path.write_text(f"tenants:\n  - name: file\n    limits: {{tokens_per_min: {INT_COLUMN_MAX}}}\n")
    assert cli(capsys, "tenants", "import", str(path), *db)[0] == 0
    listed = json.loads(cli(capsys, "tenants", "list", "--json", *db)[1])
    assert [t["limits"]["max_queued_tokens"] for t in listed] == [INT_COLUMN_MAX, None]
    assert [t["limits"]["tokens_per_min"] for t in listed] == [None, INT_COLUMN_MAX]


def test_cli_subprocess_prints_one_escaped_line(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "fairgate", "tenants", "create", "demo\n"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stdout == "" and "Traceback" not in done.stderr
    assert done.stderr == (f"fairgate tenants: error: invalid tenant name 'demo\\n': a name is "
                           f"{NAME_RULE}\n")
    assert not (tmp_path / "fairgate.db").exists()
