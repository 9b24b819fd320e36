"""docs/tenants.md against the code a new user meets: the `tenants.yaml` example names the fields
`parse_yaml` accepts (a tenant's, its `limits`' and its `keys` entries' forms), both ways; what
`fairgate tenants export` writes goes back through `parse_yaml` and `import` unchanged and names
only the page's fields; and the options `fairgate tenants create --help` and `update --help`
print are the ones the page names for those commands, both ways.

How the page is read: the first ```yaml block under `## tenants.yaml` is the file format (its
`<64 hex>` placeholder stands for a real hash); the options the page names for create and update
are those on the `fairgate tenants create|update` lines of the command block under
`## The commands` and those of its "Field options:" sentence, which both commands take."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from fairgate.cli import main
from fairgate.tenants_common import SECRET_ENV
from tenants.values import TenantError, TenantLimits
from tenants.yaml_io import parse_yaml
from tests.test_docs import section

PAGE = Path(__file__).resolve().parents[1] / "docs" / "tenants.md"
YAML_HEADING, COMMANDS_HEADING = "`tenants.yaml`", "The commands"
A_HASH = "sha256:" + "0" * 64
OPTION = re.compile(r"(?<![\w-])(--?[A-Za-z][\w-]*)")
KNOWN_SETTINGS = re.compile(r"known settings are: (.*)$")


def page() -> str:
    return PAGE.read_text()


def yaml_example(text: str) -> str:
    """The page's tenants.yaml example, its hash placeholder made a valid hash."""
    body = section(text, YAML_HEADING)
    match = re.search(r"```yaml\n(.*?)```", body, re.DOTALL)
    assert match, f"no ```yaml block under ## {YAML_HEADING}"
    return re.sub(r"sha256:<64 hex>", A_HASH, match.group(1))


def documented_tenant(text: str) -> dict[str, Any]:
    """The example's one tenant entry, as YAML reads it."""
    doc = yaml.safe_load(yaml_example(text))
    [tenant] = doc["tenants"]
    assert isinstance(tenant, dict)
    return tenant


def key_forms(entries: list[dict[str, Any]]) -> set[str]:
    """Each `keys` entry's form, named by its one key (`create` or `hash`)."""
    return {"/".join(sorted(entry)) for entry in entries}


def field_options(text: str) -> set[str]:
    """The options of the commands section's "Field options:" sentence."""
    match = re.search(r"Field options: (.*?)\.\n", section(text, COMMANDS_HEADING), re.DOTALL)
    assert match, "no 'Field options: ...' sentence under ## The commands"
    spans = re.findall(r"`([^`]*)`", match.group(1))
    return {option for span in spans for option in OPTION.findall(span)}


def command_line_options(text: str, action: str) -> set[str]:
    """The options on the command block's `fairgate tenants <action>` lines (not comments)."""
    lines = [line.split("#")[0] for line in section(text, COMMANDS_HEADING).splitlines()
             if line.startswith(f"fairgate tenants {action} ")]
    assert lines, f"no 'fairgate tenants {action}' line under ## The commands"
    return {option for line in lines for option in OPTION.findall(line)}


