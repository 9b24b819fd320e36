"""Credentials never reach a log line: the redaction every fairgate server's log handlers
apply, and the check every test runs over its own records."""

from __future__ import annotations

import logging
import sys

from hypothesis import given
from hypothesis import strategies as st

from protocol.serving import RedactingFilter, redact
from tenants.keys import generate_key
from tests.support.credentials import leaked_credentials


def record(message: str, *args: object, exc: BaseException | None = None) -> logging.LogRecord:
    exc_info = (type(exc), exc, exc.__traceback__) if exc is not None else None
    return logging.LogRecord("aiohttp.server", logging.ERROR, __file__, 1, message, args,
                             exc_info)


def test_the_log_check_finds_a_key() -> None:
    key = generate_key()
    assert leaked_credentials([record("got %s", key)])
    assert leaked_credentials([record("failed", exc=ValueError(f"b'Bearer {key}'"))])
    assert not leaked_credentials([record("tenant=acme status=200")])


@given(st.text(max_size=40), st.text(max_size=40))
def test_redact_removes_every_key_whatever_surrounds_it(before: str, after: str) -> None:
    key = generate_key()
    for spelled in (key, f"Bearer {key}", f"b'Bearer {key}xxxx'", f"bearer%20{key}"):
        text = redact(before + spelled + after)
        assert key not in text and key[3:] not in text


def test_bearer_tokens_of_any_shape_are_redacted() -> None:
    assert redact("Authorization: Bearer sk-some-other-token") == \
        "Authorization: Bearer [redacted]"
    assert redact("Basic dXNlcjpwYXNz, then") == "Basic [redacted], then"


def test_the_filter_redacts_messages_arguments_and_tracebacks() -> None:
    key = generate_key()
    try:
        raise RuntimeError(f"LineTooLong: b'Bearer {key}'")
    except RuntimeError as exc:
        rec = record("Error handling request from %s: %s", "127.0.0.1", key, exc=exc)
    assert RedactingFilter().filter(rec)
    formatted = logging.Formatter().format(rec)
    assert key not in formatted and "[redacted]" in formatted
    assert "RuntimeError" in formatted  # the traceback is still there, minus the key
    assert not leaked_credentials([rec])


def test_setup_logging_installs_the_filter_on_every_root_handler() -> None:
    from protocol.serving import install_redaction

    root = logging.getLogger()
    handler = logging.StreamHandler(sys.stderr)
    root.addHandler(handler)
    try:
        install_redaction()
        assert any(isinstance(f, RedactingFilter) for f in handler.filters)
    finally:
        root.removeHandler(handler)
