"""Short-lived tokens: issuing JWTs signed with Ed25519, and where every token name lives.

The issuer holds the private signing key (``signingkeys``); every verifier learns the
public keys from the KV bucket REACH_KEYS (``keystore``) and checks tokens
(``tokenverifier``) on an injected clock. ``TokenIssuer`` signs a token for a client its
caller has authenticated. Every name of those modules is importable from here.
"""

from __future__ import annotations

import secrets
from typing import Any

import jwt

from reach.clock import Clock, system_clock
from reach.errors import AuthenticationFailed, ConfigurationError
from reach.security.claims import (
    ALGORITHM,
    DEFAULT_AUDIENCE,
    DEFAULT_ISSUER,
    DEFAULT_LEEWAY_SEC,
    DEFAULT_TTL_SEC,
    MAX_TOKEN_CHARS,
    Claims,
    TokenRejected,
    call_audience,
)
from reach.security.credentials import ClientRecord
from reach.security.keystore import KeyChange, KeyStore
from reach.security.signingkeys import KeyRing, PublicKey, SigningKey
from reach.security.tokenverifier import DEFAULT_VERIFIED_CACHE, KeyLookup, TokenVerifier

__all__ = [
    "ALGORITHM",
    "DEFAULT_AUDIENCE",
    "DEFAULT_ISSUER",
    "DEFAULT_LEEWAY_SEC",
    "DEFAULT_TTL_SEC",
    "DEFAULT_VERIFIED_CACHE",
    "MAX_TOKEN_CHARS",
    "Claims",
    "KeyChange",
    "KeyLookup",
    "KeyRing",
    "KeyStore",
    "PublicKey",
    "SigningKey",
    "TokenIssuer",
    "TokenRejected",
    "TokenVerifier",
    "call_audience",
]


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
        actor: ClientRecord | None = None,
    ) -> tuple[str, Claims]:
        """The token and what it says (``exp`` tells the holder when to renew): for
        ``audience`` (the issuer's own by default), expiring by ``not_after`` at the latest
        (a call token never outlives the fabric token it was exchanged for).

        ``actor``: the client making the calls for ``record`` (a gateway): the token
        names it as ``act.sub`` (RFC 8693), and its level is the lower of the two, so a
        gateway never lends a caller more clearance than it holds itself."""
        if record.revoked:
            raise AuthenticationFailed(f"client {record.client_id} is revoked")
        if actor is not None and actor.revoked:
            raise AuthenticationFailed(f"client {actor.client_id} is revoked")
        key = self.keyring.active
        now = int(self._clock.time())
        exp = now + max(1, int(self.ttl_sec))
        if not_after is not None:
            exp = min(exp, int(not_after))
        aud = self.audience if audience is None else audience
        level = record.level if actor is None else min(record.level, actor.level)
        claims = Claims(
            client_id=record.client_id,
            agent_id=record.agent_id,
            level=level,
            roles=frozenset(record.roles),
            exp=float(exp),
            nbf=float(now),
            iat=float(now),
            jti=secrets.token_urlsafe(16),
            kid=key.kid,
            audience=(aud,),
            actor=actor.client_id if actor is not None else None,
        )
        payload: dict[str, Any] = {
            "iss": self.issuer,
            "aud": aud,
            "sub": record.client_id,
            "lvl": level,
            "roles": sorted(record.roles),
            "iat": now,
            "nbf": now,
            "exp": exp,
            "jti": claims.jti,
        }
        if record.agent_id is not None:
            payload["agent_id"] = record.agent_id
        if actor is not None:
            payload["act"] = {"sub": actor.client_id}
        token = jwt.encode(payload, key.private_key, algorithm=ALGORITHM, headers={"kid": key.kid})
        return token, claims

    def rotate(self) -> SigningKey:
        """Rotate the key ring with this issuer's ttl (see also ``KeyStore.rotate``)."""
        return self.keyring.rotate(self.ttl_sec)
