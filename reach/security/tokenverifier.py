"""Checking tokens: EdDSA only, a known key, the signature, then every claim against an
injected clock; what passed is remembered until it expires.

A verifier checks the header's ``alg`` itself before PyJWT sees the token, so ``none``,
HS* (including HS256 keyed with the public key's PEM, the classic key confusion) and RS*
never get near a key. PyJWT's own exp/nbf/iat checks (which read the wall clock) are
off: ``TokenVerifier`` checks them with ``leeway_sec`` of skew on its clock. Verified
tokens are cached by their exact text until they expire, so the hot path is a
dictionary lookup; failures are never cached.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any, Final

import jwt
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from reach.clock import Clock, system_clock
from reach.security.claims import (
    ALGORITHM,
    DEFAULT_AUDIENCE,
    DEFAULT_ISSUER,
    DEFAULT_LEEWAY_SEC,
    MAX_TOKEN_CHARS,
    Claims,
    TokenRejected,
)
from reach.security.signingkeys import PublicKey, raw_public

__all__ = ["DEFAULT_VERIFIED_CACHE", "KeyLookup", "TokenVerifier"]

#: tokens a verifier remembers as checked (a signature check costs far more than a
#: remembered one). More than the tokens a fabric has live at once: a registrar
#: sees every agent's on each heartbeat, and with fewer places than tokens a least-recently-
#: used cache remembers none of them (each is pushed out before it comes round again).
#: Only live tokens stay (expired ones are let go).
DEFAULT_VERIFIED_CACHE: Final = 65_536


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
        if old is not None and (raw_public(old[0]), old[1]) != (raw_public(key), not_after):
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
        audience = _audience(payload)
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
        actor = _actor(payload)
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
        if actor is not None:
            actor_revoked = self._revoked.get(actor)
            if actor_revoked is not None and iat <= actor_revoked:
                raise TokenRejected(f"client {actor[:64]} is revoked", reason="revoked")
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
            actor=actor,
        )


def _actor(payload: Mapping[str, Any]) -> str | None:
    """The client acting for the subject (RFC 8693 ``act``: an object whose ``sub`` names
    it), None without one."""
    if "act" not in payload:
        return None
    act = payload["act"]
    sub = act.get("sub") if isinstance(act, dict) else None
    if not isinstance(sub, str) or not sub:
        raise TokenRejected("claim act has no sub", reason="bad_claim")
    return sub


def _audience(payload: Mapping[str, Any]) -> tuple[str, ...]:
    """Whom the token is for: its ``aud``, one name or a list of them."""
    aud = payload.get("aud")
    if isinstance(aud, str) and aud:
        return (aud,)
    if isinstance(aud, list) and aud and all(isinstance(a, str) and a for a in aud):
        return tuple(aud)
    raise TokenRejected(f"audience {aud!r} is not a name", reason="wrong_audience")


def _for(claims: Claims, audience: str) -> Claims:
    """``claims`` if the token is for ``audience``, else TokenRejected."""
    if audience not in claims.audience:
        raise TokenRejected(
            f"audience {list(claims.audience)!r} does not include {audience!r}",
            reason="wrong_audience",
        )
    return claims
