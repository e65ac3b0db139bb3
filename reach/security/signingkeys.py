"""Ed25519 signing keys: the issuer's private keys, their public parts as published in
REACH_KEYS, and the key ring that rotates them without failed verifications.

The private key stays with the issuer, in memory and in a 0600 file under the store so
that restarts keep it; only public keys go into REACH_KEYS (``keystore``).
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import secrets
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)
from pydantic import BaseModel, ConfigDict, Field

from reach.clock import Clock, system_clock
from reach.errors import ConfigurationError
from reach.security.claims import ALGORITHM, DEFAULT_LEEWAY_SEC
from reach.security.credentials import read_private_file, write_private_file

__all__ = ["KID_PATTERN", "KeyRing", "PublicKey", "SigningKey", "raw_public"]

#: what a key id may be
KID_PATTERN: Final = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_PRIVATE_FILE_VERSION: Final = 1


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64url(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def raw_public(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _new_kid(now: float) -> str:
    # sortable by creation day for operators, unique by the random part
    return time.strftime("%Y%m%d", time.gmtime(now)) + "-" + secrets.token_hex(6)


class PublicKey(BaseModel):
    """A verification key as published in REACH_KEYS (key ``pub.<kid>``).

    ``not_after`` is None while the key signs tokens; once retired, it is the moment
    the last token it signed has expired (plus leeway), after which it may be pruned.
    """

    # extra fields are ignored so older verifiers keep reading keys that newer issuers publish
    model_config = ConfigDict(extra="ignore", frozen=True)

    kid: str = Field(pattern=KID_PATTERN.pattern)
    alg: str = Field(ALGORITHM, pattern="^EdDSA$")
    public_key: str = Field(description="raw Ed25519 public key, base64url without padding")
    created_at: float
    not_after: float | None = None

    @classmethod
    def of(
        cls, kid: str, key: Ed25519PublicKey, *, created_at: float, not_after: float | None = None
    ) -> PublicKey:
        return cls(
            kid=kid,
            public_key=_b64url(raw_public(key)),
            created_at=created_at,
            not_after=not_after,
        )

    def key(self) -> Ed25519PublicKey:
        """The key object; ConfigurationError if ``public_key`` is not a raw Ed25519 key."""
        try:
            raw = _unb64url(self.public_key)
            return Ed25519PublicKey.from_public_bytes(raw)
        except (ValueError, binascii.Error):
            raise ConfigurationError(f"public key {self.kid} is not an Ed25519 key") from None

    def pem(self) -> str:
        return (
            self.key()
            .public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
            .decode("ascii")
        )

    def expired(self, now: float) -> bool:
        return self.not_after is not None and now > self.not_after


@dataclass(frozen=True, slots=True)
class SigningKey:
    """An Ed25519 private key with its id; stays with the issuer, never goes into KV."""

    kid: str
    private_key: Ed25519PrivateKey
    created_at: float

    @classmethod
    def generate(cls, clock: Clock = system_clock) -> SigningKey:
        now = clock.time()
        return cls(_new_kid(now), Ed25519PrivateKey.generate(), now)

    def public(self, *, not_after: float | None = None) -> PublicKey:
        return PublicKey.of(
            self.kid,
            self.private_key.public_key(),
            created_at=self.created_at,
            not_after=not_after,
        )

    def save_private(self, path: str | Path) -> None:
        """Write the private key (PKCS#8 PEM inside JSON) atomically with mode 0600."""
        pem = self.private_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ).decode("ascii")
        body = {
            "version": _PRIVATE_FILE_VERSION,
            "kid": self.kid,
            "alg": ALGORITHM,
            "created_at": self.created_at,
            "private_key": pem,
        }
        write_private_file(path, (json.dumps(body, indent=2) + "\n").encode("utf-8"))

    @classmethod
    def load_private(cls, path: str | Path) -> SigningKey:
        """Read a key written by ``save_private``; ConfigurationError naming the file otherwise."""
        data = read_private_file(path, "signing key file")
        try:
            body: Any = json.loads(data.decode("utf-8"))
            kid, created_at, pem = body["kid"], body["created_at"], body["private_key"]
            if not (isinstance(kid, str) and KID_PATTERN.fullmatch(kid)):
                raise ValueError("bad kid")
            if not isinstance(created_at, int | float) or isinstance(created_at, bool):
                raise ValueError("bad created_at")
            key = serialization.load_pem_private_key(pem.encode("ascii"), password=None)
        except (UnicodeError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigurationError(f"signing key file {path} is invalid: {exc}") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise ConfigurationError(f"signing key file {path} does not hold an Ed25519 key")
        return cls(kid, key, float(created_at))


class KeyRing:
    """The issuer's keys: the active signing key, maybe a staged next one, retired public keys.

    Rotation without failed verifications: ``stage()`` a next key, publish its public
    part, give verifiers a moment to learn it, then ``rotate()`` (``KeyStore.rotate``
    does all of that).
    """

    def __init__(
        self,
        active: SigningKey,
        retired: Iterable[PublicKey] = (),
        *,
        clock: Clock = system_clock,
    ) -> None:
        self._active = active
        self._staged: SigningKey | None = None
        self._retired: dict[str, PublicKey] = {k.kid: k for k in retired if k.kid != active.kid}
        self._clock = clock

    @classmethod
    def generate(cls, clock: Clock = system_clock) -> KeyRing:
        return cls(SigningKey.generate(clock), clock=clock)

    @classmethod
    def load_or_generate(cls, path: str | Path, clock: Clock = system_clock) -> KeyRing:
        """The key saved at ``path`` (so restarts keep it), or a new one saved there."""
        target = Path(path)
        if target.exists():
            return cls(SigningKey.load_private(target), clock=clock)
        ring = cls.generate(clock)
        ring.active.save_private(target)
        return ring

    @property
    def active(self) -> SigningKey:
        return self._active

    @property
    def staged(self) -> SigningKey | None:
        return self._staged

    def stage(self) -> SigningKey:
        """Create (once) the key the next ``rotate`` will activate; verifiers may learn it now."""
        if self._staged is None:
            self._staged = SigningKey.generate(self._clock)
        return self._staged

    def rotate(self, token_ttl: float, *, leeway: float = DEFAULT_LEEWAY_SEC) -> SigningKey:
        """Sign with the staged (or a new) key; the old one verifies until its tokens expire."""
        new = self._staged or SigningKey.generate(self._clock)
        self._staged = None
        old = self._active
        not_after = self._clock.time() + token_ttl + leeway
        self._retired[old.kid] = old.public(not_after=not_after)
        self._active = new
        return new

    def public_keys(self) -> list[PublicKey]:
        """Every key a verifier should accept: active, staged, then retired ones."""
        keys = [self._active.public()]
        if self._staged is not None:
            keys.append(self._staged.public())
        keys.extend(self._retired.values())
        return keys

    def prune(self) -> list[str]:
        """Forget retired keys whose tokens have all expired; returns their kids."""
        now = self._clock.time()
        gone = [kid for kid, pub in self._retired.items() if pub.expired(now)]
        for kid in gone:
            del self._retired[kid]
        return gone
