"""The NATS login gate of a fabric started by ``reach up``: auth callout on our server.

Every client logs in to NATS with its client id and secret (no anonymous access); the
gate checks them against REACH_CREDENTIALS and hands the server that client's subject
permissions (see ``callout.permissions_for``). The records are read from the store's
in-memory cache (``credcache``), so a login costs no bucket round trip and goes on
being answered while REACH_CREDENTIALS elects a leader or the watch is set up again. An
id not in memory is looked up in the bucket for at most ``MISS_READ_SEC`` (well under
the server's auth timeout, after which the client is refused anyway), else refused.
Refusals are logged through ``RefusalLog`` (a few lines, then a summary per interval).

Several gates may answer the same servers (one per ``reach up``, one per node): they
share the queue group of the callout subject, so each login is answered by one of them.
"""

from __future__ import annotations

import asyncio
import logging

from reach.errors import AuthenticationFailed, ReachError
from reach.security import natsconf
from reach.security.callout import AuthCallout, CalloutRequest, Permissions, permissions_for
from reach.security.credcache import CredentialCache
from reach.security.credentials import (
    ROLE_ADMIN,
    ROLE_JOBS,
    ROLE_REGISTRAR,
    CredentialsRejected,
    CredentialStore,
)
from reach.security.refusals import RefusalLog
from reach.security.revocation import RevocationGuard
from reach.tasks import cancel_and_wait
from reach.transport import Connection, connect

__all__ = ["LoginGate"]

log = logging.getLogger("reach.gate")

#: a client's NATS login lives this long; then it logs in again (a revocation bites)
USER_TTL_SEC = 3600.0
#: the longest a login waits for the bucket to confirm an id the cache does not hold
MISS_READ_SEC = 1.0


class LoginGate:
    def __init__(self, setup: natsconf.SecureSetup, credentials: CredentialStore) -> None:
        self._setup = setup
        self._credentials = credentials
        self._conn: Connection | None = None
        self._callout: AuthCallout | None = None
        self.refusals = RefusalLog(log, "NATS logins")
        self._roll: asyncio.Task[None] | None = None
        self._system: Connection | None = None
        self._own_cache: CredentialCache | None = None
        self.revocations: RevocationGuard | None = None

    @property
    def connection(self) -> Connection | None:
        """The callout service user's connection (None before ``start``)."""
        return self._conn

    async def start(self, servers: list[str]) -> None:
        user = self._setup.callout_user
        # prompt: every login a restarted server gets before the gate is back is lost
        self._conn = await connect(
            servers,
            name="reach-login-gate",
            user=user.name,
            password=user.password,
            prompt_reconnect=True,
        )
        await self._start_revocations(servers)
        self._callout = AuthCallout(
            self._conn,
            self._setup.issuer,
            self.permissions,
            user_ttl=USER_TTL_SEC,
            on_admitted=self._admitted,
        )
        await self._callout.start()
        self._roll = asyncio.create_task(self.refusals.run())

    async def stop(self) -> None:
        if self._roll is not None:
            await cancel_and_wait([self._roll])
            self._roll = None
            self.refusals.roll()
        if self._callout is not None:
            await self._callout.stop()
        if self.revocations is not None:
            await self.revocations.stop()
        if self._own_cache is not None:
            await self._own_cache.stop()
        for conn in (self._system, self._conn):
            if conn is not None:
                await conn.close()

    async def _start_revocations(self, servers: list[str]) -> None:
        """Follow revocations, to close the connections of revoked clients (through the
        system account; while its user cannot connect they stay open until their login
        expires)."""
        sys_user = self._setup.system_user
        try:
            self._system = await connect(
                servers,
                name="reach-revocations",
                user=sys_user.name,
                password=sys_user.password,
            )
        except ReachError as exc:
            log.warning("revocations cannot close open connections: %s", exc)
        cache = self._credentials.cache
        if not isinstance(cache, CredentialCache):  # none beside this gate: one of our own
            cache = self._own_cache = CredentialCache(self._credentials.bucket)
            await cache.start()
        self.revocations = RevocationGuard(cache, self._system)
        await self.revocations.start()

    def _admitted(self, request: CalloutRequest) -> None:
        if self.revocations is not None and request.connection_id:
            self.revocations.admitted(request.user, request.server_id, request.connection_id)

    async def permissions(self, user: str, password: str) -> Permissions | None:
        """The permissions of a client that logs in with its id and secret; None refuses."""
        try:
            record = await self._credentials.authenticate(
                user, password, read_timeout=min(MISS_READ_SEC, self._setup.auth_timeout / 4)
            )
        except AuthenticationFailed as exc:
            reason = exc.reason if isinstance(exc, CredentialsRejected) else "refused"
            self.refusals.refused(user, reason)
            return None
        if record.has_role(ROLE_ADMIN) or record.has_role(ROLE_REGISTRAR):
            role = "admin"
        elif record.agent_id is not None:
            role = "agent"
        else:
            role = "caller"
        return permissions_for(
            role,
            agent_id=record.agent_id,
            capabilities=list(record.capabilities),
            inbox_prefix=f"_INBOX.{record.client_id}",
            # REACH_JOBS is readable (and, by agents, writable) by every holder of this
            # permission: only clients given the jobs role (reach creds add --role jobs)
            async_jobs=record.has_role(ROLE_JOBS),
        )
