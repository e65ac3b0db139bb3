"""JetStream streams: idempotent publishing (message ids, acks) and ordered reads."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import nats.errors
import nats.js.errors
from nats.js.api import ConsumerConfig, DeliverPolicy, DiscardPolicy, StorageType, StreamConfig

from reach.errors import ConfigurationError, NoResponders, PermissionDenied
from reach.transport.denials import Denials, api_refusal_of

__all__ = ["Stream", "StreamMessage", "open_stream"]

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
        sub = await self._subscribe(subject, since, new_only, headers_only)
        try:
            if new_only and not follow:
                return
            # history only: stop at the last matching message (num_pending 0); if the
            # server counts none pending, only messages already on the wire are left, and
            # if it has sent none either, there is nothing to read: a command that reads
            # an empty window answers at once
            quiet: float | None = _FOLLOW_CHECK
            if not follow:
                info = await sub.consumer_info()
                sent = info.delivered.consumer_seq if info.delivered is not None else 0
                if not info.num_pending and not sent:
                    return
                quiet = _HISTORY_QUIET if not info.num_pending else _HISTORY_STALL
            seen_reconnects = self._reconnects()
            last = 0
            while True:
                try:
                    msg = await sub.next_msg(timeout=quiet)
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

        sub = await self._subscribe(subject, since, False, False, cb=deliver)
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
) -> Stream:
    """The stream ``name`` (see ``Connection.stream``), made or updated with ``create``,
    asked whether it exists with ``check``."""
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
        await _create_or_update(js, denials, config)
    elif check:
        await _exists(js, denials, name)
    return Stream(name, js, denials, reconnects)


async def _create_or_update(js: Any, denials: Denials, config: StreamConfig) -> None:
    name = config.name
    started = time.monotonic()
    try:
        await js.stream_info(name)
    except nats.js.errors.NotFoundError:
        try:
            await js.add_stream(config)
        except Exception as exc:
            raise denials.explain(exc, f"create stream {name}", started) from exc
    except Exception as exc:
        raise denials.explain(exc, f"open stream {name}", started) from exc
    else:
        try:
            await js.update_stream(config)
        except Exception as exc:
            raise denials.explain(exc, f"update stream {name}", started) from exc


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
