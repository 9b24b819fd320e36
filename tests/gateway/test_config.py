"""fairgate.yaml's gateway section: defaults, and one clear error per mistake."""

from __future__ import annotations

from pathlib import Path

import pytest

from fairgate.config import FairgateConfig
from gateway.config import ADMIN_KEY_ENV, GatewayConfig


def test_defaults() -> None:
    config = FairgateConfig.from_dict({})
    assert (config.gateway.host, config.gateway.port) == ("127.0.0.1", 8080)
    assert config.gateway.backends == () and config.gateway.dispatch == "fair"
    assert config.engine.model == "random:tiny" and config.database.startswith("sqlite")


def test_file_with_backends(tmp_path: Path) -> None:
    path = tmp_path / "fairgate.yaml"
    path.write_text("database: sqlite:///x.db\ngateway:\n  port: 9000\n  dispatch: fcfs\n"
                    "  backends:\n    - url: http://127.0.0.1:8001\n    - http://h:2/v1\n")
    config = FairgateConfig.load(path)
    assert config.gateway.port == 9000 and config.gateway.dispatch == "fcfs"
    assert [b.base_url for b in config.gateway.backends] == ["http://127.0.0.1:8001", "http://h:2"]
    assert config.database == "sqlite:///x.db"


@pytest.mark.parametrize(("values", "message"), [
    ({"prot": 1}, "unknown gateway setting"),
    ({"port": "80"}, "gateway.port"),
    ({"dispatch": "lottery"}, "gateway.dispatch must be one of fair | fcfs"),
    ({"queue_timeout_s": 0}, "gateway.queue_timeout_s"),
    ({"max_body_bytes": True}, "gateway.max_body_bytes"),
    ({"admin_key": "short"}, "at least 16"),
    ({"backends": [{"url": "ftp://x"}]}, "must start with http"),
    ({"backends": [{"url": "http://h:abc"}]}, "needs a host and a numeric port"),
    ({"backends": [{"url": "http://"}]}, "needs a host"),
    ({"backends": [{"url": "http://x", "kind": "grpc"}]}, "kind must be one of"),
    ({"backends": [{"host": "x"}]}, "unknown gateway.backends setting"),
    ({"backends": "http://x"}, "must be a list"),
])
def test_errors_name_the_key(values: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GatewayConfig.from_dict(values)


def test_database_must_be_a_url() -> None:
    with pytest.raises(ValueError, match="database must be"):
        FairgateConfig.from_dict({"database": 5})


FILE_KEY = "admin-key-from-the-file"
ENV_KEY = "admin-key-from-the-environment"


@pytest.mark.parametrize(("environ", "expected"), [
    (None, FILE_KEY),  # the file alone
    ({}, FILE_KEY),
    ({ADMIN_KEY_ENV: ""}, FILE_KEY),  # set but empty: as if unset
    ({ADMIN_KEY_ENV: ENV_KEY}, ENV_KEY),  # it wins over the file
])
def test_the_environment_admin_key_wins_over_the_file(
        tmp_path: Path, environ: dict[str, str] | None, expected: str) -> None:
    path = tmp_path / "fairgate.yaml"
    path.write_text(f"gateway:\n  admin_key: {FILE_KEY}\n")
    assert FairgateConfig.load(path, environ).gateway.admin_key == expected


def test_the_environment_admin_key_alone_turns_the_admin_api_on() -> None:
    assert FairgateConfig.from_dict({}).gateway.admin_key is None
    config = FairgateConfig.from_dict({}, {ADMIN_KEY_ENV: ENV_KEY})
    assert config.gateway.admin_key == ENV_KEY


def test_a_short_environment_admin_key_is_the_same_error_naming_the_variable() -> None:
    with pytest.raises(ValueError) as configured:
        GatewayConfig(admin_key="short")
    with pytest.raises(ValueError) as from_env:
        GatewayConfig().with_environment({ADMIN_KEY_ENV: "short"})
    assert str(configured.value) == "gateway.admin_key must be a string of at least 16 characters"
    assert str(from_env.value) == str(configured.value).replace("gateway.admin_key",
                                                                ADMIN_KEY_ENV)
