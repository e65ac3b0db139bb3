"""Joining a fabric's security: a token for our own requests, a verifier for theirs.

A fabric started by ``reach up`` publishes its token-signing keys in REACH_KEYS; then
every participant needs credentials, and every callee verifies every call. A fabric
without REACH_KEYS (a bare nats-server, as in unit tests) issues no tokens: calls carry
none and nobody checks them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from contextvars import ContextVar
from pathlib import Path

from reach.clock import Clock, system_clock
from reach.errors import AuthenticationFailed, ConfigurationError
from reach.security.accounts import PARTICIPANT_SUFFIX
from reach.security.credentials import CredentialsFile
from reach.security.session import TokenSession
from reach.security.tokens import KeyStore, TokenVerifier
from reach.tasks import cancel_and_wait
from reach.transport import Connection, connect

__all__ = ["FabricSecurity", "acting_for", "acting_session", "connect_as"]

log = logging.getLogger("reach.security")

#: the session of the client a gateway calls for, in the task making those calls
_ACTING_FOR: ContextVar[TokenSession | None] = ContextVar("reach_acting_for", default=None)


@contextlib.contextmanager
def acting_for(session: TokenSession | None) -> Iterator[None]:
    """Calls made in this block (and in tasks it starts) carry call tokens of
    ``session``'s client, exchanged with the gateway as their actor (its ``actor``), and
    their audit events name that client as the caller. None: the client's own."""
    token = _ACTING_FOR.set(session)
    try:
        yield
    finally:
        _ACTING_FOR.reset(token)


def acting_session() -> TokenSession | None:
    """The session of the client calls are made for here, if not the client's own."""
    return _ACTING_FOR.get()


async def connect_as(
    servers: list[str], *, name: str, credentials: Path | None, participant: bool = False
) -> tuple[Connection, CredentialsFile | None]:
    """Connect with the client id + secret of a credentials file (if any) as NATS user and
    password, and a reply inbox of our own (``_INBOX.<client_id>``): on a fabric with NATS
    auth callout that is all a client may subscribe to for replies.

    ``participant``: an agent's or a client's connection, placed with the callers and
    agents even when its credential is an admin's (whose tools are otherwise placed in
    the fabric account, where JetStream is)."""
    creds = CredentialsFile.read(credentials) if credentials is not None else None
    if creds is None:
        return await connect(servers, name=name), None
    conn = await connect(
        servers,
        name=name + PARTICIPANT_SUFFIX if participant else name,
        user=creds.client_id,
        password=creds.secret,
        inbox_prefix=f"_INBOX.{creds.client_id}",
    )
    return conn, creds


class FabricSecurity:
    """Token session and verifier of one participant (agent, client or registrar)."""

    def __init__(self) -> None:
        #: this participant's own token session
        self.own: TokenSession | None = None
        self.verifier: TokenVerifier | None = None
        self._follow: asyncio.Task[None] | None = None

    @property
    def session(self) -> TokenSession | None:
        """The session calls are made with: the client's a gateway calls for
        (``acting_for``), else this participant's own."""
        return _ACTING_FOR.get() or self.own

    @property
    def enabled(self) -> bool:
        return self.verifier is not None or self.own is not None

    def token(self) -> str | None:
        """The fabric token, for requests to the fabric's services (None on an open
        fabric). Never sent to a callee: calls carry ``call_token``."""
        return self.own.token if self.own is not None else None

    def call_token(self, capability: str, instance: str = "") -> str | None:
        """The token for a call to ``capability`` at ``instance`` (none: its queue group)
        if one is at hand; None on an open fabric, or when ``fetch_call_token`` must get
        it."""
        session = self.session
        return session.call_token(capability, instance) if session is not None else None

    async def fetch_call_token(self, capability: str, instance: str = "") -> str | None:
        """A token for calls to ``capability`` at ``instance`` from the issuer (None on an
        open fabric)."""
        session = self.session
        if session is None:
            return None
        return await session.fetch_call_token(capability, instance)

    @classmethod
    async def join(
        cls,
        conn: Connection,
        credentials: CredentialsFile | None,
        *,
        verify: bool,
        need_token: bool = True,
        clock: Clock = system_clock,
    ) -> FabricSecurity:
        security = cls()
        try:
            keys = await KeyStore.open(conn, create=False)
        except ConfigurationError:
            if credentials is not None:
                log.info("this fabric issues no tokens (no REACH_KEYS); credentials unused")
            return security
        try:
            if need_token:
                if credentials is None:
                    raise AuthenticationFailed(
                        "this fabric requires credentials: pass credentials=, set REACH_CREDS,"
                        " or create .reach/dev.creds with `reach creds add`"
                    )
                security.own = TokenSession(conn, credentials, clock=clock)
                await security.own.start()
            if verify:
                security.verifier = TokenVerifier(clock=clock)
                ready = asyncio.Event()
                security._follow = asyncio.create_task(keys.follow(security.verifier, ready))
                await asyncio.wait_for(ready.wait(), 10)
        except BaseException:
            await security.close()
            raise
        return security

    async def close(self) -> None:
        if self.own is not None:
            await self.own.stop()
        if self._follow is not None:
            await cancel_and_wait([self._follow])
            self._follow = None
