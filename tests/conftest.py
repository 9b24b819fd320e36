"""Every test greps its own log records: no API key or admin key may appear in any of them
(issue 13: credentials are redacted from every log line). pytest captures records at INFO and
above (`log_level` in pyproject.toml), the levels a deployment logs at.

Every test also starts without the developer's FAIRGATE_ADMIN_KEY and FAIRGATE_KEY_SECRET: a
`fairgate serve` a test starts inherits the environment, and either would override what the
test configured. And every test runs on the event loop the one before it ran on: a test that
runs `fairgate serve` or `fairgate engine` in this process installs uvloop's policy
(`engine.server.install_fast_event_loop`), which is put back after it, so which loop a test
gets does not depend on which tests its worker ran first."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from tests.support.credentials import leaked_credentials


@pytest.fixture(autouse=True)
def no_secrets_from_the_shell(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("FAIRGATE_ADMIN_KEY", "FAIRGATE_KEY_SECRET"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(autouse=True)
def no_credential_in_logs(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    yield
    leaked = leaked_credentials(caplog.records)
    assert not leaked, f"a credential reached the log: {leaked}"


@pytest.fixture(autouse=True)
def the_same_event_loop_policy() -> Iterator[None]:
    policy = asyncio.get_event_loop_policy()
    yield
    asyncio.set_event_loop_policy(policy)
