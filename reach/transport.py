"""The NATS boundary: the only module that imports ``nats``.

It owns connecting (reconnect forever, with jitter), request/reply, subscriptions and
the JetStream KV operations the registry needs, and translates every nats-py error
into the Agent-Reach tree at this one seam. What each call costs on the wire (direct
socket writes, the request mux, batches) lives in ``reach.wire``, beneath it.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import os
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as _NatsClient
from nats.aio.msg import Msg as _NatsMsg
from nats.aio.subscription import Subscription as _NatsSubscription
from nats.js.api import (
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    KeyValueConfig,
    RePublish,
    StorageType,
    StreamConfig,
)
from nats.js.kv import KeyValue

from reach import kvfollow, subjects
from reach.errors import (
    ConfigurationError,
    Disconnected,
    NoResponders,
    PermissionDenied,
    ReachError,
    ReachTimeout,
    TransportError,
)
from reach.kvfollow import KVEntry, republish_prefix
from reach.link import Client, Link, open_client
from reach.settings import resolve_reconnect_for
from reach.wire import ReplyBatch, ReplyMux, Writer, barrier, batch_bytes, subscribe_inline

__all__ = [
    "Connection",
    "KVBucket",
    "KVConflict",
    "KVEntry",
    "Message",
    "RawRequest",
    "ReplyBatch",
    "Stream",
    "StreamMessage",
    "Subscription",
    "connect",
    "translate_error",
]

log = logging.getLogger("reach.transport")

_T = TypeVar("_T")

#: reading a stream's history: wait for stragglers when none are pending, or for the next
_HISTORY_QUIET = 0.3
_HISTORY_STALL = 10.0


class Message(Protocol):
    subject: str
    reply: str
    data: bytes


Handler = Callable[[Message], Awaitable[None]]
#: a handler run as each message is parsed: it must not block (see ``subscribe_inline``)
InlineHandler = Callable[[Message], None]
#: the call path's request function: (subject, data, timeout, batch) → the reply's bytes
RawRequest = Callable[[str, bytes, float, bool], Awaitable[bytes]]


class KVConflict(ReachError):
    """A compare-and-set write lost: the key changed (or exists) since it was read."""

    layer = "discovery"


class Subscription:
    def __init__(self, sub: _NatsSubscription) -> None:
        self._sub = sub

    @property
    def subject(self) -> str:
        return str(self._sub.subject)

    async def unsubscribe(self) -> None:
        with contextlib.suppress(nats.errors.Error):
            await self._sub.unsubscribe()

    async def drain(self) -> None:
        """Stop receiving new messages and let the queued ones be handled."""
        with contextlib.suppress(nats.errors.Error):
            await self._sub.drain()  # type: ignore[no-untyped-call]


def translate_error(exc: BaseException, what: str) -> ReachError:
    """The Agent-Reach error for an exception nats-py raised while doing ``what``."""
    if isinstance(exc, nats.errors.NoRespondersError):
        return NoResponders(f"no responders on {what}")
    if isinstance(exc, nats.errors.TimeoutError | asyncio.TimeoutError):
        return ReachTimeout(f"no reply from {what} in time")
    if isinstance(
        exc,
        nats.errors.ConnectionClosedError
        | nats.errors.ConnectionDrainingError
        | nats.errors.ConnectionReconnectingError
        | nats.errors.StaleConnectionError
        | nats.errors.OutboundBufferLimitError
        | nats.errors.NoServersError
        | ConnectionError
        | OSError,
    ):
        return Disconnected(f"connection lost during {what}: {type(exc).__name__}")
    if isinstance(exc, nats.errors.MaxPayloadError):
        return ConfigurationError(f"message for {what} exceeds the server's max_payload")
    if isinstance(exc, nats.errors.BadSubjectError):
        return ConfigurationError(f"invalid subject {what!r}")
    return TransportError(f"{what}: {type(exc).__name__}: {exc}")


class Denials:
    """What the server refused these credentials lately (``-ERR 'Permissions Violation
    for Publish to "…"'``): the server drops such a message and says so only in this
    error, so a request to it would otherwise end as a plain timeout. ``guard`` ends an
    operation as soon as the refusal arrives instead."""

    __slots__ = ("_link", "_seen", "_waiting")

    def __init__(self, link: Link | None = None) -> None:
        #: the connection's state: an operation that failed while it was down says why
        self._link = link
        self._seen: deque[tuple[float, str]] = deque(maxlen=32)
        #: operations in ``guard``: what to call on a refusal, and which refusals end it
        self._waiting: dict[Callable[[str], None], Callable[[str], bool]] = {}

    def add(self, error: str) -> None:
        error = error.removeprefix("nats: ")
        self._seen.append((time.monotonic(), error))
        for stop, refuses in list(self._waiting.items()):
            if refuses(error):
                stop(error)

    def since(self, started: float, subject: str | None = None) -> str | None:
        """The latest refusal since ``started`` (monotonic), of ``subject`` if given
        (nats-py reports it in lower case), else of a JetStream or KV subject."""
        refuses = _refusal_of(subject)
        for at, error in reversed(self._seen):
            if at < started:
                return None
            if refuses(error):
                return error
        return None

    def explain(
        self, exc: BaseException, what: str, started: float, subject: str | None = None
    ) -> ReachError:
        """``translate_error``, but a timeout after a refusal is the refusal, and a timeout
        or a lost connection while the connection is down says why it is down."""
        err = translate_error(exc, what)
        if isinstance(err, ReachTimeout):
            refused = self.since(started, subject)
            if refused is not None:
                return _denied(what, refused)
        if isinstance(err, ReachTimeout | Disconnected) and self._link and self._link.down:
            return Disconnected(f"{what}: {self._link.describe()}")
        return err

    async def guard(
        self, operation: Awaitable[_T], what: str, refuses: Callable[[str], bool]
    ) -> _T:
        """Await ``operation``, ended by PermissionDenied as soon as the server reports a
        refusal that ``refuses`` recognises (the subject it publishes to) instead of when
        its timeout ends. It runs in the current task, which a refusal cancels the way
        ``asyncio.timeout`` does: no task of its own, and a cancellation from outside
        stays a cancellation."""
        me = asyncio.current_task()
        if me is None:  # pragma: no cover - every caller runs in a task
            return await operation
        refused: list[str] = []

        def stop(error: str) -> None:
            if not refused:
                refused.append(error)
                me.cancel()

        self._waiting[stop] = refuses
        try:
            return await operation
        except asyncio.CancelledError:
            if refused and me.uncancel() == 0:  # ours alone: the refusal, not a cancel
                raise _denied(what, refused[0]) from None
            raise
        finally:
            del self._waiting[stop]


def _denied(what: str, refused: str) -> PermissionDenied:
    return PermissionDenied(
        f"{what}: the NATS server refused these credentials ({refused});"
        " use credentials allowed to do this (an admin's for operator commands)"
    )


def _refusal_of(subject: str | None) -> Callable[[str], bool]:
    """Recognises a refusal to publish to ``subject`` (nats-py reports it in lower case),
    or, for None, of any JetStream or KV subject."""
    if subject is not None:
        quoted = f'"{subject.lower()}"'
        return lambda error: quoted in error
    return lambda error: '"$js.' in error or '"$kv.' in error


def _api_refusal_of(request: str, stream: str) -> Callable[[str], bool]:
    """Recognises a refusal of the JetStream API ``request`` (``STREAM.INFO``,
    ``CONSUMER.CREATE``) about ``stream``: ``$JS.API.<request>.<stream>[.…]`` (nats-py
    reports it in lower case). Another request about the stream, refused at the same
    moment, does not end this one."""
    prefix = f'"$js.api.{request.lower()}.{stream.lower()}'
    return lambda error: prefix + '"' in error or prefix + "." in error


def _permission_error(exc: BaseException) -> bool:
    return "permissions violation" in str(exc).lower()


class Connection:
    """A connected NATS client, narrowed to what Agent-Reach uses."""

    def __init__(
        self,
        nc: _NatsClient,
        denials: Denials | None = None,
        user: str | None = None,
        inbox_prefix: str = "_INBOX",
        link: Link | None = None,
    ) -> None:
        self._nc = nc
        #: up, or down since when and why (``describe`` words it for errors)
        self.link = link or Link(str(nc.options.get("name") or ""), [], user, None)
        #: the token this connection writes audit batches under: the NATS user the server
        #: logged it in as (a client id, the registrar's service user), on an open fabric
        #: ``subjects.ANONYMOUS``; the server's permissions hold each client to its own
        self.writer = subjects.writer_token(user)
        #: refusals the server reported on this connection (see ``Denials``)
        self.denials = denials or Denials()
        self._js = nc.jetstream()
        self._writer = Writer(nc)
        self._mux = ReplyMux(nc, self._writer, inbox_prefix)
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
        return nc.login_waited() if isinstance(nc, Client) else None

    @property
    def max_payload(self) -> int:
        return int(self._nc.max_payload)

    @property
    def raw_request(self) -> RawRequest:
        """Request/reply for the call hot path: ``(subject, data, timeout, batch)`` → the
        reply's bytes (nats-py errors: ``translate_error``). With ``batch``, requests to one
        subject made in one turn of the event loop may travel as one (``reach.wire``)."""
        request: RawRequest = self._mux.request
        return request

    def reply_batch(self, msg: Message) -> ReplyBatch:
        """Where the replies to the batch of requests in ``msg`` are collected."""
        return ReplyBatch(self._writer, msg.reply, batch_bytes(self._nc))

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
                self._mux.request(subject, data, timeout, False), subject, _refusal_of(subject)
            )
        except PermissionDenied:
            raise
        except Exception as exc:
            raise self.denials.explain(exc, subject, started, subject) from exc

    async def publish(self, subject: str, data: bytes, reply: str = "") -> None:
        try:
            await self._nc.publish(subject, data, reply=reply)
        except Exception as exc:
            raise translate_error(exc, subject) from exc

    async def respond(self, msg: Message, data: bytes) -> None:
        """Reply to a request; never echoes the request's headers (unlike ``Msg.respond``)."""
        self._writer.respond(msg.reply, data)

    def replier(self) -> Callable[[str, bytes], None]:
        """The call path's ``respond``, from synchronous code: ``(reply subject, data)``;
        a reply that cannot go out is logged and dropped (the caller retries elsewhere)."""
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
            sub = await subscribe_inline(self._nc, subject, handler, queue)
        except Exception as exc:
            raise translate_error(exc, subject) from exc
        return Subscription(sub)

    async def flush(self, timeout: int = 5) -> None:
        """Return once the server has processed everything sent so far (SUBs included)."""
        try:
            await barrier(self._nc, timeout)
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
        follow it without a JetStream consumer (``reach.kvfollow``); a bucket opened with
        ``create`` that lacks this is updated. Never for a bucket of secrets: anyone who
        may subscribe there sees every value."""
        started = time.monotonic()
        stream = f"KV_{bucket}"
        try:
            info = await self.denials.guard(
                self._js.stream_info(stream),
                f"open KV bucket {bucket}",
                _api_refusal_of("STREAM.INFO", stream),
            )
        except PermissionDenied:
            raise
        except nats.js.errors.NotFoundError:
            if not create:
                raise ConfigurationError(f"KV bucket {bucket} does not exist") from None
            try:
                await self._js.create_key_value(
                    KeyValueConfig(
                        bucket=bucket,
                        history=history,
                        replicas=replicas,
                        ttl=ttl,
                        storage=StorageType.FILE,
                        direct=public,
                        republish=_republish(bucket) if public else None,
                    )
                )
            except Exception as exc:
                raise self.denials.explain(exc, f"create KV bucket {bucket}", started) from exc
            follow = public
        except Exception as exc:
            raise self.denials.explain(exc, f"open KV bucket {bucket}", started) from exc
        else:
            follow = _is_public(info.config, bucket)
            if public and create and not follow:
                await self._make_public(info.config, bucket, started)
                follow = True
        # gets go to the stream leader, not to direct gets answered by any replica (a
        # replica still catching up would report records as missing), unless asked:
        # ``direct_gets``, where readers may read only some keys, and NATS permissions
        # can name a key only in a direct get's subject
        kv = KeyValue(bucket, stream, f"$KV.{bucket}.", self._js, direct_gets and follow)
        return KVBucket(bucket, kv, self.denials, self if follow else None, self)

    async def _make_public(self, config: StreamConfig, bucket: str, started: float) -> None:
        config.allow_direct = True
        config.republish = _republish(bucket)
        try:
            await self._js.update_stream(config)
        except Exception as exc:
            raise self.denials.explain(exc, f"update KV bucket {bucket}", started) from exc

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
    ) -> Stream:
        """A JetStream stream; with ``create``, made (or its limits updated) if needed.

        Streams made here are file-backed and deny delete and purge: what they hold is
        a record, and nobody edits a record. ``check=False`` skips asking the server
        whether it exists (a publisher without JetStream API permissions).
        """
        started = time.monotonic()
        if create:
            config = StreamConfig(
                name=name,
                subjects=list(subjects),
                storage=StorageType.FILE,
                max_age=max_age or None,
                max_bytes=max_bytes,
                num_replicas=replicas,
                duplicate_window=duplicate_window,
                discard=DiscardPolicy.OLD,
                deny_delete=True,
                deny_purge=True,
            )
            try:
                await self._js.stream_info(name)
            except nats.js.errors.NotFoundError:
                try:
                    await self._js.add_stream(config)
                except Exception as exc:
                    raise self.denials.explain(exc, f"create stream {name}", started) from exc
            except Exception as exc:
                raise self.denials.explain(exc, f"open stream {name}", started) from exc
            else:
                try:
                    await self._js.update_stream(config)
                except Exception as exc:
                    raise self.denials.explain(exc, f"update stream {name}", started) from exc
        elif check:
            try:
                await self.denials.guard(
                    self._js.stream_info(name),
                    f"open stream {name}",
                    _api_refusal_of("STREAM.INFO", name),
                )
            except PermissionDenied:
                raise
            except nats.js.errors.NotFoundError:
                raise ConfigurationError(f"stream {name} does not exist") from None
            except Exception as exc:
                raise self.denials.explain(exc, f"open stream {name}", started) from exc
        return Stream(name, self._js, self.denials)

    async def close(self) -> None:
        self._mux.close()  # requests in flight fail now, not at their deadlines
        if not self._nc.is_closed:
            with contextlib.suppress(Exception):
                await self._nc.close()

    async def drain(self) -> None:
        if not self._nc.is_closed:
            with contextlib.suppress(Exception):
                await self._nc.drain()


_RECONNECTED = object()
_ENDED = object()


def _noop() -> None:
    return None


async def _next_unless(entries: AsyncIterator[Any], reconnected: asyncio.Event) -> Any:
    """The next item of ``entries``; ``_RECONNECTED`` if ``reconnected`` is set first,
    ``_ENDED`` when they end."""
    following = asyncio.ensure_future(anext(entries))
    back = asyncio.ensure_future(reconnected.wait())
    try:
        await asyncio.wait({following, back}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # cancelled: the read goes too
        following.cancel()
        raise
    finally:
        back.cancel()
    if not following.done():
        following.cancel()
        with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
            await following
        return _RECONNECTED
    try:
        return following.result()
    except StopAsyncIteration:
        return _ENDED


def _republish(bucket: str) -> RePublish:
    return RePublish(src=f"$KV.{bucket}.>", dest=f"{republish_prefix(bucket)}.>")


def _is_public(config: StreamConfig, bucket: str) -> bool:
    republish = config.republish
    return bool(
        config.allow_direct
        and republish is not None
        and republish.dest == f"{republish_prefix(bucket)}.>"
        and republish.src in (None, f"$KV.{bucket}.>")
        and not republish.headers_only
    )


def _is_conflict(exc: BaseException) -> bool:
    if isinstance(exc, nats.js.errors.KeyWrongLastSequenceError):
        return True
    return isinstance(exc, nats.js.errors.APIError) and exc.err_code in (10071, 10164)


class KVBucket:
    """JetStream KV operations with compare-and-set, translated to Agent-Reach errors."""

    def __init__(
        self,
        name: str,
        kv: Any,
        denials: Denials | None = None,
        follower: Connection | None = None,
        conn: Connection | None = None,
    ) -> None:
        self._denials = denials or Denials()
        self.name = name
        self._kv = kv
        #: the connection that follows this public bucket without a consumer (None: it
        #: is watched with an ordered consumer, as a bucket of secrets is by admins)
        self._follower = follower
        #: the bucket's connection: an ordered consumer's watch ends when it reconnects
        self._conn = conn

    async def get(self, key: str) -> KVEntry | None:
        started = time.monotonic()
        try:
            entry = await self._kv.get(key)
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
            return None
        except Exception as exc:
            raise self._denials.explain(
                exc, started=started, what=f"KV get {self.name}/{key}"
            ) from exc
        return KVEntry(key, bytes(entry.value or b""), int(entry.revision))

    async def create(self, key: str, value: bytes) -> int:
        """Write only if the key does not exist; KVConflict otherwise."""
        started = time.monotonic()
        try:
            return int(await self._kv.create(key, value))
        except Exception as exc:
            if _is_conflict(exc):
                raise KVConflict(f"{self.name}/{key} already exists") from exc
            raise self._denials.explain(
                exc, started=started, what=f"KV create {self.name}/{key}"
            ) from exc

    async def update(self, key: str, value: bytes, last: int) -> int:
        """Write only if the key is still at revision ``last``; KVConflict otherwise."""
        started = time.monotonic()
        try:
            return int(await self._kv.update(key, value, last=last))
        except Exception as exc:
            if _is_conflict(exc):
                raise KVConflict(f"{self.name}/{key} changed since revision {last}") from exc
            raise self._denials.explain(
                exc, started=started, what=f"KV update {self.name}/{key}"
            ) from exc

    async def put(self, key: str, value: bytes) -> int:
        started = time.monotonic()
        try:
            return int(await self._kv.put(key, value))
        except Exception as exc:
            raise self._denials.explain(
                exc, started=started, what=f"KV put {self.name}/{key}"
            ) from exc

    async def delete(self, key: str, last: int | None = None) -> None:
        """Delete (only if still at revision ``last`` when given); KVConflict otherwise."""
        started = time.monotonic()
        try:
            await self._kv.delete(key, last=last)
        except Exception as exc:
            if _is_conflict(exc):
                raise KVConflict(f"{self.name}/{key} changed since revision {last}") from exc
            raise self._denials.explain(
                exc, started=started, what=f"KV delete {self.name}/{key}"
            ) from exc

    async def watch(self, keys: str) -> AsyncIterator[KVEntry | None]:
        """Current values, then ``None`` once caught up, then every change (deletes flagged)."""
        if self._follower is not None:
            async for change in self._follow(self._follower, keys):
                yield change
            return
        started = time.monotonic()
        try:
            watcher = await self._kv.watch(keys)
        except Exception as exc:
            raise self._denials.explain(
                exc, started=started, what=f"KV watch {self.name}/{keys}"
            ) from exc
        # after a reconnect the server may have lost the consumer (a restart) and nats-py
        # notices only when its heartbeats stay away for a while: the watch ends at once
        # instead, and its reader watches again
        reconnected, forget = (
            self._conn._reconnect_event() if self._conn is not None else (asyncio.Event(), _noop)
        )
        entries = aiter(watcher)
        try:
            while True:
                entry = await _next_unless(entries, reconnected)
                if entry is _RECONNECTED:
                    raise Disconnected(
                        f"KV watch {self.name}/{keys} ended: the connection came back; watch again"
                    )
                if entry is _ENDED:
                    return
                if entry is None:
                    yield None
                    continue
                deleted = entry.operation in ("DEL", "PURGE")
                yield KVEntry(entry.key, bytes(entry.value or b""), int(entry.revision), deleted)
        finally:
            forget()
            with contextlib.suppress(Exception):
                await watcher.stop()

    async def _follow(self, conn: Connection, keys: str) -> AsyncIterator[KVEntry | None]:
        started = time.monotonic()
        reconnected, forget = conn._reconnect_event()
        try:
            async for change in kvfollow.follow(conn._nc, self.name, keys, reconnected):
                yield change
        except (kvfollow.ScanError, TimeoutError, nats.errors.Error) as exc:
            raise self._denials.explain(
                exc, started=started, what=f"KV watch {self.name}/{keys}"
            ) from exc
        finally:
            forget()


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
) -> Connection:
    """Connect to NATS; once connected, reconnect and log in again whatever the server
    answers (a refused login during a failover, or while the login gate is away, is
    transient), with jittered back-off, for ``reconnect_for`` seconds per outage (None:
    ``REACH_RECONNECT_FOR``, by default forever; see ``reach.link``).
    ``prompt_reconnect``: try again every few tens of milliseconds instead, for a
    connection others' logins wait for (a login gate's).

    A first connect whose login is refused raises AuthenticationFailed at once, one whose
    login is not answered LoginUnanswered; neither waits for more tries."""
    link = Link(name, servers, user, resolve_reconnect_for(reconnect_for))
    denials = Denials(link)
    made: list[Connection] = []

    def _on_error(exc: Exception) -> bool:
        if _permission_error(exc):
            log.warning("%s: %s", name, exc)
            denials.add(str(exc))
            return True
        return False

    async def _reconnected() -> None:
        for conn in made:
            conn._reconnected()
        if on_reconnect is not None:
            await on_reconnect()

    async def _disconnected() -> None:
        if on_disconnect is not None:
            await on_disconnect()

    # every connection's inbox is a prefix of its own (``_INBOX.<client_id>`` on a secured
    # fabric, a random token otherwise): call replies go to ``<prefix>.r.…`` (reach.wire)
    inbox_prefix = inbox_prefix or f"_INBOX.{os.urandom(8).hex()}"
    nc = await open_client(
        servers,
        link=link,
        name=name,
        connect_timeout=connect_timeout,
        user=user,
        password=password,
        inbox_prefix=inbox_prefix,
        on_error=_on_error,
        on_reconnect=_reconnected,
        on_disconnect=_disconnected,
        prompt=prompt_reconnect,
    )
    made.append(Connection(nc, denials, user, inbox_prefix, link))
    return made[0]


@dataclass(frozen=True, slots=True)
class StreamMessage:
    subject: str
    data: bytes
    seq: int
    #: when the server stored it, Unix seconds
    time: float
    #: messages after this one that match the reader's filter
    pending: int
    #: the message's headers (a reader asking for headers only gets these and no data)
    headers: Mapping[str, str] = field(default_factory=dict)


class Stream:
    """Idempotent publishing (message ids, acks) and ordered reads of one stream."""

    def __init__(self, name: str, js: Any, denials: Denials | None = None) -> None:
        self.name = name
        self._js = js
        self._denials = denials or Denials()

    async def publish(
        self,
        subject: str,
        data: bytes,
        *,
        msg_id: str,
        timeout: float,
        headers: Mapping[str, str] | None = None,
    ) -> int:
        """Store ``data`` (with ``headers``) once: a resend with the same ``msg_id`` is not
        stored twice."""
        started = time.monotonic()
        try:
            ack = await self._js.publish(
                subject,
                data,
                timeout=timeout,
                stream=self.name,
                headers={**(headers or {}), "Nats-Msg-Id": msg_id},
            )
        except nats.js.errors.NoStreamResponseError as exc:
            raise NoResponders(f"no stream answers on {subject} ({self.name})") from exc
        except Exception as exc:
            raise self._denials.explain(exc, f"publish to {self.name}", started, subject) from exc
        return int(ack.seq)

    async def read(
        self,
        subject: str = ">",
        *,
        since: float | None = None,
        new_only: bool = False,
        follow: bool = False,
        headers_only: bool = False,
    ) -> AsyncIterator[StreamMessage]:
        """Stored messages from ``since`` (Unix seconds; all when None, none with
        ``new_only``) in order; then, with ``follow``, new ones as they arrive. With
        ``headers_only`` the server sends their headers alone (``data`` is empty; ``get``
        fetches a message's data by its sequence)."""
        if new_only:
            policy, start = DeliverPolicy.NEW, None
        elif since is not None:
            policy = DeliverPolicy.BY_START_TIME
            start = datetime.datetime.fromtimestamp(since, tz=datetime.UTC)
        else:
            policy, start = DeliverPolicy.ALL, None
        started = time.monotonic()
        try:
            sub = await self._denials.guard(
                self._js.subscribe(
                    subject,
                    stream=self.name,
                    ordered_consumer=True,
                    deliver_policy=policy,
                    config=ConsumerConfig(opt_start_time=start) if start else None,
                    headers_only=headers_only or None,
                ),
                f"read {self.name}",
                _api_refusal_of("CONSUMER.CREATE", self.name),
            )
        except PermissionDenied:
            raise
        except Exception as exc:
            raise self._denials.explain(exc, f"read {self.name}", started) from exc
        try:
            if new_only and not follow:
                return
            # history only: stop at the last matching message (num_pending 0); if the
            # server counts none pending, only messages already on the wire are left
            quiet: float | None = None
            if not follow:
                info = await sub.consumer_info()
                quiet = _HISTORY_QUIET if not info.num_pending else _HISTORY_STALL
            while True:
                try:
                    msg = await sub.next_msg(timeout=quiet)
                except nats.errors.TimeoutError:
                    return
                meta = msg.metadata
                yield StreamMessage(
                    msg.subject,
                    bytes(msg.data),
                    int(meta.sequence.stream),
                    meta.timestamp.timestamp(),
                    int(meta.num_pending),
                    dict(msg.headers or {}),
                )
                if not follow and not meta.num_pending:
                    return
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def get(self, seq: int) -> bytes:
        """The data of the message stored as ``seq``."""
        return (await self.get_message(seq))[1]

    async def get_message(self, seq: int) -> tuple[str, bytes]:
        """The subject and data of the message stored as ``seq``."""
        started = time.monotonic()
        try:
            msg = await self._js.get_msg(self.name, seq)
        except Exception as exc:
            raise self._denials.explain(exc, f"get message {seq} of {self.name}", started) from exc
        return str(msg.subject or ""), bytes(msg.data or b"")