def named_on_page(text: str, option: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", text) is not None


def help_options(capsys: pytest.CaptureFixture[str], action: str) -> list[tuple[str, ...]]:
    """Each option `fairgate tenants <action> --help` prints, as its spellings ('-c', '--config'),
    argparse's own --help left out."""
    with pytest.raises(SystemExit) as exit_:
        main(["tenants", action, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    options_part = out.split("\noptions:\n", 1)[1]
    heads = [line.split("  ")[1] for line in options_part.splitlines()
             if re.match(r"  -", line)]
    options = [tuple(OPTION.findall(head)) for head in heads]
    options = [spellings for spellings in options if "--help" not in spellings]
    assert len(options) > 10, out
    return options


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


def accepted_settings(entry: str) -> list[str]:
    """The settings `parse_yaml` lists as known when a tenant file has `entry` in it."""
    with pytest.raises(TenantError) as error:
        parse_yaml(f"tenants:\n  - {entry}\n")
    match = KNOWN_SETTINGS.search(str(error.value))
    assert match, str(error.value)
    return match.group(1).split(", ")


# The tenants.yaml format


def test_every_field_of_the_example_is_accepted() -> None:
    tenant = documented_tenant(page())
    [spec] = parse_yaml(yaml_example(page()))
    assert set(spec.fields) == set(tenant) - {"name", "keys"}
    assert set(spec.fields["limits"]) == set(tenant["limits"])
    assert (spec.creates, spec.hashes) == (1, (A_HASH,))
    assert key_forms(tenant["keys"]) == {"create", "hash"}


def test_every_field_parse_yaml_accepts_is_on_the_page() -> None:
    tenant = documented_tenant(page())
    accepted = accepted_settings("{name: acme, zzzzzz: 1}")
    assert "weight" in accepted and "keys" in accepted
    missing = sorted(set(accepted) - set(tenant))
    assert not missing, f"tenant fields parse_yaml accepts, not in the page's example: {missing}"


def test_every_limit_is_on_the_page() -> None:
    limits = documented_tenant(page())["limits"]
    assert accepted_settings("{name: acme, limits: {zzzzzz: 1}}") == list(TenantLimits.names())
    missing = sorted(set(TenantLimits.names()) - set(limits))
    assert not missing, f"TenantLimits fields not in the page's limits: {missing}"


# What export writes


def test_export_round_trips_and_names_only_documented_fields(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    first, second = (("--database", f"sqlite:///{tmp_path / name}") for name in ("a.db", "b.db"))
    cli(capsys, "tenants", "create", "acme", "--weight", "2", "--max-tokens", "4096",
        "--queue-timeout", "30", "--slo-itl-p99", "0.25", "--key", *first)
    cli(capsys, "tenants", "create", "batchy", "--default-priority", "batch", "--disable", *first)
    exported = cli(capsys, "tenants", "export", *first)

    specs = {spec.name: spec for spec in parse_yaml(exported)}
    assert set(specs) == {"acme", "batchy"}
    assert specs["acme"].fields["weight"] == 2 and len(specs["acme"].hashes) == 1
    assert specs["acme"].fields["limits"]["max_tokens"] == 4096
    assert specs["batchy"].fields["enabled"] is False
    (tmp_path / "tenants.yaml").write_text(exported)
    imported = cli(capsys, "tenants", "import", str(tmp_path / "tenants.yaml"), *second)
    assert "2 created" in imported and "1 imported by hash" in imported
    assert cli(capsys, "tenants", "export", *second) == exported

    documented = documented_tenant(page())
    for tenant in yaml.safe_load(exported)["tenants"]:
        assert set(tenant) == set(documented), "export writes every field the page names"
        assert set(tenant["limits"]) <= set(documented["limits"])
        assert key_forms(tenant["keys"]) <= key_forms(documented["keys"])


# The create and update options


@pytest.mark.parametrize("action", ["create", "update"])
def test_every_option_of_the_help_is_on_the_page(
    action: str, capsys: pytest.CaptureFixture[str]
) -> None:
    text = page()
    missing = [" ".join(spellings) for spellings in help_options(capsys, action)
               if not any(named_on_page(text, spelling) for spelling in spellings)]
    assert not missing, f"`fairgate tenants {action}` options not on the page: {missing}"


@pytest.mark.parametrize("action", ["create", "update"])
def test_every_option_the_page_names_exists(
    action: str, capsys: pytest.CaptureFixture[str]
) -> None:
    text = page()
    named = field_options(text) | command_line_options(text, action)
    assert {"--weight", "--slo-ttft-p99", "--disable"} <= named
    exists = {spelling for spellings in help_options(capsys, action) for spelling in spellings}
    stale = sorted(named - exists)
    assert not stale, f"options the page names for `fairgate tenants {action}` it lacks: {stale}"
