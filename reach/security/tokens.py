"""Short-lived tokens: Ed25519 signing keys, the REACH_KEYS store, issuing and verifying JWTs.

The issuer holds the private signing key (in memory, and in a 0600 file under the
store so restarts keep it); every verifier learns the public keys from the KV bucket
REACH_KEYS. Tokens are JWTs signed with EdDSA only: a verifier checks the header's
``alg`` itself before PyJWT sees the token, so ``none``, HS* (including HS256 keyed
with the public key's PEM, the classic key confusion) and RS* never get near a key.

Time comes from an injected clock: PyJWT's own exp/nbf/iat checks (which read the
wall clock) are off, and ``TokenVerifier`` checks them with ``leeway_sec`` of skew.
Verified tokens are cached by their exact text until they expire, so the hot path
costs about a microsecond; failures are never cached.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import logging
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from reach import codec, subjects
from reach.clock import Clock, system_clock
from reach.errors import AuthenticationFailed, CodecError, ConfigurationError
from reach.security.credentials import ClientRecord, read_private_file, write_private_file
from reach.security.revocation import REVOKED_PREFIX, decode_revocation
from reach.transport import Connection, KVBucket, KVEntry

__all__ = [
    "ALGORITHM",
    "DEFAULT_AUDIENCE",
    "DEFAULT_ISSUER",
    "DEFAULT_LEEWAY_SEC",
    "DEFAULT_TTL_SEC",
    "DEFAULT_VERIFIED_CACHE",
    "Claims",
    "KeyChange",
    "KeyRing",
    "KeyStore",
    "PublicKey",
    "SigningKey",
    "TokenIssuer",
    "TokenRejected",
    "TokenVerifier",
    "call_audience",
]

log = logging.getLogger("reach.security")

ALGORITHM: Final = "EdDSA"
DEFAULT_ISSUER: Final = "reach"
DEFAULT_AUDIENCE: Final = "reach"
DEFAULT_TTL_SEC: Final = 7200.0
DEFAULT_LEEWAY_SEC: Final = 30.0
#: tokens a verifier remembers as checked (one Ed25519 check costs ~100-150 µs, a
#: remembered one under 1 µs). More than the tokens a fabric has live at once: a registrar
#: sees every agent's on each heartbeat, and with fewer places than tokens a least-recently-
#: used cache remembers none of them (each is pushed out before it comes round again).
#: About 1.3 kB each, and only live tokens stay (expired ones are let go).
DEFAULT_VERIFIED_CACHE: Final = 65_536
#: longer strings are refused before any parsing
MAX_TOKEN_CHARS: Final = 8192

_KID_RE: Final = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_KEY_PREFIX: Final = "pub."
_PRIVATE_FILE_VERSION: Final = 1


class TokenRejected(AuthenticationFailed):
    """A token failed verification; ``reason`` names the check that failed.

    Reasons: ``bad_format``, ``alg_not_allowed``, ``missing_kid``, ``unknown_kid``,
    ``bad_signature``, ``wrong_issuer``, ``wrong_audience``, ``expired``,
    ``not_yet_valid``, ``missing_claim``, ``bad_claim``, ``bad_level``, ``key_retired``,
    ``revoked``.
    """

    def __init__(self, message: str, *, reason: str) -> None:
        self.reason = reason
        super().__init__(f"token rejected: {message}")


# -- keys --------------------------------------------------------------------------------


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64url(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _raw_public(key: Ed25519PublicKey) -> bytes:
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

    kid: str = Field(pattern=_KID_RE.pattern)
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
            public_key=_b64url(_raw_public(key)),
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
            if not (isinstance(kid, str) and _KID_RE.fullmatch(kid)):
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


# -- tokens ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Claims:
    """What a verified token says about its holder."""

    client_id: str
    agent_id: str | None
    level: int
    roles: frozenset[str]
    exp: float
    nbf: float
    iat: float
    jti: str
    kid: str
    #: whom the token is for: the fabric's control services (DEFAULT_AUDIENCE), or the
    #: instances of one capability (``call_audience``)
    audience: tuple[str, ...] = ()

    def has_role(self, role: str) -> bool:
        return role in self.roles


def call_audience(capability: str, instance: str = "") -> str:
    """The audience of a token for calls to ``capability`` at one ``instance`` (its
    agent id): what that instance accepts on its own subject. A caller's fabric token
    (DEFAULT_AUDIENCE) never travels to callees, and a call token is refused by the
    registrar, the issuer, every other capability's callees and every other instance of
    its own: a callee that keeps what it was sent can present it nowhere but to itself.

    Without ``instance``: a token for the capability's queue group (any instance), used
    only when a caller knows no instance, and accepted only on the queue subject."""
    return f"call:{capability}:{instance}" if instance else f"call:{capability}"


class TokenIssuer:
    """Signs tokens for authenticated clients with the key ring's active key."""

    def __init__(
        self,
        keyring: KeyRing,
        *,
        issuer: str = DEFAULT_ISSUER,
        audience: str = DEFAULT_AUDIENCE,
        ttl_sec: float = DEFAULT_TTL_SEC,
        clock: Clock = system_clock,
    ) -> None:
        if ttl_sec <= 0:
            raise ConfigurationError("token ttl must be positive")
        self.keyring = keyring
        self.issuer = issuer
        self.audience = audience
        self.ttl_sec = ttl_sec
        self._clock = clock

    def issue(self, record: ClientRecord) -> str:
        """A signed JWT for ``record`` (which the caller has authenticated)."""
        return self.issue_with_claims(record)[0]

    def issue_with_claims(
        self,
        record: ClientRecord,
        *,
        audience: str | None = None,
        not_after: float | None = None,
    ) -> tuple[str, Claims]:
        """The token and what it says (``exp`` tells the holder when to renew): for
        ``audience`` (the issuer's own by default), expiring by ``not_after`` at the latest
        (a call token never outlives the fabric token it was exchanged for)."""
        if record.revoked:
            raise AuthenticationFailed(f"client {record.client_id} is revoked")
        key = self.keyring.active
        now = int(self._clock.time())
        exp = now + max(1, int(self.ttl_sec))
        if not_after is not None:
            exp = min(exp, int(not_after))
        aud = self.audience if audience is None else audience
        claims = Claims(
            client_id=record.client_id,
            agent_id=record.agent_id,
            level=record.level,
            roles=frozenset(record.roles),
            exp=float(exp),
            nbf=float(now),
            iat=float(now),
            jti=secrets.token_urlsafe(16),
            kid=key.kid,
            audience=(aud,),
        )
        payload: dict[str, Any] = {
            "iss": self.issuer,
            "aud": aud,
            "sub": record.client_id,
            "lvl": record.level,
            "roles": sorted(record.roles),
            "iat": now,
            "nbf": now,
            "exp": exp,
            "jti": claims.jti,
        }
        if record.agent_id is not None:
            payload["agent_id"] = record.agent_id
        token = jwt.encode(payload, key.private_key, algorithm=ALGORITHM, headers={"kid": key.kid})
        return token, claims

    def rotate(self) -> SigningKey:
        """Rotate the key ring with this issuer's ttl (see also ``KeyStore.rotate``)."""
        return self.keyring.rotate(self.ttl_sec)


