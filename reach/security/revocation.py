"""Revocation cuts what is open: the tokens a revoked client holds, and its NATS connections.

Revoking a credential in REACH_CREDENTIALS only stops new logins and new tokens. Two more
things end what the client already has:

* Tokens: ``reach creds revoke`` also writes ``revoked.<client_id>`` (``Revocation``) into
  REACH_KEYS, the bucket every verifier already follows for keys (``KeyStore.follow``). A
  verifier then refuses every token of that client issued at or before ``revoked_at``,
  the ones it had cached as checked included. Tokens issued later (a client id that was
  deleted and added again with a new secret) are not affected.
* Connections: the login gate records, per client id, the connections it admitted (server
  id and the server's connection id, from the authorization request) in a bounded
  ``ConnectionRegistry``. ``RevocationGuard`` follows REACH_CREDENTIALS and, when a record
  turns revoked, asks each server to close those connections (``$SYS.REQ.SERVER.<id>.KICK``,
  which only a system-account user may send). The kicked client tries to log in again and
  is refused by the gate.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Final

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from reach.clock import Clock, system_clock
from reach.errors import CodecError, ReachError
from reach.security import natsconf
from reach.security.credcache import CredentialCache
from reach.security.credentials import ClientRecord
from reach.tasks import cancel_and_wait
from reach.transport import Connection, KVBucket, Message, Subscription
from reach.wire import codec

__all__ = [
    "REVOKED_PREFIX",
    "ConnectionRegistry",
    "Revocation",
    "RevocationGuard",
    "decode_revocation",
    "encode_revocation",
    "publish_revocation",
]

log = logging.getLogger("reach.security.revocation")

#: key prefix of revocations in REACH_KEYS (next to ``pub.<kid>``)
REVOKED_PREFIX: Final = "revoked."
#: what the server publishes in the system account when a client of an account leaves
_DISCONNECT_SUBJECT: Final = "$SYS.ACCOUNT.{account}.DISCONNECT"
#: the accounts the login gate places clients in: the fabric's (admins' tools) and the
#: callers' and agents'
_ACCOUNTS: Final = (natsconf.APP_ACCOUNT, natsconf.CLIENT_ACCOUNT)
_KICK_SUBJECT: Final = "$SYS.REQ.SERVER.{server}.KICK"
#: connections remembered in all; a login beyond pushes out the oldest one
DEFAULT_MAX_CONNECTIONS: Final = 100_000
#: the server ends a login when its user JWT expires (gate.USER_TTL_SEC): a record older
#: than that is of a connection that is gone
DEFAULT_MAX_AGE_SEC: Final = 3600.0


class Revocation(BaseModel):
    """A revoked client, as published in REACH_KEYS (key ``revoked.<client_id>``): its
    tokens issued at or before ``revoked_at`` (Unix seconds) are refused."""

    # extra fields are ignored so older verifiers keep reading what newer tools write
    model_config = ConfigDict(extra="ignore", frozen=True)

    client_id: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    revoked_at: float


def encode_revocation(revocation: Revocation) -> bytes:
    return codec.encode(revocation.model_dump(mode="json"), checked=False)


def decode_revocation(data: bytes) -> Revocation:
    """The record; CodecError if ``data`` is not one."""
    try:
        return Revocation.model_validate(codec.decode(data))
    except ValidationError as exc:
        raise CodecError(f"not a valid revocation record: {exc}") from None


async def publish_revocation(keys: KVBucket, client_id: str, revoked_at: float) -> None:
    """Tell every verifier following REACH_KEYS to refuse the tokens of ``client_id``."""
    record = Revocation(client_id=client_id, revoked_at=revoked_at)
    await keys.put(REVOKED_PREFIX + client_id, encode_revocation(record))


# -- open connections --------------------------------------------------------------------

#: (server id, the server's connection id)
ConnectionKey = tuple[str, int]


class ConnectionRegistry:
    """The connections the gate admitted, per client id, within fixed bounds: at most
    ``max_connections`` in all (the oldest go first) and none older than ``max_age``."""

    def __init__(
        self,
        *,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        max_age: float = DEFAULT_MAX_AGE_SEC,
        clock: Clock = system_clock,
    ) -> None:
        self._max = max(1, max_connections)
        self._max_age = max_age
        self._clock = clock
        # connection → (client id, admitted at), oldest first
        self._order: OrderedDict[ConnectionKey, tuple[str, float]] = OrderedDict()
        self._by_client: dict[str, set[ConnectionKey]] = {}
        #: logins pushed out by the bound before they ended (a revocation misses them)
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._order)

    def admitted(self, client_id: str, server_id: str, cid: int) -> None:
        key = (server_id, cid)
        self._drop(key)
        self._order[key] = (client_id, self._clock.monotonic())
        self._by_client.setdefault(client_id, set()).add(key)
        self._expire()
        while len(self._order) > self._max:
            self._drop(next(iter(self._order)))
            self.evicted += 1

    def disconnected(self, server_id: str, cid: int) -> None:
        self._drop((server_id, cid))

    def connections(self, client_id: str) -> list[ConnectionKey]:
        self._expire()
        return sorted(self._by_client.get(client_id, ()))

    def forget_client(self, client_id: str) -> list[ConnectionKey]:
        """The client's connections, no longer remembered (they are being closed)."""
        found = self.connections(client_id)
        for key in found:
            self._drop(key)
        return found

    def _drop(self, key: ConnectionKey) -> None:
        held = self._order.pop(key, None)
        if held is None:
            return
        keys = self._by_client.get(held[0])
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._by_client[held[0]]

    def _expire(self) -> None:
        cutoff = self._clock.monotonic() - self._max_age
        while self._order:
            key, (_, at) = next(iter(self._order.items()))
            if at >= cutoff:
                break
            self._drop(key)


