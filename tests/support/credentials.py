"""Finding credentials in log records (tests/conftest.py runs it after every test)."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable

# a fairgate key (tenants.keys: "fg-" + 43 URL-safe characters), and the admin key the gateway
# tests configure
CREDENTIAL = re.compile(r"fg-[A-Za-z0-9_-]{43}|admin-key-0123456789")


def leaked_credentials(records: Iterable[logging.LogRecord]) -> list[str]:
    """One line per record whose message or traceback holds a credential."""
    leaked = []
    for record in records:
        text = record.getMessage() + (record.exc_text or "")
        if record.exc_info and record.exc_info[1] is not None:
            text += repr(record.exc_info[1])
        if CREDENTIAL.search(text):
            leaked.append(f"{record.name} {record.levelname}: {text[:200]}")
    return leaked
