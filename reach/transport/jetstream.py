"""JetStream streams: idempotent publishing (message ids, acks) and ordered reads.

A stream with a size cap is made to fit its store: nats-server reserves the cap of each
stream within its storage limit, which it sets at its start to 75 % of the disk space
then free where its store is, and refuses a stream (or any change to one) once the
reservations pass it. So a cap is reserved only where as much again stays free (a
restart of the server on a fuller disk still finds room), halved until it fits, down to
a floor; an existing stream keeps the cap it was made with, and is updated only when
what it was asked for changed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import logging
import math
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import nats.errors
import nats.js.errors
from nats.js.api import ConsumerConfig, DeliverPolicy, DiscardPolicy, StorageType, StreamConfig

from reach.errors import ConfigurationError, NoResponders, PermissionDenied, StoreFull
from reach.transport.denials import Denials, api_refusal_of

__all__ = ["Stream", "StreamMessage", "open_stream"]

log = logging.getLogger("reach.transport")

#: the share of the disk space free at its start that nats-server grants its streams
SERVER_STORE_SHARE = 0.75

#: reading a stream's history: wait for stragglers when none are pending, or for the next
_HISTORY_QUIET = 0.3
_HISTORY_STALL = 10.0
#: a follower with nothing to read checks this often whether the connection came back
_FOLLOW_CHECK = 1.0


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

    def __init__(
        self,
        name: str,
        js: Any,
        denials: Denials | None = None,
        reconnects: Callable[[], int] = lambda: 0,
    ) -> None:
        self.name = name
        self._js = js
        self._denials = denials or Denials()
        #: how many times the connection has come back (``Connection.reconnects``)
        self._reconnects = reconnects

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
            raise await self._denials.store.explain(
                NoResponders(f"no stream answers on {subject} ({self.name})"),
                f"publish to {self.name}",
            ) from exc
        except Exception as exc:
            raise await self._denials.explain_write(
                exc, f"publish to {self.name}", started, subject
            ) from exc
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
        messages = await self.start_read(
            subject, since=since, new_only=new_only, follow=follow, headers_only=headers_only
        )
        async with contextlib.aclosing(messages):
            async for msg in messages:
                yield msg

    async def start_read(
        self,
        subject: str = ">",
        *,
        since: float | None = None,
        new_only: bool = False,
        follow: bool = False,
        headers_only: bool = False,
    ) -> AsyncGenerator[StreamMessage, None]:
        """``read``, started: its consumer made (and, reading history, the messages to
        read counted) when this returns, so that a failure to start is raised here and
        not by the first message. Iterate what it returns at once: that ends the
        consumer when it ends."""
        sub = await self._subscribe(subject, since, new_only, headers_only)
        # history only: stop at the last matching message (num_pending 0); if the
        # server counts none pending, only messages already on the wire are left, and if
        # it has sent none either, there is nothing to read: a command that reads an empty
        # window answers at once
        quiet = _FOLLOW_CHECK
        empty = False
        if not follow and not new_only:
            started = time.monotonic()
            counted = False
            try:
                info = await sub.consumer_info()
                counted = True
            except Exception as exc:
                raise self._denials.explain(exc, f"read {self.name}", started) from exc
            finally:
                if not counted:  # (cancelled too) the consumer goes with the read
                    with contextlib.suppress(Exception):
                        await sub.unsubscribe()
            sent = info.delivered.consumer_seq if info.delivered is not None else 0
            empty = not info.num_pending and not sent
            quiet = _HISTORY_QUIET if not info.num_pending else _HISTORY_STALL
        return self._messages(sub, subject, since, new_only, follow, headers_only, quiet, empty)

    async def _messages(
        self,
        sub: Any,
        subject: str,
        since: float | None,
        new_only: bool,
        follow: bool,
        headers_only: bool,
        quiet: float,
        empty: bool = False,
    ) -> AsyncGenerator[StreamMessage, None]:
        """What ``read`` yields from the consumer ``sub``, which it ends when it ends
        (``empty``: at once, the server having nothing to send)."""
        try:
            if empty or (new_only and not follow):
                return
            seen_reconnects = self._reconnects()
            last = 0
            while True:
                try:
                    msg = await _next_msg(sub, quiet)
                except nats.errors.TimeoutError:
                    if not follow:
                        return
                    if self._reconnects() == seen_reconnects:
                        continue
                    # the connection came back: a server that restarted, or another node
                    # of the cluster, holds no consumer of ours and would send nothing
                    # (and say nothing); a new one goes on after the last message read
                    seen_reconnects = self._reconnects()
                    sub = await self._again(sub, subject, since, new_only, headers_only, last)
                    continue
                meta = msg.metadata
                seq = int(meta.sequence.stream)
                if seq <= last:
                    continue  # sent again by a consumer made after a reconnect
                last = seq
                yield StreamMessage(
                    msg.subject,
                    bytes(msg.data),
                    seq,
                    meta.timestamp.timestamp(),
                    int(meta.num_pending),
                    dict(msg.headers or {}),
                )
                if not follow and not meta.num_pending:
                    return
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def follow(
        self,
        subject: str,
        handle: Callable[[StreamMessage], None],
        *,
        since: float | None = None,
    ) -> None:
        """What ``read(subject, since=since, follow=True)`` yields, handed to ``handle``
        as each message arrives (called on the event loop, not awaited), until cancelled;
        raises what ``handle`` raises. For a reader of every message of a busy stream:
        a message costs a call, not a wait for it."""
        await (await self.start_follow(subject, handle, since=since))

    async def start_follow(
        self,
        subject: str,
        handle: Callable[[StreamMessage], None],
        *,
        since: float | None = None,
    ) -> Coroutine[Any, Any, None]:
        """``follow``, started: its consumer made when this returns (a failure to start is
        raised here); await what it returns at once, which follows until cancelled."""
        last = 0
        failed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        async def deliver(msg: Any) -> None:
            nonlocal last
            if failed.done():
                return
            try:
                meta = msg.metadata
                seq = int(meta.sequence.stream)
                if seq <= last:
                    return  # sent again by a consumer made after a reconnect
                last = seq
                handle(
                    StreamMessage(
                        msg.subject, bytes(msg.data), seq, meta.timestamp.timestamp(),
                        int(meta.num_pending), dict(msg.headers or {}),
                    )
                )  # fmt: skip
            except Exception as exc:
                failed.set_exception(exc)

        async def following(sub: Any) -> None:
            try:
                seen_reconnects = self._reconnects()
                while True:
                    await asyncio.wait({failed}, timeout=_FOLLOW_CHECK)
                    if failed.done():
                        failed.result()
                    if self._reconnects() == seen_reconnects:
                        continue
                    # as in ``read``: a new consumer goes on after the last message handled
                    seen_reconnects = self._reconnects()
                    sub = await self._again(sub, subject, since, False, False, last, deliver)
            finally:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()

        return following(await self._subscribe(subject, since, False, False, cb=deliver))

    async def _again(
        self,
        sub: Any,
        subject: str,
        since: float | None,
        new_only: bool,
        headers_only: bool,
        last: int,
        cb: Callable[[Any], Coroutine[Any, Any, None]] | None = None,
    ) -> Any:
        """After the connection came back: a server that restarted, or another node of
        the cluster, holds no consumer of ours and would send nothing (and say nothing),
        so the old one goes and a new one starts after the last message read (``last``;
        0: none yet, from where ``read`` starts)."""
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
        return await self._subscribe(
            subject, since, new_only, headers_only, after=last or None, cb=cb
        )

    async def _subscribe(
        self,
        subject: str,
        since: float | None,
        new_only: bool,
        headers_only: bool,
        after: int | None = None,
        cb: Callable[[Any], Coroutine[Any, Any, None]] | None = None,
    ) -> Any:
        """An ordered consumer of ``subject`` from where ``read`` starts (or from the
        message after the sequence ``after``)."""
        config: ConsumerConfig | None = None
        if after is not None:
            policy, start = DeliverPolicy.BY_START_SEQUENCE, None
            config = ConsumerConfig(opt_start_seq=after + 1)
        elif new_only:
            policy, start = DeliverPolicy.NEW, None
        elif since is not None:
            policy = DeliverPolicy.BY_START_TIME
            start = datetime.datetime.fromtimestamp(since, tz=datetime.UTC)
        else:
            policy, start = DeliverPolicy.ALL, None
        started = time.monotonic()
        try:
            return await self._denials.guard(
                self._js.subscribe(
                    subject,
                    stream=self.name,
                    ordered_consumer=True,
                    deliver_policy=policy,
                    config=ConsumerConfig(opt_start_time=start) if start else config,
                    headers_only=headers_only or None,
                    cb=cb,
                ),
                f"read {self.name}",
                api_refusal_of("CONSUMER.CREATE", self.name),
            )
        except PermissionDenied:
            raise
        except Exception as exc:
            raise self._denials.explain(exc, f"read {self.name}", started) from exc

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


async def open_stream(
    js: Any,
    denials: Denials,
    name: str,
    subjects: Sequence[str],
    *,
    create: bool,
    check: bool,
    max_age: float,
    max_bytes: int,
    replicas: int,
    duplicate_window: float,
    reconnects: Callable[[], int] = lambda: 0,
    min_bytes: int = 0,
) -> Stream:
    """The stream ``name`` (see ``Connection.stream``), made or updated with ``create``,
    asked whether it exists with ``check``. ``min_bytes``: a new stream's size cap may
    be halved from ``max_bytes`` down to this to fit the store (0: ``max_bytes`` or
    nothing)."""
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
        await _create_or_update(js, denials, config, min_bytes)
    elif check:
        await _exists(js, denials, name)
    return Stream(name, js, denials, reconnects)


async def _create_or_update(
    js: Any, denials: Denials, config: StreamConfig, min_bytes: int
) -> None:
    name = config.name
    started = time.monotonic()
    try:
        info = await js.stream_info(name)
    except nats.js.errors.NotFoundError:
        await _create(js, denials, config, min_bytes)
        return
    except Exception as exc:
        raise denials.explain(exc, f"open stream {name}", started) from exc
    # the cap it was made with stays: it was fitted to the store then
    wanted = dataclasses.replace(config, max_bytes=info.config.max_bytes)
    if _same(info.config, wanted):
        return
    try:
        await js.update_stream(wanted)
    except Exception as exc:
        raise denials.explain(exc, f"update stream {name}", started) from exc


def _same(have: StreamConfig, want: StreamConfig) -> bool:
    """Whether a stream configured as ``have`` is already what ``want`` asks for."""
    return (
        sorted(have.subjects or ()) == sorted(want.subjects or ())
        and math.isclose(have.max_age or 0.0, want.max_age or 0.0, abs_tol=1e-3)
        and (have.max_bytes or -1) == (want.max_bytes or -1)
        and (have.num_replicas or 1) == (want.num_replicas or 1)
        and math.isclose(have.duplicate_window or 0.0, want.duplicate_window or 0.0, abs_tol=1e-3)
        and have.discard == want.discard
        and have.storage == want.storage
        and have.deny_delete == want.deny_delete
        and have.deny_purge == want.deny_purge
    )


async def _create(js: Any, denials: Denials, config: StreamConfig, min_bytes: int) -> None:
    """Make the stream; a size cap the store has no room for is halved down to
    ``min_bytes`` (reserved where twice it fits, then narrowed), else StoreFull."""
    name = config.name
    want = config.max_bytes or -1
    started = time.monotonic()
    if want <= 0 or min_bytes <= 0:
        try:
            await js.add_stream(config)
        except Exception as exc:
            raise denials.explain(exc, f"create stream {name}", started) from exc
        return
    size, min_bytes = want, min(min_bytes, want)
    while size >= min_bytes:
        try:
            await js.add_stream(dataclasses.replace(config, max_bytes=2 * size))
        except Exception as exc:
            err = denials.explain(exc, f"create stream {name}", started)
            if not isinstance(err, StoreFull):
                raise err from exc
            size //= 2
            continue
        try:
            await js.update_stream(dataclasses.replace(config, max_bytes=size))
        except Exception as exc:
            raise denials.explain(exc, f"create stream {name}", started) from exc
        if size < want:
            log.warning(
                "stream %s: the store has no room for a size cap of %s with as much again"
                " free; its cap is %s",
                name,
                _mib(want),
                _mib(size),
            )
        return
    need = math.ceil(2 * min_bytes / SERVER_STORE_SHARE)
    problem = f"no room for stream {name}"
    raise StoreFull(
        f"create stream {name}: the JetStream store has no room for it: its size cap"
        f" needs at least {_mib(min_bytes)} with as much again free within the server's"
        f" storage limit, which is {SERVER_STORE_SHARE:.0%} of the disk space free where"
        f" the server keeps its store, counted at its start: free at least {_mib(need)}"
        " there (beside what the store holds) and start the server again",
        problem=problem,
    )


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.0f} MiB"


async def _exists(js: Any, denials: Denials, name: str) -> None:
    started = time.monotonic()
    try:
        await denials.guard(
            js.stream_info(name), f"open stream {name}", api_refusal_of("STREAM.INFO", name)
        )
    except PermissionDenied:
        raise
    except nats.js.errors.NotFoundError:
        raise ConfigurationError(f"stream {name} does not exist") from None
    except Exception as exc:
        raise denials.explain(exc, f"open stream {name}", started) from exc


async def _next_msg(sub: Any, timeout: float) -> Any:
    """The consumer's next message; ``nats.errors.TimeoutError`` after ``timeout``.

    nats-py waits for it in a task of its own, through which a cancellation of the
    reader is passed on; when the message (or the timeout) comes at the same moment,
    Python 3.11's ``asyncio.wait_for`` keeps the message and drops the cancellation, and a
    reader that is told to stop (Ctrl-C on ``reach audit tail --follow``) would read on.
    A cancellation asked for meanwhile is raised here instead."""
    try:
        return await sub.next_msg(timeout=timeout)
    finally:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise asyncio.CancelledError