KeyLookup = Callable[[str], Ed25519PublicKey | None]

_DECODE_OPTIONS: Final[Any] = {
    "verify_signature": True,
    # checked below against the injected clock and with explicit reasons
    "verify_exp": False,
    "verify_nbf": False,
    "verify_iat": False,
    "verify_iss": False,
    "verify_aud": False,
    "verify_sub": False,
    "verify_jti": False,
    "require": [],
}


def _number(payload: Mapping[str, Any], name: str) -> float:
    value = payload.get(name)
    if value is None:
        raise TokenRejected(f"claim {name} is missing", reason="missing_claim")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TokenRejected(f"claim {name} is not a number", reason="bad_claim")
    return float(value)


class TokenVerifier:
    """Checks tokens: EdDSA only, known kid, signature, iss, aud, exp/nbf with leeway, lvl.

    ``keys`` is a mapping kid → public key (copied; change it with ``add_key`` and
    ``remove_key``, or let ``KeyStore.follow`` do that), or a lookup function asked
    for kids the verifier does not hold itself.
    """

    def __init__(
        self,
        keys: Mapping[str, Ed25519PublicKey] | KeyLookup | None = None,
        *,
        issuer: str = DEFAULT_ISSUER,
        audience: str = DEFAULT_AUDIENCE,
        leeway_sec: float = DEFAULT_LEEWAY_SEC,
        clock: Clock = system_clock,
        cache_size: int = DEFAULT_VERIFIED_CACHE,
    ) -> None:
        self._keys: dict[str, tuple[Ed25519PublicKey, float | None]] = {}
        self._lookup: KeyLookup | None = None
        if callable(keys):
            self._lookup = keys
        elif keys is not None:
            self._keys = {kid: (key, None) for kid, key in keys.items()}
        self.issuer = issuer
        self.audience = audience
        self.leeway_sec = leeway_sec
        self._clock = clock
        self._cache_size = max(0, cache_size)
        # token text → (claims, valid from, valid until), least recently used first
        self._cache: OrderedDict[str, tuple[Claims, float, float]] = OrderedDict()
        # client id → revoked_at: its tokens issued until then are refused (as many as
        # the operators revoked; checked only on the uncached path, see ``revoke``)
        self._revoked: dict[str, float] = {}

    @property
    def kids(self) -> frozenset[str]:
        return frozenset(self._keys)

    def add_key(
        self, kid: str, key: Ed25519PublicKey | PublicKey, *, not_after: float | None = None
    ) -> None:
        """Trust ``key`` for tokens with ``kid``; a retired key only for tokens that expire
        by its ``not_after`` (a PublicKey brings its own)."""
        if isinstance(key, PublicKey):
            not_after = key.not_after
            key = key.key()
        old = self._keys.get(kid)
        self._keys[kid] = (key, not_after)
        if old is not None and (_raw_public(old[0]), old[1]) != (_raw_public(key), not_after):
            self._forget_kid(kid)

    def remove_key(self, kid: str) -> None:
        """Stop trusting ``kid``, including tokens it signed that are already cached."""
        self._keys.pop(kid, None)
        self._forget_kid(kid)

    def clear_cache(self) -> None:
        self._cache.clear()

    def revoke(self, client_id: str, revoked_at: float) -> None:
        """Refuse the tokens of ``client_id`` issued at or before ``revoked_at``, the ones
        already checked and cached included (so the cached path needs no revocation check:
        what is cached afterwards passed it)."""
        self._revoked[client_id] = revoked_at
        for token in [
            t
            for t, (claims, _, _) in self._cache.items()
            if claims.client_id == client_id and claims.iat <= revoked_at
        ]:
            del self._cache[token]

    def unrevoke(self, client_id: str) -> None:
        """Forget a revocation (its record was deleted from REACH_KEYS)."""
        self._revoked.pop(client_id, None)

    @property
    def revoked(self) -> dict[str, float]:
        return dict(self._revoked)

    def _forget_kid(self, kid: str) -> None:
        for token in [t for t, (claims, _, _) in self._cache.items() if claims.kid == kid]:
            del self._cache[token]

    def verify(self, token: str, audience: str | None = None) -> Claims:
        """The token's claims if it is for ``audience`` (the verifier's own by default);
        TokenRejected (an AuthenticationFailed) naming what was wrong."""
        wanted = self.audience if audience is None else audience
        cached = self._cache.get(token) if type(token) is str else None
        if cached is not None:
            claims, valid_from, valid_until = cached
            if valid_from <= self._clock.time() <= valid_until:
                self._cache.move_to_end(token)
                return _for(claims, wanted)
            del self._cache[token]  # expired (or clock went back): check in full, fail below
        claims = self._verify_uncached(token)
        if self._cache_size:
            cache = self._cache
            cache[token] = (claims, claims.nbf - self.leeway_sec, claims.exp + self.leeway_sec)
            # a holder renews its token before it expires and never shows the old one
            # again: what expired leaves from the least recently used end, so the cache
            # holds the live tokens, not every token seen lately
            now = self._clock.time()
            for _ in range(2):
                oldest = next(iter(cache.values()))
                # never the one just added (it may expire between two readings of the clock)
                if oldest[2] >= now or len(cache) == 1:
                    break
                cache.popitem(last=False)
            if len(cache) > self._cache_size:
                cache.popitem(last=False)
        # remembered whoever it is for: a token shown to the wrong audience is refused
        # again without another signature check
        return _for(claims, wanted)

    def _key_for(self, kid: str) -> tuple[Ed25519PublicKey, float | None] | None:
        held = self._keys.get(kid)
        if held is not None:
            return held
        if self._lookup is not None:
            key = self._lookup(kid)
            if key is not None:
                return key, None
        return None

    def _verify_uncached(self, token: str) -> Claims:
        if not isinstance(token, str) or not token:
            raise TokenRejected("not a token", reason="bad_format")
        if len(token) > MAX_TOKEN_CHARS:
            raise TokenRejected(f"longer than {MAX_TOKEN_CHARS} characters", reason="bad_format")
        try:
            header = jwt.get_unverified_header(token)
        except jwt.InvalidTokenError as exc:
            raise TokenRejected(f"not a JWT: {exc}", reason="bad_format") from None
        alg = header.get("alg")
        if alg != ALGORITHM:
            raise TokenRejected(
                f"alg {alg!r} is not allowed, only {ALGORITHM}", reason="alg_not_allowed"
            )
        kid = header.get("kid")
        if not isinstance(kid, str) or not kid:
            raise TokenRejected("header has no kid", reason="missing_kid")
        held = self._key_for(kid)
        if held is None:
            raise TokenRejected(f"unknown signing key {kid[:64]!r}", reason="unknown_kid")
        key, key_not_after = held
        try:
            payload = jwt.decode(token, key, algorithms=[ALGORITHM], options=_DECODE_OPTIONS)
        except jwt.InvalidSignatureError:
            raise TokenRejected("signature does not verify", reason="bad_signature") from None
        except jwt.InvalidTokenError as exc:
            raise TokenRejected(f"cannot decode: {exc}", reason="bad_format") from None
        if not isinstance(payload, dict):  # pragma: no cover - PyJWT only returns dicts
            raise TokenRejected("payload is not an object", reason="bad_format")
        return self._check_claims(payload, kid, key_not_after)

    def _check_claims(
        self, payload: dict[str, Any], kid: str, key_not_after: float | None
    ) -> Claims:
        if payload.get("iss") != self.issuer:
            raise TokenRejected(
                f"issuer {payload.get('iss')!r} is not {self.issuer!r}", reason="wrong_issuer"
            )
        aud = payload.get("aud")
        if isinstance(aud, str) and aud:
            audience: tuple[str, ...] = (aud,)
        elif isinstance(aud, list) and aud and all(isinstance(a, str) and a for a in aud):
            audience = tuple(aud)
        else:
            raise TokenRejected(f"audience {aud!r} is not a name", reason="wrong_audience")
        exp = _number(payload, "exp")
        nbf = _number(payload, "nbf")
        iat = _number(payload, "iat")
        sub = payload.get("sub")
        if not isinstance(sub, str) or not sub:
            raise TokenRejected("claim sub is missing", reason="missing_claim")
        jti = payload.get("jti")
        if not isinstance(jti, str) or not jti:
            raise TokenRejected("claim jti is missing", reason="missing_claim")
        if "lvl" not in payload:
            raise TokenRejected("claim lvl is missing", reason="missing_claim")
        level = payload["lvl"]
        if isinstance(level, bool) or not isinstance(level, int) or not 1 <= level <= 4:
            raise TokenRejected(f"clearance level {level!r} is not 1..4", reason="bad_level")
        agent_id = payload.get("agent_id")
        if agent_id is not None and (not isinstance(agent_id, str) or not agent_id):
            raise TokenRejected("claim agent_id is not a string", reason="bad_claim")
        roles = payload.get("roles", [])
        if not isinstance(roles, list) or not all(isinstance(r, str) for r in roles):
            raise TokenRejected("claim roles is not a list of strings", reason="bad_claim")
        now = self._clock.time()
        if now > exp + self.leeway_sec:
            raise TokenRejected(f"expired {now - exp:.0f}s ago", reason="expired")
        if now < nbf - self.leeway_sec or now < iat - self.leeway_sec:
            raise TokenRejected(
                f"not valid for another {max(nbf, iat) - now:.0f}s", reason="not_yet_valid"
            )
        if key_not_after is not None and exp > key_not_after:
            # a retired key signed a token that outlives it: the key was used after retirement
            raise TokenRejected(f"signing key {kid} is retired", reason="key_retired")
        revoked_at = self._revoked.get(sub)
        if revoked_at is not None and iat <= revoked_at:
            raise TokenRejected(f"client {sub[:64]} is revoked", reason="revoked")
        return Claims(
            client_id=sub,
            agent_id=agent_id,
            level=level,
            roles=frozenset(roles),
            exp=exp,
            nbf=nbf,
            iat=iat,
            jti=jti,
            kid=kid,
            audience=audience,
        )


