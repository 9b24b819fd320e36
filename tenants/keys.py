"""API key format and hashing.

A key is `fg-` plus 43 URL-safe characters (32 random bytes). Only its hash is stored:
`sha256:<hex>`, or `hmac-sha256:<hex>` when the server has a secret (a stolen database then
cannot be brute-forced offline without the secret as well).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import re
import secrets

KEY_PREFIX = "fg-"
KEY_BODY_LEN = 43  # secrets.token_urlsafe(32): 32 bytes in URL-safe base64, unpadded
DISPLAY_PREFIX_LEN = 10  # "fg-" + 7 characters: enough to tell keys apart, useless to guess
KEY_RE = re.compile(rf"{re.escape(KEY_PREFIX)}[A-Za-z0-9_-]{{{KEY_BODY_LEN}}}")
_HASH_RE = re.compile(r"^(sha256|hmac-sha256):[0-9a-f]{64}$")
KEY_ID_PATTERN = r"^key_[0-9a-f]{16}$"  # a key's public id (the admin API names keys by it)


def new_key_id() -> str:
    return "key_" + secrets.token_hex(8)


def generate_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(plaintext: str, secret: str | bytes | None = None) -> str:
    """The stored form of a key: SHA-256, or HMAC-SHA256 under `secret`."""
    data = plaintext.encode()
    if secret is None:
        return "sha256:" + hashlib.sha256(data).hexdigest()
    mac = _keyed(secret).copy()
    mac.update(data)
    return "hmac-sha256:" + mac.hexdigest()


@functools.lru_cache(maxsize=4)
def _keyed(secret: str | bytes) -> hmac.HMAC:
    """An HMAC-SHA256 keyed with `secret` and fed nothing yet, copied for each key hashed:
    every request's key is hashed, and keying an HMAC anew took a third more than a copy."""
    return hmac.new(secret.encode() if isinstance(secret, str) else secret,
                    digestmod=hashlib.sha256)


def hash_scheme(stored_hash: str) -> str:
    return stored_hash.split(":", 1)[0]


def is_valid_hash(stored_hash: object) -> bool:
    return isinstance(stored_hash, str) and bool(_HASH_RE.match(stored_hash))


def looks_like_key(plaintext: object) -> bool:
    """The exact shape `generate_key` makes (prefix, length, alphabet): anything else is not a
    fairgate key, answered without hashing it or asking the database."""
    return isinstance(plaintext, str) and KEY_RE.fullmatch(plaintext) is not None


def display_prefix(plaintext: str) -> str:
    return plaintext[:DISPLAY_PREFIX_LEN]


def hashes_equal(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())
