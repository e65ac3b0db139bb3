"""A client's tokens: its fabric token, fetched on connect and renewed at ~75 % of its
life (with jitter), and a call token per capability it calls, got in exchange for the
fabric token on the first call and renewed the same way.

The fabric token goes to the fabric's services (registrar, issuer) only; a callee sees a
call token for its own capability, which nothing else accepts (``call_audience``). If the
issuer is down, still-valid tokens keep working; once they expire, calls fail closed
with AuthenticationFailed.
"""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Any

import jwt

from reach.clock import Clock, system_clock
from reach.errors import AuthenticationFailed, Disconnected, ReachError, Unavailable
from reach.security.credentials import CredentialsFile
from reach.security.tokenexchange import TokenReply, TokenRequest
from reach.tasks import cancel_and_wait
from reach.transport import Connection
from reach.wire import envelope, subjects
from reach.wire.modelcodec import decode_model, encode_model

__all__ = ["TokenSession"]

log = logging.getLogger("reach.session")

#: call tokens a session keeps, one per capability called (the oldest go beyond this)
MAX_CALL_TOKENS = 4096


class TokenSession:
    """``actor``: the session of a gateway calling for this client (which logged in
    through it): the call tokens then name the gateway as their actor, and are asked for
    with its fabric token beside this one's."""

    def __init__(
        self,
        conn: Connection,
        creds: CredentialsFile,
        *,
        clock: Clock = system_clock,
        actor: TokenSession | None = None,
    ):
        self._conn = conn
        self._creds = creds
        self._clock = clock
        self.actor = actor
        self._token: str | None = None
        self._expires_at = 0.0
        self.level = 0
        self.agent_id: str | None = None
        self._task: asyncio.Task[None] | None = None
        #: capability → (call token, renew at, expires at), times on this process's clock
        self._calls: dict[str, tuple[str, float, float]] = {}
        #: exchanges in flight, one per capability however many calls wait for it
        self._fetching: dict[str, asyncio.Task[str]] = {}
        self._closed = False

    @property
    def expires_at(self) -> float:
        """Unix time when the current token expires."""
        return self._expires_at

    @property
    def client_id(self) -> str:
        return self._creds.client_id

    @property
    def token(self) -> str:
        """The current token; AuthenticationFailed once it expired (fail closed)."""
        if self._token is None or self._clock.time() >= self._expires_at:
            raise AuthenticationFailed(
                f"no valid token for client {self.client_id}: the issuer could not renew it"
            )
        return self._token

    async def start(self, wait: float = 30.0) -> None:
        """Get the first token. An issuer that does not answer (busy with a crowd of agents
        starting at once: every login costs a slow hash) is asked again, with jittered
        back-off, for up to ``wait`` seconds; a refusal fails at once."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        delay = 0.25
        while True:
            try:
                await self.refresh()
                break
            except _IssuerSilent as exc:
                if loop.time() + delay >= deadline:
                    raise
                log.info("%s; asking again in %.1fs", exc, delay)
                await asyncio.sleep(delay * random.uniform(0.5, 1.5))
                delay = min(4.0, delay * 2)
        self._task = asyncio.create_task(self._renew_loop(), name="token-renewal")

    async def stop(self) -> None:
        self._closed = True
        tasks: list[asyncio.Task[Any]] = [*self._fetching.values()]
        if self._task is not None:
            tasks.append(self._task)
            self._task = None
        await cancel_and_wait(tasks)

    def call_token(self, capability: str, instance: str = "") -> str | None:
        """The token for calls to ``capability`` at ``instance`` (an agent id; none: the
        queue group), None if there is none valid (then ``fetch_call_token``). Past ~75 %
        of its life a new one is asked for in the background while this one is still
        used (after a failure, again with back-off)."""
        target = f"{capability}.{instance}" if instance else capability
        held = self._calls.get(target)
        if held is None:
            return None
        token, renew_at, expires_at = held
        now = self._clock.time()
        if now >= expires_at:
            return None
        if now >= renew_at and target not in self._fetching and not self._closed:
            self._exchange(target, background=True)
        return token

    async def fetch_call_token(self, capability: str, instance: str = "") -> str:
        """A token for calls to ``capability`` at ``instance``, asked of the issuer in
        exchange for the fabric token (one request however many calls wait);
        AuthenticationFailed if there is no valid fabric token or the issuer refuses,
        Unavailable if it does not answer, Disconnected once the session stopped."""
        if self._closed:
            raise Disconnected("the token session is closed")
        target = f"{capability}.{instance}" if instance else capability
        task = self._fetching.get(target) or self._exchange(target)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if task.cancelled() and (me is None or me.cancelling() == 0):
                # the session stopped under it: not this caller's cancellation
                raise Disconnected("the token session closed while a token was asked for") from None
            raise

    def _exchange(self, target: str, *, background: bool = False) -> asyncio.Task[str]:
        """Ask for the token of ``target``: ``<capability>`` or ``<capability>.<agent id>``
        (a dot is in neither)."""
        task = asyncio.ensure_future(self._fetch(target))
        self._fetching[target] = task

        def settled(done: asyncio.Task[str]) -> None:
            self._fetching.pop(target, None)
            # whoever waited (or nobody: a renewal in the background) saw it or not:
            # retrieved here either way; the token in use stays until it expires
            if done.cancelled() or (exc := done.exception()) is None:
                return
            held = self._calls.get(target)
            if background and held is not None:
                # the next try after a back-off, not on the next call (and one warning)
                token, _, expires_at = held
                now = self._clock.time()
                retry_at = now + min(30.0, max(1.0, 0.05 * (expires_at - now)))
                self._calls[target] = (token, retry_at, expires_at)
                log.warning("call token renewal for %s failed: %s", target, exc)

        task.add_done_callback(settled)
        return task

    async def _fetch(self, target: str) -> str:
        capability, _, instance = target.partition(".")
        request = TokenRequest(
            client_id=self.client_id,
            token=self.token,
            audience=capability,
            instance=instance or None,
            actor_token=self.actor.token if self.actor is not None else None,
        )
        try:
            answer = await self._ask(request)
        except _IssuerSilent as exc:
            # the issuer is away: a reachability failure (retried, a fallback applies)
            raise Unavailable(str(exc)) from exc
        # never later than the fabric token it was exchanged for, on this clock
        expires_at = min(self._local_expiry(answer), self._expires_at)
        life = expires_at - self._clock.time()
        calls = self._calls
        calls.pop(target, None)  # (re)inserted last: the oldest come first
        calls[target] = (answer.token, expires_at - 0.25 * life, expires_at)
        if len(calls) > MAX_CALL_TOKENS:  # names called once (or never served) go first
            del calls[next(iter(calls))]
        return answer.token

    async def refresh(self) -> None:
        request = TokenRequest(client_id=self._creds.client_id, secret=self._creds.secret)
        answer = await self._ask(request)
        self._token = answer.token
        self._expires_at = self._local_expiry(answer)
        self.level = answer.level
        self.agent_id = answer.agent_id

    async def _ask(self, request: TokenRequest) -> TokenReply:
        data = envelope.pack_request(
            envelope.RequestMeta(call_id=f"token-{random.getrandbits(48):x}"),
            encode_model(request),
        )
        try:
            raw = await self._conn.request(subjects.TOKEN, data, timeout=5.0)
        except ReachError as exc:
            raise _IssuerSilent(f"the token issuer did not answer: {exc}") from exc
        reply = envelope.unpack_reply(raw)
        if not reply.ok:
            raise AuthenticationFailed(
                f"token refused for client {self._creds.client_id}: {reply.description}"
            )
        return decode_model(TokenReply, reply.body)

    def _local_expiry(self, answer: TokenReply) -> float:
        """When the token expires, on this process's clock: now plus the token's lifetime
        (its exp - iat, both the issuer's), not the issuer's exp read on a clock that may be
        hours off (ahead: every token looks expired; behind: renewal comes too late)."""
        try:
            claims = jwt.decode(answer.token, options={"verify_signature": False})
            lifetime = float(claims["exp"]) - float(claims["iat"])
        except (jwt.PyJWTError, KeyError, TypeError, ValueError):
            return answer.expires_at
        if not 0 < lifetime < 7 * 24 * 3600:
            return answer.expires_at
        return self._clock.time() + lifetime

    async def _renew_loop(self) -> None:
        while True:
            life = self._expires_at - self._clock.time()
            await asyncio.sleep(max(1.0, life * random.uniform(0.7, 0.8)))
            try:
                await self.refresh()
            except ReachError as exc:
                # keep the current token while it is valid; try again soon
                log.warning("token renewal failed: %s", exc)
                await asyncio.sleep(min(30.0, max(1.0, life * 0.05)))


class _IssuerSilent(AuthenticationFailed):
    """No answer from the issuer (as opposed to a refusal): worth asking again."""
