"""The token issuer: client id + secret on ``reach.v1.auth.token`` → a short-lived JWT.

Run by ``reach up`` next to the registrar, on a connection of its own. The signing key
stays in a 0600 file under the store directory; its public part is published to
REACH_KEYS so every agent can verify tokens without it.

Each client may ask ``TOKEN_RATE`` times a second (``TOKEN_BURST`` at once, enough for a
client that calls many instances at its start): the client is the NATS user the server
names in the request's ``Nats-Request-Info`` header (``reach.security.accounts``), not
anything the request says, so one credential flooding the subject is answered
``rate_limited`` before its requests are decoded, and cannot spend another's budget.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from reach.clock import Clock, system_clock
from reach.errors import AuthenticationFailed, CodecError, ContractError, ReachError
from reach.security.accounts import requester
from reach.security.credcache import CredentialCache
from reach.security.credentials import (
    ROLE_ADMIN,
    ROLE_GATEWAY,
    ClientRecord,
    CredentialsFile,
    CredentialsRejected,
    CredentialStore,
)
from reach.security.ratelimit import RateByKey
from reach.security.refusals import RefusalLog
from reach.security.tokenexchange import TokenReply, TokenRequest
from reach.security.tokens import (
    DEFAULT_TTL_SEC,
    Claims,
    KeyRing,
    KeyStore,
    SigningKey,
    TokenIssuer,
    TokenVerifier,
    call_audience,
)
from reach.tasks import cancel_and_wait
from reach.transport import Connection, Message, Subscription
from reach.wire import envelope, subjects
from reach.wire.modelcodec import decode_model, encode_model

__all__ = ["TokenService", "ensure_first_credentials"]

log = logging.getLogger("reach.issuer")

#: token requests a second one client may make, and at once
TOKEN_RATE = 50.0
TOKEN_BURST = 500.0
#: how long a token exchange waits for the credential as the bucket holds it now (a
#: revocation acked a moment ago counts) before it takes the record of the cache that
#: follows the bucket: a call must not wait out its deadline on a busy JetStream
FRESH_READ_SEC = 0.2


class TokenService:
    """Answers ``reach.v1.auth.token``; ``rotate()`` adds a new signing key."""

    def __init__(
        self,
        conn: Connection,
        *,
        key_file: Path,
        replicas: int = 1,
        ttl_sec: float = DEFAULT_TTL_SEC,
        clock: Clock = system_clock,
    ) -> None:
        self._conn = conn
        self._key_file = key_file
        self._replicas = replicas
        self._ttl = ttl_sec
        self._clock = clock
        self._sub: Subscription | None = None
        self._rotate_sub: Subscription | None = None
        self._verifier: TokenVerifier | None = None
        self._follow: asyncio.Task[None] | None = None
        self.credentials: CredentialStore | None = None
        #: the credential records in memory, read by this service and the login gates
        #: sharing ``credentials``; ``cache.on_change`` tells of revocations
        self.cache: CredentialCache | None = None
        self.refusals = RefusalLog(log, "tokens", clock=clock)
        #: token requests per client (see the module's docstring)
        self.rate = RateByKey(TOKEN_BURST, clock=clock)
        self._too_many = envelope.pack_error(
            "denied",
            "rate_limited",
            f"more than {TOKEN_RATE:g} token requests a second from this client; dropped unread",
        )
        self._roll: asyncio.Task[None] | None = None
        self.keys: KeyStore | None = None
        self.ring: KeyRing | None = None
        self.issuer: TokenIssuer | None = None

    async def start(self) -> None:
        self.credentials = await CredentialStore.open(
            self._conn, create=True, replicas=self._replicas, clock=self._clock
        )
        self.cache = CredentialCache(self.credentials.bucket, clock=self._clock)
        await self.cache.start()
        self.credentials.cache = self.cache
        self._roll = asyncio.create_task(self.refusals.run())
        self.keys = await KeyStore.open(self._conn, create=True, replicas=self._replicas)
        self.ring = KeyRing.load_or_generate(self._key_file, self._clock)
        self.issuer = TokenIssuer(self.ring, ttl_sec=self._ttl, clock=self._clock)
        await self.keys.publish_ring(self.ring)
        self._sub = await self._conn.subscribe(
            subjects.TOKEN, self._on_request, queue="reach-issuer"
        )
        self._rotate_sub = await self._conn.subscribe(subjects.KEY_ROTATE, self._on_rotate)
        # the tokens it is shown (an admin's rotate, a fabric token to exchange) are checked
        # against REACH_KEYS as every agent checks them: a retired key only for tokens that
        # expire by its retirement, a removed key not at all, and keys of another issuer
        # of the fabric (or of this one before a restart) as long as they are published
        self._verifier = TokenVerifier(clock=self._clock)
        ready = asyncio.Event()
        self._follow = asyncio.create_task(self.keys.follow(self._verifier, ready))
        await asyncio.wait_for(ready.wait(), 10)
        await self._conn.flush()

    async def stop(self) -> None:
        for sub in (self._sub, self._rotate_sub):
            if sub is not None:
                await sub.unsubscribe()
        self._sub = self._rotate_sub = None
        if self._follow is not None:
            await cancel_and_wait([self._follow])
            self._follow = None
        if self._roll is not None:
            await cancel_and_wait([self._roll])
            self._roll = None
            self.refusals.roll()
        if self.cache is not None:
            if self.credentials is not None:
                self.credentials.cache = None
            await self.cache.stop()

    async def rotate(self, settle_sec: float = 1.0) -> SigningKey:
        """A new signing key; tokens of the old one stay valid until they expire."""
        assert self.keys is not None
        assert self.ring is not None
        key = await self.keys.rotate(self.ring, self._ttl, settle_sec=settle_sec)
        self.ring.active.save_private(self._key_file)
        return key

    async def _on_rotate(self, msg: Message) -> None:
        """Only an admin's token may rotate the signing key."""
        assert self._verifier is not None
        try:
            meta, _ = envelope.unpack_request(msg.data, 16 * 1024)
            claims = self._verifier.verify(meta.token or "")
            if not claims.has_role(ROLE_ADMIN):
                raise AuthenticationFailed(f"client {claims.client_id} is not an admin")
        except (CodecError, AuthenticationFailed) as exc:
            await self._conn.respond(msg, envelope.pack_error("denied", "not_admin", str(exc)))
            return
        key = await self.rotate()  # (the verifier learns the new key from REACH_KEYS)
        log.info("signing key rotated by %s: %s", claims.client_id, key.kid)
        await self._conn.respond(msg, envelope.pack_ok(key.kid.encode()))

    async def _on_request(self, msg: Message) -> None:
        client = requester(getattr(msg, "headers", None))
        if client is not None and not self.rate.take(client, TOKEN_RATE):
            self.refusals.refused(client, "over its rate of token requests")
            await self._conn.respond(msg, self._too_many)
            return
        asyncio.get_running_loop().create_task(self._answer(msg))

    async def _answer(self, msg: Message) -> None:
        assert self.credentials is not None
        assert self.issuer is not None
        try:
            _, body = envelope.unpack_request(msg.data, 16 * 1024)
            req = decode_model(TokenRequest, body)
        except (CodecError, ContractError) as exc:
            await self._conn.respond(msg, envelope.pack_error("contract", "bad_request", str(exc)))
            return
        try:
            if req.token is not None:
                token, claims = await self._exchange(req)
            else:
                assert req.secret is not None
                record = await self.credentials.authenticate(req.client_id, req.secret)
                token, claims = self.issuer.issue_with_claims(record)
        except AuthenticationFailed as exc:
            reason = exc.reason if isinstance(exc, CredentialsRejected) else str(exc)
            self.refusals.refused(req.client_id, reason)
            await self._conn.respond(
                msg, envelope.pack_error("denied", "authentication_failed", str(exc))
            )
            return
        except ReachError as exc:
            await self._conn.respond(msg, envelope.pack_error("internal", "issuer", str(exc)))
            return
        reply = TokenReply(
            token=token, expires_at=claims.exp, level=claims.level, agent_id=claims.agent_id
        )
        await self._conn.respond(msg, envelope.pack_ok(encode_model(reply)))

    async def _exchange(self, req: TokenRequest) -> tuple[str, Claims]:
        """A call token for ``req.audience`` in exchange for the client's fabric token:
        no secret check (the token says who it is), the credential looked up again (a
        revoked one gets nothing, a changed level counts; see :meth:`_current`), and no
        longer valid than the token shown."""
        assert self._verifier is not None
        assert self.credentials is not None
        assert self.issuer is not None
        assert req.token is not None
        assert req.audience is not None
        shown = self._verifier.verify(req.token)  # a fabric token, not a call token
        if shown.exp <= self._clock.time():  # within the leeway, but nothing left to give
            raise AuthenticationFailed(f"the token of {shown.client_id} has expired")
        if shown.client_id != req.client_id:
            raise AuthenticationFailed(f"the token is {shown.client_id}'s, not {req.client_id}'s")
        record = await self._current(shown.client_id)
        if record is None:
            raise AuthenticationFailed(f"client {shown.client_id} is unknown")
        actor = None
        not_after = shown.exp
        if req.actor_token is not None:
            actor, actor_exp = await self._actor(req.actor_token)
            not_after = min(not_after, actor_exp)
        return self.issuer.issue_with_claims(
            record,
            audience=call_audience(req.audience, req.instance or ""),
            not_after=not_after,
            actor=actor,
        )

    async def _current(self, client_id: str) -> ClientRecord | None:
        """The credential as the bucket holds it now; if JetStream does not answer within
        ``FRESH_READ_SEC``, as the cache that follows the bucket holds it (which has had
        that long to hear of a change made before the request)."""
        assert self.credentials is not None
        cache = self.cache
        try:
            return await asyncio.wait_for(self.credentials.get(client_id), FRESH_READ_SEC)
        except (TimeoutError, ReachError) as exc:
            if cache is None or not cache.ready:
                raise
            log.debug("credential %s from the cache: the bucket did not answer: %r", client_id, exc)
            return cache.get(client_id)

    async def _actor(self, token: str) -> tuple[ClientRecord, float]:
        """The credential of the gateway whose fabric token is ``token``, and when that
        token expires: AuthenticationFailed unless it is valid and holds the gateway
        role (looked up again, so a role taken away counts at once)."""
        assert self._verifier is not None
        assert self.credentials is not None
        claims = self._verifier.verify(token)
        if claims.exp <= self._clock.time():
            raise AuthenticationFailed(f"the token of {claims.client_id} has expired")
        record = await self._current(claims.client_id)
        if record is None:
            raise AuthenticationFailed(f"client {claims.client_id} is unknown")
        if ROLE_GATEWAY not in record.roles:
            raise AuthenticationFailed(
                f"client {claims.client_id} may not call for others: it lacks the"
                f" {ROLE_GATEWAY!r} role (reach creds add ... --role {ROLE_GATEWAY})"
            )
        return record, claims.exp


async def ensure_first_credentials(service: TokenService, store: Path, url: str) -> list[Path]:
    """On a fabric's first start: an admin credential and a dev credential file.

    Both are written under the store with mode 0600. The dev credential (level 4, admin
    and gateway roles) is for local development: it may speak for any agent_id.
    Production agents get their own credential bound to their agent_id (`reach creds add
    ID --agent-id ...`).
    """
    assert service.credentials is not None
    created = []
    for client_id, name in (("admin", "admin.creds"), ("dev", "dev.creds")):
        path = store / name
        if path.exists():
            continue
        if await service.credentials.get(client_id) is not None:
            log.warning("credential %s exists but %s is missing: not recreated", client_id, path)
            continue
        # the dev credential may also serve a gateway (`reach mcp --http`, `reach a2a`)
        roles = [ROLE_ADMIN, ROLE_GATEWAY] if client_id == "dev" else [ROLE_ADMIN]
        _, secret = await service.credentials.add(client_id, 4, roles=roles)
        CredentialsFile(url=url, client_id=client_id, secret=secret).write(path)
        created.append(path)
    return created
