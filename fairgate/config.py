"""fairgate.yaml, the whole file: sections `engine`, `gateway`, `database`, `tenants`, `slo`,
`shadow`, `tuner`. Each package validates its own section (`EngineConfig`, `GatewayConfig`);
this module reads the file, turns YAML mistakes into one-line errors with the line number, and
assembles what `fairgate serve` needs (`FairgateConfig`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.config import EngineConfig
from gateway.config import GatewayConfig
from protocol.yaml_files import load_yaml
from tenants.db import DEFAULT_DATABASE_URL

# `tuner` is what `fairgate tune` writes beside `engine` in best.yaml (the winner as another
# engine's own flags); a fairgate server started with `-c best.yaml` does not read it.
SECTIONS = ("engine", "gateway", "database", "tuner")
# Sections DESIGN.md's first plan put in fairgate.yaml, whose settings live elsewhere: named in
# the file they were read by nothing, so a user's SLO or shadow target did nothing, silently.
ELSEWHERE = {
    "tenants": "tenants live in the database: `fairgate tenants import tenants.yaml` "
               "(docs/tenants.md)",
    "slo": "SLO targets are each tenant's: slo_ttft_p99_s, slo_tpot_p99_s and slo_itl_p99_s in "
           "tenants.yaml, or `fairgate tenants update NAME --slo-ttft-p99 S` (docs/tenants.md)",
    "shadow": "shadow targets are gateway.shadow (docs/shadow.md)",
}


def load_config_file(path: str | Path | None) -> dict[str, Any]:
    """The whole file as a mapping ({} when path is None). ValueError for anything malformed."""
    if path is None:
        return {}
    path = Path(path)
    try:
        data = load_yaml(path)  # YamlError, a ValueError: the file's line and what is wrong
    except FileNotFoundError:
        raise ValueError(f"config file {path} not found") from None
    except OSError as exc:
        raise ValueError(f"cannot read config file {path}: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: the top level must be a mapping of sections ({', '.join(SECTIONS)})")
    misplaced = [name for name in ELSEWHERE if name in data]
    if misplaced:
        name = misplaced[0]
        raise ValueError(f"{path}: fairgate.yaml has no section {name!r}: {ELSEWHERE[name]}; "
                         f"its sections are: {', '.join(SECTIONS)}")
    unknown = sorted(set(map(str, data)) - set(SECTIONS))
    if unknown:
        raise ValueError(f"{path}: unknown section(s) {', '.join(unknown)}; "
                         f"sections are: {', '.join(SECTIONS)}")
    return data


def section(data: dict[str, Any], name: str) -> dict[str, Any]:
    value = data.get(name) or {}
    if not isinstance(value, dict):
        raise ValueError(f"config section {name!r} must be a mapping")
    return value


def database_url(data: dict[str, Any]) -> str:
    """The `database` section: a URL, or `{url: ...}`; unset means the default SQLite file."""
    value = data.get("database")
    if isinstance(value, dict):
        value = value.get("url")
    if value is None:
        return DEFAULT_DATABASE_URL
    if not isinstance(value, str) or not value:
        raise ValueError("database must be a database URL string, e.g. "
                         "sqlite:///fairgate.db or postgresql://user@host/db")
    return value


@dataclass(frozen=True)
class FairgateConfig:
    """What `fairgate serve` needs from fairgate.yaml; other sections belong to other tools."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    database: str = DEFAULT_DATABASE_URL

    @classmethod
    def from_dict(cls, data: dict[str, Any],
                  environ: Mapping[str, str] | None = None) -> FairgateConfig:
        """`environ`: the variables that override the file (`fairgate serve` passes os.environ:
        FAIRGATE_ADMIN_KEY, see GatewayConfig.with_environment); None: the file alone."""
        gateway = GatewayConfig.from_dict(section(data, "gateway"))
        return cls(engine=EngineConfig.from_dict(section(data, "engine")),
                   gateway=gateway if environ is None else gateway.with_environment(environ),
                   database=database_url(data))

    @classmethod
    def load(cls, path: str | Path | None,
             environ: Mapping[str, str] | None = None) -> FairgateConfig:
        return cls.from_dict(load_config_file(path), environ)
