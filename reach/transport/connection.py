"""A connected NATS client, narrowed to what Agent-Reach uses, and ``connect``.

A ``Connection`` publishes, subscribes, makes requests and opens KV buckets and streams;
every nats-py error leaves it translated (``denials``). What each call costs on the way
through nats-py (direct socket writes, inline delivery, the request mux, batches) lives
in ``natsio`` and ``mux`` beneath it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

import nats.errors
from nats.aio.client import Client as _NatsClient
from nats.aio.msg import Msg as _NatsMsg
from nats.aio.subscription import Subscription as _NatsSubscription

from reach.errors import PermissionDenied, ReachError, ReachTimeout
from reach.settings import resolve_reconnect_for
from reach.transport.denials import Denials, is_permission_error, refusal_of, translate_error
from reach.transport.internals import resolve as resolve_internals
from reach.transport.jetstream import Stream, open_stream
from reach.transport.kv import KVBucket, open_bucket
from reach.transport.link import Link, PublicClient, open_client
from reach.transport.mux import ReplyBatch, ReplyMux, batch_bytes
from reach.transport.natsio import Writer, barrier, subscribe_inline
from reach.transport.replies import ReplyInbox
from reach.transport.storestate import ASK_TIMEOUT, problem_in_ping_answer
from reach.wire import subjects

__all__ = [
    "Connection",
    "Handler",
    "InlineHandler",
    "Message",
    "RawRequest",
    "Subscription",
    "connect",
]

log = logging.getLogger("reach.transport")


class Message(Protocol):
    subject: str
    reply: str
    data: bytes


Handler = Callable[[Message], Awaitable[None]]
#: a handler run as each message is parsed: it must not block (see ``subscribe_inline``)
InlineHandler = Callable[[Message], None]
#: the call path's request function: (subject, data, timeout, batch) → the reply's bytes
RawRequest = Callable[[str, bytes, float, bool], Awaitable[bytes]]


class Subscription:
    def __init__(self, sub: _NatsSubscription) -> None:
        self._sub = sub

    @property
    def subject(self) -> str:
        return str(self._sub.subject)

    @property
    def pending(self) -> int:
        """Messages received and not yet given to the handler."""
        return int(self._sub.pending_msgs)

    async def unsubscribe(self) -> None:
        with contextlib.suppress(nats.errors.Error):
            await self._sub.unsubscribe()

    async def drain(self) -> None:
        """Stop receiving new messages and let the queued ones be handled."""
        with contextlib.suppress(nats.errors.Error):
            await self._sub.drain()  # type: ignore[no-untyped-call]


class Connection:
    """A connected NATS client, narrowed to what Agent-Reach uses."""

    def __init__(
        self,
        nc: _NatsClient,
        denials: Denials | None = None,
        user: str | None = None,
        inbox_prefix: str = "_INBOX",
        link: Link | None = None,
        internals: bool | None = None,
    ) -> None:
        self._nc = nc
        #: whether the call path goes through nats-py's internals (``internals.resolve``:
        #: the argument, else ``REACH_NATS_INTERNALS``) or its public API alone
        self.uses_internals = resolve_internals(internals)
        #: up, or down since when and why (``describe`` words it for errors)
        self.link = link or Link(str(nc.options.get("name") or ""), [], user, None)
        #: the token this connection writes audit batches under: the NATS user the server
        #: logged it in as (a client id, the registrar's service user), on an open fabric
        #: ``subjects.ANONYMOUS``; the server's permissions hold each client to its own
        self.writer = subjects.writer_token(user)
        #: refusals the server reported on this connection (see ``Denials``), and what
        #: it knows of the fabric's JetStream store (asked of the registrars)
        self.denials = denials or Denials()
        self.denials.store.set_ask(self._ask_store)
        self._js = nc.jetstream()
        self._writer = Writer(nc, self.uses_internals)
        self._mux = ReplyMux(nc, self._writer, inbox_prefix)
        self._inbox_prefix = inbox_prefix
        self._reconnect_listeners: list[Callable[[], None]] = []
        #: times the connection came back after a disconnect (a request that spans one
        #: may have been lost with the old socket: not its target's fault)
        self.reconnects = 0

    def on_reconnect(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` each time the connection is back after a disconnect."""
        self._reconnect_listeners.append(listener)

    @property
    def login_refused(self) -> str | None:
        """Why the login gate refuses our login while reconnecting (a revoked credential),
        until a reconnect succeeds: requests meanwhile only time out. None too while the
        login is refused only for want of an answer (``link`` says so)."""
        return self.link.refused if self.link.credentials_refused else None

    def _reconnected(self) -> None:
        self.reconnects += 1
        for listener in self._reconnect_listeners:
            try:
                listener()
            except Exception:  # a listener's bug must not break reconnecting
                log.exception("a reconnect listener failed")

    @property
    def is_connected(self) -> bool:
        return bool(self._nc.is_connected)

    @property
    def is_closed(self) -> bool:
        return bool(self._nc.is_closed)

    @property
    def connected_url(self) -> str:
        url = self._nc.connected_url
        return url.geturl() if url else ""

    @property
    def login_took(self) -> float | None:
        """Seconds the server took to answer this connection's current login (the login
        gate's answer on a secured fabric); None if unknown."""
        nc = self._nc
        return nc.login_waited() if isinstance(nc, PublicClient) else None

    @property
    def max_payload(self) -> int:
        return int(self._nc.max_payload)

    @property
    def raw_request(self) -> RawRequest:
        """Request/reply for the call hot path: ``(subject, data, timeout, batch)`` → the
        reply's bytes (nats-py errors: ``translate_error``). With ``batch``, requests to one
        subject made in one turn of the event loop may travel as one (``reach.transport.mux``)."""
        request: RawRequest = self._mux.request
        return request

    def reply_batch(self, msg: Message) -> ReplyBatch:
        """Where the replies to the batch of requests in ``msg`` are collected."""
        return ReplyBatch(self._writer, msg.reply, batch_bytes(self._nc))

    def reply_inbox(self) -> ReplyInbox:
        """A reply subscription of its own for many requests matched by their sender
        (``reach.transport.replies``); ``await inbox.open(deliver)`` before use."""
        return ReplyInbox(self._nc, self._writer, self.denials, self._inbox_prefix)

    def new_inbox(self) -> str:
        return str(self._nc.new_inbox())

    async def request(self, subject: str, data: bytes, timeout: float) -> bytes:
        if timeout <= 0:
            raise ReachTimeout(f"no time left to call {subject}")
        started = time.monotonic()
        try:
            # the call path's mux, never batched: control subjects answer one at a time;
            # a refusal ends it at once, not when its timeout does
            return await self.denials.guard(
                self._mux.request(subject, data, timeout, False), subject, refusal_of(subject)
            )
        except PermissionDenied:
            raise
        except Exception as exc:
            raise self.denials.explain(exc, subject, started, subject) from exc

    async def _ask_store(self) -> str | None:
        """What the registrars say is wrong with the fabric's JetStream store ("" for
        nothing); None when none answered."""
        try:
            data = await self.request(subjects.REGISTRAR_PING, b"", timeout=ASK_TIMEOUT)
        except ReachError:
            return None
        return problem_in_ping_answer(data)

    async def publish(self, subject: str, data: bytes, reply: str = "") -> None:
        try:
            await self._nc.publish(subject, data, reply=reply)
        except Exception as exc:
            raise translate_error(exc, subject) from exc

    async def respond(self, msg: Message, data: bytes) -> None:
        """Reply to a request; never echoes the request's headers (unlike ``Msg.respond``)."""
        self._writer.respond(msg.reply, data)

    def replier(self, *, with_turn: bool = False) -> Callable[[str, bytes], None]:
        """The call path's ``respond``, from synchronous code: ``(reply subject, data)``;
        a reply that cannot go out is logged and dropped (the caller retries elsewhere).
        ``with_turn``: each reply goes with the rest of this turn of the event loop's
        messages in one write, never alone (for many small replies at once)."""
        if with_turn:
            return functools.partial(self._writer.respond, now=False)
        return self._writer.respond

    async def subscribe(self, subject: str, handler: Handler, queue: str = "") -> Subscription:
        async def _cb(msg: _NatsMsg) -> None:
            await handler(msg)

        try:
            sub = await self._nc.subscribe(subject, queue=queue, cb=_cb, pending_msgs_limit=65536)
        except Exception as exc:
            raise translate_error(exc, subject) from exc
        return Subscription(sub)

    async def subscribe_inline(
        self, subject: str, handler: InlineHandler, queue: str = ""
    ) -> Subscription:
        """Subscribe with a handler run as each message is parsed, in the reader task.

        For the call path only: the handler must not block, so it runs what it can at
        once and moves anything that waits into a task of its own.
        """
        try:
            sub = await subscribe_inline(
                self._nc, subject, handler, queue, inline=self.uses_internals
            )
        except Exception as exc:
            raise translate_error(exc, subject) from exc
        return Subscription(sub)

    async def flush(self, timeout: int = 5) -> None:
        """Return once the server has processed everything sent so far (SUBs included)."""
        try:
            await barrier(self._nc, timeout, internals=self.uses_internals)
        except Exception as exc:
            raise translate_error(exc, "flush") from exc

    async def key_value(
        self,
        bucket: str,
        *,
        create: bool = True,
        replicas: int = 1,
        history: int = 1,
        ttl: float | None = None,
        public: bool = False,
        direct_gets: bool = False,
    ) -> KVBucket:
        """Open the KV ``bucket``, creating it with ``create`` if it does not exist.

        ``public``: a bucket callers read (registry, keys, jobs). It republishes every
        change to ``reach.v1.kv.<bucket>.<key>`` and allows direct gets, so that readers
        follow it without a JetStream consumer (``reach.transport.kvfollow``); a bucket opened with
        ``create`` that lacks this is updated. Never for a bucket of secrets: anyone who
        may subscribe there sees every value."""
        return await open_bucket(
            self._js,
            self.denials,
            bucket,
            follower=self._nc,
            reconnects=self._reconnect_event,
            create=create,
            replicas=replicas,
            history=history,
            ttl=ttl,
            public=public,
            direct_gets=direct_gets,
        )

    async def wait_connected(self, timeout: float) -> bool:
        """Whether the connection is up, waiting up to ``timeout`` seconds for it to come
        back if it is away (False at once once closed)."""
        if self._nc.is_connected:
            return True
        if self._nc.is_closed or timeout <= 0:
            return False
        back, forget = self._reconnect_event()
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(back.wait(), timeout)
        finally:
            forget()
        return bool(self._nc.is_connected)

    def _reconnect_event(self) -> tuple[asyncio.Event, Callable[[], None]]:
        """An event set on every reconnect, and the function that stops setting it."""
        event = asyncio.Event()
        self._reconnect_listeners.append(event.set)
        return event, lambda: self._reconnect_listeners.remove(event.set)

    async def stream(
        self,
        name: str,
        subjects: Sequence[str] = (),
        *,
        create: bool = False,
        check: bool = True,
        max_age: float = 0.0,
        max_bytes: int = -1,
        replicas: int = 1,
        duplicate_window: float = 120.0,
        min_bytes: int = 0,
    ) -> Stream:
        """A JetStream stream; with ``create``, made (or its limits updated) if needed.

        Streams made here are file-backed and deny delete and purge: what they hold is
        a record, and nobody edits a record. ``check=False`` skips asking the server
        whether it exists (a publisher without JetStream API permissions). A new
        stream's size cap ``max_bytes`` is halved down to ``min_bytes`` where the store
        has no room for it (``reach.transport.jetstream``); an existing one keeps its cap.
        """
        return await open_stream(
            self._js,
            self.denials,
            name,
            subjects,
            create=create,
            check=check,
            max_age=max_age,
            max_bytes=max_bytes,
            replicas=replicas,
            duplicate_window=duplicate_window,
            reconnects=lambda: self.reconnects,
            min_bytes=min_bytes,
        )

    async def close(self) -> None:
        self._mux.close()  # requests in flight fail now, not at their deadlines
        if not self._nc.is_closed:
            with contextlib.suppress(Exception):
                await self._nc.close()

    async def drain(self) -> None:
        if not self._nc.is_closed:
            with contextlib.suppress(Exception):
                await self._nc.drain()


