"""`fairgate tenants ...` and `fairgate keys ...`, in-process through fairgate.cli.main and as a
real subprocess. CLI tests are sync: the commands run their own event loop."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fairgate.cli import main
from tenants import TenantStore
from tests.support.postgres import run

REPO = Path(__file__).resolve().parents[2]


def authenticates(url: str, plaintext: str) -> bool:
    async def check() -> bool:
        store = TenantStore(url)
        try:
            return await store.authenticate(plaintext) is not None
        finally:
            await store.close()

    return run(check())


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_tenant_and_key_lifecycle(database_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    db = ("--database", database_url)
    code, out, _ = cli(capsys, "tenants", "create", "acme", "--weight", "2", "--max-tokens", "512",
                       "--allowed-priorities", "interactive,batch", *db)
    assert code == 0 and "created tenant acme" in out
    code, out, err = cli(capsys, "keys", "create", "acme", *db)
    plaintext = out.strip()
    assert code == 0 and plaintext.startswith("fg-") and "shown once" in err
    assert authenticates(database_url, plaintext)

    code, out, _ = cli(capsys, "tenants", "update", "acme", "--max-tokens", "none",
                       "--requests-per-min", "60", "--disable", *db)
    assert code == 0
    code, out, _ = cli(capsys, "tenants", "list", "--json", *db)
    [acme] = json.loads(out)
    assert acme["limits"]["max_tokens"] is None and acme["limits"]["requests_per_min"] == 60
    assert acme["enabled"] is False and acme["active_keys"] == 1 and acme["weight"] == 2
    assert not authenticates(database_url, plaintext)  # disabled
    cli(capsys, "tenants", "update", "acme", "--enable", *db)

    code, out, _ = cli(capsys, "keys", "list", "--json", *db)
    [key] = json.loads(out)
    assert key["prefix"] == plaintext[:10] and plaintext not in out
    code, out, _ = cli(capsys, "keys", "revoke", key["id"], *db)
    assert code == 0 and "revoked" in out
    assert not authenticates(database_url, plaintext)
    assert cli(capsys, "keys", "list", "--json", *db)[1].strip() == "[]"
    assert len(json.loads(cli(capsys, "keys", "list", "--all", "--json", *db)[1])) == 1

    code, out, _ = cli(capsys, "tenants", "delete", "acme", *db)
    assert code == 0 and json.loads(cli(capsys, "tenants", "list", "--json", *db)[1]) == []


def test_the_three_slo_flags(database_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """--slo-ttft-p99 and --slo-tpot-p99 bound each request, --slo-itl-p99 every gap: three
    fields, each set and unset on its own."""
    db = ("--database", database_url)
    code, _, _ = cli(capsys, "tenants", "create", "acme", "--slo-ttft-p99", "0.5",
                     "--slo-tpot-p99", "0.05", "--slo-itl-p99", "0.2", *db)
    assert code == 0
    [acme] = json.loads(cli(capsys, "tenants", "list", "--json", *db)[1])
    assert (acme["slo_ttft_p99_s"], acme["slo_tpot_p99_s"], acme["slo_itl_p99_s"]) == (
        0.5, 0.05, 0.2)
    assert cli(capsys, "tenants", "update", "acme", "--slo-itl-p99", "none", *db)[0] == 0
    [acme] = json.loads(cli(capsys, "tenants", "list", "--json", *db)[1])
    assert (acme["slo_tpot_p99_s"], acme["slo_itl_p99_s"]) == (0.05, None)
    code, _, err = cli(capsys, "tenants", "update", "acme", "--slo-tpot-p99", "0", *db)
    assert code != 0 and "slo_tpot_p99_s must be > 0" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["tenants", "create", "acme"], "tenant 'acme' already exists"),
        (["tenants", "create", "new", "--weight", "0"], "weight must be > 0"),
        (["tenants", "create", "new", "--weight", "-1"], "weight must be > 0"),
        (["tenants", "create", "new", "--max-concurrent", "0"], "max_concurrent must be a positive integer, got 0"),
        (["tenants", "create", "new", "--tokens-per-min", "-5"], "tokens_per_min must be a positive integer, got -5"),
        (["tenants", "create", "new", "--max-tokens", "lots"], "--max-tokens: expected an integer"),
        (["tenants", "create", "new", "--default-priority", "urgent"], "unknown priority"),
        (["tenants", "update", "ghost", "--weight", "2"], "unknown tenant 'ghost'"),
        (["tenants", "update", "acme"], "nothing to change"),
        (["tenants", "delete", "ghost"], "unknown tenant 'ghost'"),
        (["keys", "create", "ghost"], "unknown tenant 'ghost'"),
        (["keys", "revoke", "key_nope"], "unknown key id"),
        (["keys", "list", "--tenant", "ghost"], "unknown tenant 'ghost'"),
    ],
)
def test_user_errors_are_one_line(
    argv: list[str], message: str, sqlite_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = ["--database", f"sqlite:///{sqlite_path}"]
    assert cli(capsys, "tenants", "create", "acme", "--weight", "3", *db)[0] == 0
    code, out, err = cli(capsys, *argv, *db)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith(f"fairgate {argv[0]}: error: ") and message in err
    tenants = json.loads(cli(capsys, "tenants", "list", "--json", *db)[1])
    assert [(t["name"], t["weight"]) for t in tenants] == [("acme", 3.0)]  # nothing half-written


def test_import_export(database_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = ("--database", database_url)
    path = tmp_path / "tenants.yaml"
    path.write_text("tenants:\n  - name: acme\n    weight: 2\n    keys: [{create: true}]\n"
                    "  - name: beta\n    limits: {max_tokens: 100}\n")
    code, out, _ = cli(capsys, "tenants", "import", str(path), *db)
    assert code == 0 and "2 created" in out
    [plaintext] = [line.rsplit(" ", 1)[1] for line in out.splitlines() if "shown once" in line]
    assert authenticates(database_url, plaintext)
    code, out, _ = cli(capsys, "tenants", "import", str(path), *db)
    assert code == 0 and "2 unchanged; keys: 0 created" in out and "fg-" not in out

    exported = tmp_path / "out.yaml"
    assert cli(capsys, "tenants", "export", "-o", str(exported), *db)[0] == 0
    code, out, _ = cli(capsys, "tenants", "export", *db)
    assert out == exported.read_text() and "sha256:" in out and plaintext not in out

    bad = tmp_path / "bad.yaml"
    bad.write_text("tenants:\n  - name: gamma\n  - name: delta\n    weight: 0\n")
    code, out, err = cli(capsys, "tenants", "import", str(bad), *db)
    assert code == 2 and err.strip() == (
        f"fairgate tenants: error: {bad}: line 3: tenant #2: weight must be > 0, got 0")
    names = [t["name"] for t in json.loads(cli(capsys, "tenants", "list", "--json", *db)[1])]
    assert names == ["acme", "beta"]  # gamma (valid) was not written either


def test_malformed_yaml_reports_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("tenants:\n  - name: a\n    weight: 1\n   oops: [\n")
    code, _, err = cli(capsys, "tenants", "import", str(bad), "--database",
                       f"sqlite:///{tmp_path / 'x.db'}")
    assert code == 2 and err.count("\n") == 1 and f"{bad}:4: invalid YAML" in err
    code, _, err = cli(capsys, "tenants", "import", str(tmp_path / "missing.yaml"))
    assert code == 2 and "no such file" in err
    assert not (tmp_path / "x.db").exists()  # the file is checked before the database is opened
    code, _, err = cli(capsys, "tenants")
    assert code == 2 and "choose an action" in err


def test_database_from_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    Path("fairgate.yaml").write_text("database: sqlite:///from-config.db\n")
    assert cli(capsys, "tenants", "create", "acme")[0] == 0  # ./fairgate.yaml is read by default
    assert Path("from-config.db").exists() and not Path("fairgate.db").exists()
    Path("other.yaml").write_text("database:\n  url: sqlite:///other.db\n")
    assert cli(capsys, "tenants", "create", "beta", "-c", "other.yaml")[0] == 0
    assert Path("other.db").exists()
    code, _, err = cli(capsys, "tenants", "list", "-c", "missing.yaml")
    assert code == 2 and "config file missing.yaml not found" in err
    code, _, err = cli(capsys, "tenants", "list", "--database", "postgresql://postgres@127.0.0.1:1/x")
    assert code == 2 and err.count("\n") == 1 and "database postgresql" in err


def _fairgate(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "fairgate", *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=60)


def test_subprocess(tmp_path: Path) -> None:
    created = _fairgate("tenants", "create", "acme", "--key", cwd=tmp_path)  # default database
    assert created.returncode == 0, created.stderr
    assert (tmp_path / "fairgate.db").exists()
    key = created.stdout.split()[-1]
    assert key.startswith("fg-") and authenticates(f"sqlite:///{tmp_path / 'fairgate.db'}", key)
    duplicate = _fairgate("tenants", "create", "acme", cwd=tmp_path)
    assert duplicate.returncode == 2
    assert duplicate.stderr == "fairgate tenants: error: tenant 'acme' already exists\n"
    blob = b"".join(p.read_bytes() for p in tmp_path.glob("fairgate.db*"))
    assert key.encode() not in blob and key[3:].encode() not in blob
