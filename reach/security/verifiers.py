"""What REACH_CREDENTIALS stores in place of a secret: a verifier of it.

Every secret is 256 random bits from ``new_secret()``; nothing accepts a secret a person
chose. A slow hash protects guessable passwords by making each guess expensive; against
2**256 possibilities it adds nothing but work for the gate, which an outsider can make it
do at will. So a record stores a fast verifier, ``hs256$<salt>$<digest>``: HMAC-SHA-256
of the secret keyed with a per-record random salt (reading the bucket still reveals no
secret, and equal secrets never look equal).
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import hmac
import secrets
from typing import Final

from reach.errors import ConfigurationError

__all__ = [
    "FAST_SCHEME",
    "MIN_SECRET_CHARS",
    "dummy_verifier",
    "hash_secret",
    "new_secret",
    "verify_secret",
]

FAST_SCHEME: Final = "hs256"
#: ``new_secret()`` makes 43 characters; anything much shorter was not made by it
MIN_SECRET_CHARS: Final = 32
_MAX_SECRET_CHARS: Final = 1024
_SALT_BYTES: Final = 16
_HASH_BYTES: Final = 32


def new_secret() -> str:
    """A fresh random secret (256 bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _encode(secret: str) -> bytes | None:
    if not isinstance(secret, str) or not secret or len(secret) > _MAX_SECRET_CHARS:
        return None
    try:
        return secret.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates
        return None


def _hs256(secret: bytes, salt: bytes) -> bytes:
    return hmac.digest(salt, secret, hashlib.sha256)


def hash_secret(secret: str) -> str:
    """The fast verifier of a secret made by ``new_secret()``: ``hs256$<salt>$<digest>``.

    A short secret is refused: a fast verifier is only safe for secrets nobody can guess.
    """
    if not isinstance(secret, str) or len(secret) < MIN_SECRET_CHARS:
        raise ConfigurationError(
            f"a secret must be at least {MIN_SECRET_CHARS} random characters (new_secret())"
        )
    data = _encode(secret)
    if data is None:
        raise ConfigurationError("a secret must be valid Unicode text of at most 1024 chars")
    salt = secrets.token_bytes(_SALT_BYTES)
    return f"{FAST_SCHEME}${_b64(salt)}${_b64(_hs256(data, salt))}"


def _b64decode(text: str) -> bytes | None:
    try:
        return base64.b64decode(text, validate=True)
    except (ValueError, binascii.Error):
        return None


def _verify_fast(secret: bytes, parts: list[str]) -> bool:
    if len(parts) != 3:
        return False
    salt, expected = _b64decode(parts[1]), _b64decode(parts[2])
    if salt is None or expected is None or len(salt) < 8 or len(expected) != _HASH_BYTES:
        return False
    return hmac.compare_digest(_hs256(secret, salt), expected)


def verify_secret(secret: str, encoded: str) -> bool:
    """Whether ``secret`` matches the verifier ``encoded``; False, never an error, for a
    malformed verifier or secret."""
    if not isinstance(encoded, str):
        return False
    data = _encode(secret)
    if data is None:
        return False
    parts = encoded.split("$")
    return parts[0] == FAST_SCHEME and _verify_fast(data, parts)


@functools.cache
def dummy_verifier() -> str:
    """Checked against for unknown client ids, so they cost what a wrong secret costs."""
    return hash_secret(new_secret())