def _for(claims: Claims, audience: str) -> Claims:
    """``claims`` if the token is for ``audience``, else TokenRejected."""
    if audience not in claims.audience:
        raise TokenRejected(
            f"audience {list(claims.audience)!r} does not include {audience!r}",
            reason="wrong_audience",
        )
    return claims


# -- the key store -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class KeyChange:
    """One change seen on REACH_KEYS: a key published (or updated), or removed (key=None)."""

    kid: str
    key: PublicKey | None


def _encode_public(pub: PublicKey) -> bytes:
    return codec.encode(pub.model_dump(mode="json"), checked=False)


def _decode_public(data: bytes) -> PublicKey:
    try:
        pub = PublicKey.model_validate(codec.decode(data))
        pub.key()
    except (ValidationError, ConfigurationError) as exc:
        raise CodecError(f"not a valid public key record: {exc}") from None
    return pub


def _key_change(entry: KVEntry) -> KeyChange | None:
    """What a ``pub.<kid>`` record says; None (logged) if it cannot be read."""
    kid = entry.key[len(_KEY_PREFIX) :]
    if entry.deleted or not entry.value:
        return KeyChange(kid, None)
    try:
        pub = _decode_public(entry.value)
    except CodecError as exc:
        log.warning("skipping key record %s: %s", entry.key, exc)
        return None
    if pub.kid != kid:
        log.warning("skipping key record %s: it names kid %s", entry.key, pub.kid)
        return None
    return KeyChange(kid, pub)