class _Events:
    """What a connection's nats-py client reports, passed on: permission refusals to its
    ``Denials``, reconnects and disconnects to the connection and the caller's callbacks."""

    def __init__(
        self,
        name: str,
        denials: Denials,
        on_reconnect: Callable[[], Awaitable[None]] | None,
        on_disconnect: Callable[[], Awaitable[None]] | None,
    ) -> None:
        self.name = name
        self.denials = denials
        self.conn: Connection | None = None
        self._on_reconnect = on_reconnect
        self._on_disconnect = on_disconnect

    def error(self, exc: Exception) -> bool:
        if is_permission_error(exc):
            log.warning("%s: %s", self.name, exc)
            self.denials.add(str(exc))
            return True
        return False

    async def reconnected(self) -> None:
        if self.conn is not None:
            self.conn._reconnected()
        if self._on_reconnect is not None:
            await self._on_reconnect()

    async def disconnected(self) -> None:
        if self._on_disconnect is not None:
            await self._on_disconnect()


async def connect(
    servers: Sequence[str],
    *,
    name: str,
    connect_timeout: float = 5.0,
    user: str | None = None,
    password: str | None = None,
    inbox_prefix: str | None = None,
    on_reconnect: Callable[[], Awaitable[None]] | None = None,
    on_disconnect: Callable[[], Awaitable[None]] | None = None,
    reconnect_for: float | None = None,
    prompt_reconnect: bool = False,
    internals: bool | None = None,
) -> Connection:
    """Connect to NATS; once connected, reconnect and log in again whatever the server
    answers (a refused login during a failover, or while the login gate is away, is
    transient), with jittered back-off, for ``reconnect_for`` seconds per outage (None:
    ``REACH_RECONNECT_FOR``, by default forever; see ``reach.transport.link``).
    ``prompt_reconnect``: try again every few tens of milliseconds instead, for a
    connection others' logins wait for (a login gate's).

    A first connect whose login is refused raises AuthenticationFailed at once, one whose
    login is not answered LoginUnanswered; neither waits for more tries.

    ``internals``: whether to use nats-py's internals (None: ``REACH_NATS_INTERNALS``, on
    by default); an installed nats-py that lacks one raises UnsupportedNatsPy before
    connecting (``reach.transport.internals``)."""
    uses_internals = resolve_internals(internals)
    link = Link(name, servers, user, resolve_reconnect_for(reconnect_for))
    events = _Events(name, Denials(link), on_reconnect, on_disconnect)
    # every connection's inbox is a prefix of its own (``_INBOX.<client_id>`` on a secured
    # fabric, a random token otherwise): call replies go to ``<prefix>.r.…`` (``mux``)
    inbox_prefix = inbox_prefix or f"_INBOX.{os.urandom(8).hex()}"
    nc = await open_client(
        servers,
        link=link,
        name=name,
        connect_timeout=connect_timeout,
        user=user,
        password=password,
        inbox_prefix=inbox_prefix,
        on_error=events.error,
        on_reconnect=events.reconnected,
        on_disconnect=events.disconnected,
        prompt=prompt_reconnect,
        internals=uses_internals,
    )
    events.conn = Connection(nc, events.denials, user, inbox_prefix, link, uses_internals)
    return events.conn