def _disconnected(data: bytes) -> ConnectionKey | None:
    """(server id, connection id) of a disconnect event; None if it is not one."""
    try:
        event: Any = json.loads(data)
        server, cid = event["server"]["id"], event["client"]["id"]
    except (ValueError, TypeError, KeyError):
        return None
    if not isinstance(server, str) or isinstance(cid, bool) or not isinstance(cid, int):
        return None
    return server, cid


class RevocationGuard:
    """Closes the NATS connections of clients whose credential is revoked.

    ``credentials`` is the gate's copy of REACH_CREDENTIALS in memory, whose changes say
    when a credential is revoked; ``system`` a connection of a system-account user, which
    may kick connections and sees the server's disconnect events (None: revocations
    cannot end open connections).
    """

    def __init__(
        self,
        credentials: CredentialCache,
        system: Connection | None,
        *,
        accounts: tuple[str, ...] = _ACCOUNTS,
        registry: ConnectionRegistry | None = None,
        kick_timeout: float = 2.0,
    ) -> None:
        self._credentials = credentials
        self._system = system
        self._accounts = accounts
        self.registry = registry if registry is not None else ConnectionRegistry()
        self._kick_timeout = kick_timeout
        self._unfollow: Callable[[], None] | None = None
        self._subs: list[Subscription] = []
        self._kicks: set[asyncio.Task[None]] = set()
        #: connections the servers closed at our request
        self.kicked = 0

    def is_revoked(self, client_id: str) -> bool:
        record = self._credentials.get(client_id)
        return record is not None and record.revoked

    async def start(self) -> None:
        if self._system is not None:
            for account in self._accounts:
                self._subs.append(
                    await self._system.subscribe(
                        _DISCONNECT_SUBJECT.format(account=account), self._on_disconnect
                    )
                )
            await self._system.flush()
        self._unfollow = self._credentials.on_change(self._on_change)

    async def stop(self) -> None:
        if self._unfollow is not None:
            self._unfollow()
            self._unfollow = None
        for sub in self._subs:
            with contextlib.suppress(ReachError):
                await sub.unsubscribe()
        self._subs.clear()
        await cancel_and_wait(list(self._kicks))

    def admitted(self, client_id: str, server_id: str, cid: int) -> None:
        """The gate let ``client_id`` in on connection ``cid`` of ``server_id``."""
        self.registry.admitted(client_id, server_id, cid)
        if self.is_revoked(client_id):
            # revoked while its login was being checked: the change came first
            self._kick_later(client_id)

    async def _on_disconnect(self, msg: Message) -> None:
        gone = _disconnected(bytes(msg.data))
        if gone is not None:
            self.registry.disconnected(*gone)

    def _on_change(self, client_id: str, record: ClientRecord | None) -> None:
        if record is not None and record.revoked:
            self._kick_later(client_id)  # nothing to do unless it has open connections

    def _kick_later(self, client_id: str) -> None:
        if not self.registry.connections(client_id):
            return
        task = asyncio.create_task(self._kick_quietly(client_id))
        self._kicks.add(task)
        task.add_done_callback(self._kicks.discard)

    async def _kick_quietly(self, client_id: str) -> None:
        await self.kick(client_id)

    async def kick(self, client_id: str) -> int:
        """Ask the servers to close every connection of ``client_id`` the gate admitted;
        how many they closed (those already gone are not counted)."""
        found = self.registry.forget_client(client_id)
        if not found:
            return 0
        if self._system is None:
            log.warning(
                "%s is revoked but its %d open connection(s) stay until their login expires:"
                " no system-account user to close them (run `reach nats-auth` again)",
                client_id,
                len(found),
            )
            return 0
        done = await asyncio.gather(*(self._kick_one(client_id, *key) for key in found))
        closed = sum(done)
        self.kicked += closed
        log.info("%s is revoked: closed %d of its %d connection(s)", client_id, closed, len(found))
        return closed

    async def _kick_one(self, client_id: str, server_id: str, cid: int) -> bool:
        assert self._system is not None
        subject = _KICK_SUBJECT.format(server=server_id)
        try:
            raw = await self._system.request(
                subject, json.dumps({"cid": cid}).encode(), timeout=self._kick_timeout
            )
            answer: Any = json.loads(raw)
        except (ReachError, ValueError) as exc:
            log.warning(
                "could not close connection %d of %s on %s: %s", cid, client_id, server_id, exc
            )
            return False
        error = answer.get("error") if isinstance(answer, dict) else None
        if error:
            # most often: it was gone already ("no such client or leafnode id")
            log.info("connection %d of %s on %s: %s", cid, client_id, server_id, error)
            return False
        return True