def _follow_revocation(verifier: TokenVerifier, entry: KVEntry) -> None:
    client_id = entry.key[len(REVOKED_PREFIX) :]
    if entry.deleted or not entry.value:
        verifier.unrevoke(client_id)
        return
    try:
        revocation = decode_revocation(entry.value)
    except CodecError as exc:
        log.warning("skipping revocation record %s: %s", entry.key, exc)
        return
    if revocation.client_id != client_id:
        log.warning("skipping revocation record %s: it names %s", entry.key, revocation.client_id)
        return
    verifier.revoke(client_id, revocation.revoked_at)


class KeyStore:
    """Public verification keys in REACH_KEYS (key ``pub.<kid>``); private keys never go here."""

    def __init__(self, bucket: KVBucket, *, clock: Clock = system_clock) -> None:
        self.bucket = bucket
        self._clock = clock

    @classmethod
    async def open(
        cls,
        conn: Connection,
        *,
        create: bool = True,
        replicas: int = 1,
        clock: Clock = system_clock,
    ) -> KeyStore:
        bucket = await conn.key_value(
            subjects.KEYS_BUCKET, create=create, replicas=replicas, public=True
        )
        return cls(bucket, clock=clock)

    async def publish(self, pub: PublicKey) -> None:
        await self.bucket.put(_KEY_PREFIX + pub.kid, _encode_public(pub))

    async def publish_ring(self, ring: KeyRing) -> None:
        """Publish every public key of ``ring`` (others' keys in the bucket are left alone)."""
        for pub in ring.public_keys():
            await self.publish(pub)

    async def get(self, kid: str) -> PublicKey | None:
        if not _KID_RE.fullmatch(kid):
            return None
        entry = await self.bucket.get(_KEY_PREFIX + kid)
        if entry is None or not entry.value:
            return None
        return _decode_public(entry.value)

    async def delete(self, kid: str) -> None:
        await self.bucket.delete(_KEY_PREFIX + kid)

    async def all(self) -> list[PublicKey]:
        """Every published key; unreadable records are skipped (and logged)."""
        keys: list[PublicKey] = []
        async with contextlib.aclosing(self.watch()) as changes:
            async for change in changes:
                if change is None:
                    break
                if change.key is not None:
                    keys.append(change.key)
        return keys

    async def prune(self) -> list[str]:
        """Delete retired keys whose tokens have all expired; returns their kids."""
        now = self._clock.time()
        gone = [pub.kid for pub in await self.all() if pub.expired(now)]
        for kid in gone:
            await self.delete(kid)
        return gone

    async def watch(self) -> AsyncGenerator[KeyChange | None, None]:
        """Every key, then ``None`` once caught up, then every change."""
        async for entry in self.bucket.watch(_KEY_PREFIX + "*"):
            if entry is None:
                yield None
                continue
            change = _key_change(entry)
            if change is not None:
                yield change

    async def follow(self, verifier: TokenVerifier, ready: asyncio.Event | None = None) -> None:
        """Keep ``verifier``'s keys and revocations equal to the bucket's until cancelled
        (run it as a task); ``ready`` is set once the current ones are loaded. Returns if
        the watch ends."""
        # one watch of the whole bucket: a revocation reaches the verifier as fast as a key
        async for entry in self.bucket.watch(">"):
            if entry is None:
                if ready is not None:
                    ready.set()
            elif entry.key.startswith(REVOKED_PREFIX):
                _follow_revocation(verifier, entry)
            elif entry.key.startswith(_KEY_PREFIX) and (change := _key_change(entry)):
                if change.key is None:
                    verifier.remove_key(change.kid)
                else:
                    verifier.add_key(change.kid, change.key)

    async def rotate(
        self,
        ring: KeyRing,
        token_ttl: float,
        *,
        settle_sec: float = 1.0,
        leeway: float = DEFAULT_LEEWAY_SEC,
    ) -> SigningKey:
        """Rotate without failed verifications: publish the next key, let verifiers learn
        it for ``settle_sec``, then sign with it and publish the old one as retired."""
        staged = ring.stage()
        await self.publish(staged.public())
        if settle_sec > 0:
            await asyncio.sleep(settle_sec)
        new = ring.rotate(token_ttl, leeway=leeway)
        await self.publish_ring(ring)
        return new
