"""The call path's socket plumbing: how its messages get through nats-py quickly.

Messages go to a handler as soon as the connection's reader parses them (no task hop),
and publishes go straight to the socket when it is quiet, the rest of a turn of the
event loop in one write. This reaches into nats-py's internals (its outgoing buffer,
its transport's socket, a subscription's pending queue): ``internals`` lists each one,
checks them at the first connect, and without them (``REACH_NATS_INTERNALS=off``) the
same functions take nats-py's public API. ``connection`` and ``mux`` build on these.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from nats.aio.client import Client as _NatsClient
from nats.aio.msg import Msg as _NatsMsg
from nats.aio.subscription import Subscription as _NatsSubscription

from reach.tasks import step_now

__all__ = [
    "REPLY_PREFIXES",
    "InlineDelivery",
    "Writer",
    "barrier",
    "pub_command",
    "subscribe_inline",
]

log = logging.getLogger("reach.transport")


class InlineDelivery:
    """Stands in for a nats-py subscription's pending queue: each message goes to
    ``deliver`` as soon as the connection's reader task has parsed it.

    nats-py queues every message for a task of the subscription's own; that hop (a queue
    put, a task wake-up, one more trip through the event loop) is paid once on each side
    of every call. ``deliver`` must not block and should not raise
    (an exception is logged and the message dropped, the connection keeps reading).
    """

    __slots__ = ("_deliver", "_sub")

    def __init__(self, sub: _NatsSubscription, deliver: Callable[[_NatsMsg], None]) -> None:
        self._sub = sub
        self._deliver = deliver

    def put_nowait(self, msg: _NatsMsg) -> None:
        self._sub._pending_size -= len(msg.data)  # nats-py counted it as queued
        self.deliver(msg)

    def deliver(self, msg: _NatsMsg) -> None:
        """Hand ``msg`` to the handler (``reach.transport.protocol`` calls this directly)."""
        try:
            self._deliver(msg)
        except Exception:
            log.exception("handler of %s failed", msg.subject)

    # what nats-py asks of a pending queue besides put_nowait: it is always empty
    def qsize(self) -> int:
        return 0

    def empty(self) -> bool:
        return True

    def task_done(self) -> None:
        pass

    async def join(self) -> None:
        return None


async def subscribe_inline(
    nc: _NatsClient,
    subject: str,
    deliver: Callable[[_NatsMsg], None],
    queue: str = "",
    *,
    inline: bool = True,
) -> _NatsSubscription:
    """Subscribe ``deliver`` to ``subject``: called as each message is parsed (``inline``,
    through nats-py's internals), else from the subscription's task as nats-py does."""

    async def _cb(msg: _NatsMsg) -> None:  # what runs without the internals
        deliver(msg)

    sub = await nc.subscribe(subject, queue=queue, cb=_cb, pending_msgs_limit=65536)
    if inline:
        # untyped: nats-py declares its task attribute only as the None it starts as, and
        # compiled code would check every value read from it against that
        internal: Any = sub
        task = internal._wait_for_msgs_task
        if task is not None:
            task.cancel()  # not started yet: it never takes a message
        internal._wait_for_msgs_task = None
        internal._pending_queue = InlineDelivery(sub, deliver)
    return sub


#: publishes that had to wait for the outgoing buffer to drain, kept until they are done
_finishing: set[asyncio.Task[None]] = set()


#: where replies may go: clients' inboxes (nats-py's ``_INBOX``, ``_INBOX.<client_id>`` on
#: a secured fabric), nats-server's own (an auth callout request's) and the one-time
#: subjects that carry an answer back across accounts to the requester's inbox (a request
#: that came through a service import)
REPLY_PREFIXES = ("_INBOX.", "$SYS._INBOX.", "_R_.")


def pub_command(subject: str, reply: str, data: bytes) -> bytes:
    """The protocol's PUB of ``data`` to ``subject``, answered on ``reply`` (none if empty)."""
    return f"PUB {subject} {reply} {len(data)}\r\n".encode() + data + b"\r\n"


def _run_now(coro: Coroutine[Any, Any, Any]) -> None:
    """Run a nats-py coroutine from synchronous code; its errors (first step) are raised."""
    task = step_now(coro)
    if task is not None:  # the outgoing buffer was full: a flush is under way
        _finishing.add(task)
        task.add_done_callback(_finishing.discard)


class Writer:
    """The call path's publishes: written to the socket by this module, not nats-py's flusher.

    nats-py queues a publish for its flusher task, which writes on a later turn of the
    event loop, through a queue, a future and a task step each time. On the call path that
    is a turn of latency per message. Here a message goes out at once when the connection
    is otherwise quiet (the first write of this turn, nothing queued before it: order is
    kept); what follows in the same turn is queued in nats-py's own buffer and written in
    one piece at the end of the turn. Anything unusual (disconnected, a message over
    max_payload, a socket that is not keeping up, a transport without a stream writer)
    takes nats-py's path, with its errors, buffering and flow control; so does every
    message of a writer without ``internals``.
    """

    __slots__ = ("_direct", "_nc", "_turn")

    def __init__(self, nc: _NatsClient, internals: bool = True) -> None:
        self._nc = nc
        #: whether messages may go to the socket directly (through nats-py's internals)
        self._direct = internals
        #: a write happened (or is queued) in this turn; the turn's end writes the rest
        self._turn = False

    @property
    def internals(self) -> bool:
        """Whether this writer (and what builds on it) uses nats-py's internals."""
        return self._direct

    def _socket(self, size: int) -> Any:
        """The asyncio transport to write to now, or None (use nats-py's publish)."""
        nc = self._nc
        if not self._direct or not nc.is_connected or size > nc._max_payload:
            return None
        transport = getattr(getattr(nc._transport, "_io_writer", None), "transport", None)
        if transport is None or transport.get_write_buffer_size():
            return None  # the socket is behind: nats-py's flusher drains it
        return transport

    def publish(self, subject: str, data: bytes, reply: str = "", *, now: bool = True) -> None:
        """Publish from synchronous code; nats-py's errors are raised. ``now=False``: with
        the rest of this turn's messages, even if it would be the first."""
        nc = self._nc
        transport = self._socket(len(data))
        if transport is None:
            _run_now(nc.publish(subject, data, reply=reply))
            return
        cmd = pub_command(subject, reply, data)
        stats = nc.stats
        stats["out_msgs"] += 1
        stats["out_bytes"] += len(data)
        if now and not self._turn and not nc._pending_data_size:
            transport.write(cmd)
        else:
            nc._pending.append(cmd)
            nc._pending_data_size += len(cmd)
        if not self._turn:
            self._turn = True
            asyncio.get_running_loop().call_soon(self._end_turn)

    def respond(self, reply: str, data: bytes, *, now: bool = True) -> None:
        """Answer a request on its ``reply`` subject (none: nothing to do). A reply that
        cannot go out is logged and dropped: the caller times out and retries elsewhere,
        the responder keeps going. ``now`` as for ``publish``."""
        if not reply:
            return
        if not reply.startswith(REPLY_PREFIXES):
            # NATS does not check a request's reply subject, and a responder may publish to
            # it: "$JS.API.STREAM.PURGE.…" as a reply would purge a stream with the
            # responder's rights. Replies go to inboxes, never anywhere else.
            log.warning("refused to reply on %r: not an inbox", reply[:200])
            return
        try:
            self.publish(reply, data, now=now)
        except Exception as exc:
            log.debug("could not reply on %s: %s", reply, exc)

    def _end_turn(self) -> None:
        self._turn = False
        nc = self._nc
        if not nc._pending_data_size:
            return
        transport = self._socket(0)
        if transport is None:
            _run_now(nc._flush_pending())  # nats-py's flusher writes (or buffers) them
            return
        transport.writelines(nc._pending)
        nc._pending = []
        nc._pending_data_size = 0


async def barrier(nc: _NatsClient, timeout: int = 5, *, internals: bool = True) -> None:
    """Return once the server has processed everything this client sent so far.

    nats-py's ``flush()`` writes its PING straight to the socket, ahead of commands still
    in the client's buffer, so its PONG alone does not prove that a SUB sent just before
    is in place (seen as "no responders" from another connection right after, and as a
    subscription the server read after another connection's publishes). The buffer is
    written first here (nats-py's flusher, waited for), then the PING follows it.

    Without ``internals``: two flushes. The flusher task, woken by the buffered commands
    before the first PING went out, runs before that PING's PONG can be read, so the
    second PING follows everything buffered.
    """
    if not internals:
        await nc.flush(timeout=timeout)
        await nc.flush(timeout=timeout)
        return
    if nc._pending_data_size:
        await asyncio.wait_for(nc._flush_pending(force_flush=True), timeout)
    await nc.flush(timeout=timeout)
