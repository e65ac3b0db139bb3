"""Request/reply for the call path: one inbox subscription, unguessable reply tokens, one
timer for every request in flight, and batches.

Requests (and replies) to one subject in one turn of the event loop travel as one
message (``reach.wire.envelope`` "Batch") while others are in flight. Publishes and
subscriptions go through ``natsio``.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import os

import nats.errors
from nats.aio.client import Client as _NatsClient
from nats.aio.msg import Msg as _NatsMsg

from reach.errors import ReachError
from reach.transport.natsio import Writer, barrier, subscribe_inline
from reach.wire import envelope

__all__ = [
    "CALL_REPLY_MARK",
    "ReplyBatch",
    "ReplyMux",
    "ReplyTokens",
    "batch_bytes",
    "call_reply_base",
]

log = logging.getLogger("reach.transport")


#: a batch of requests to one subject is sent once it holds this many (or this many bytes);
#: small enough that several batches are in flight at high concurrency, so caller, server
#: and callee keep working side by side instead of taking turns on one big batch
_BATCH_ITEMS = 16
_BATCH_BYTES = 64 * 1024
#: what a request adds to a batch besides its bytes: its token and msgpack framing
_ITEM_OVERHEAD = 24

#: the token after a client's inbox prefix that marks the reply subjects of its requests:
#: ``<inbox prefix>.r.<base>.<token>``. On a secured fabric agents may publish only there
#: (``subjects.CALL_REPLIES``) and to the discovery space a tool asking ``$SRV`` chooses
#: (``subjects.SRV_REPLIES``), never to the rest of anyone's inbox, where nats-py's own
#: requests (JetStream API answers, KV watches) are delivered under guessable names
CALL_REPLY_MARK = "r"
#: random bytes in a request's reply token: an agent that learns one reply subject of a
#: client (it answers that client's calls) cannot guess the next, so it cannot answer a
#: call made to another agent
_TOKEN_BYTES = 8
_TOKEN_POOL = 512


def call_reply_base(inbox_prefix: str) -> str:
    """A fresh reply subject base for requests of a client with ``inbox_prefix``."""
    return f"{inbox_prefix}.{CALL_REPLY_MARK}.{os.urandom(12).hex()}"


class ReplyTokens:
    """Unguessable reply tokens (hex of random bytes), drawn from a pool of random bytes
    refilled a few hundred tokens at a time: a system call per request would cost more
    than the rest of the token's bookkeeping."""

    __slots__ = ("_pool", "_pos")

    def __init__(self) -> None:
        self._pool = b""
        self._pos = 0

    def next(self) -> str:
        pos = self._pos
        if pos >= len(self._pool):
            self._pool = os.urandom(_TOKEN_BYTES * _TOKEN_POOL)
            pos = 0
        self._pos = pos + _TOKEN_BYTES
        return self._pool[pos : pos + _TOKEN_BYTES].hex()


def batch_bytes(nc: _NatsClient) -> int:
    """The most a batch may carry: well under the server's max_payload."""
    return min(_BATCH_BYTES, int(nc.max_payload) // 2)


class Outbox:
    """Requests to one subject waiting for the end of this turn of the event loop."""

    __slots__ = ("items", "size", "until")

    def __init__(self) -> None:
        self.items: list[tuple[str, bytes]] = []
        self.size = 0
        self.until = 0.0  # the latest deadline of its requests


def _is_no_responders(msg: _NatsMsg) -> bool:
    headers = msg.headers
    return headers is not None and headers.get("Status") == "503"


class ReplyMux:
    """Request/reply for the call hot path: one wildcard inbox subscription, a counter for
    reply tokens, one timer for all requests (a heap of their deadlines), and batching.

    nats-py's ``request`` pays for a NUID, ``asyncio.wait_for`` and its bookkeeping on
    every call; this pays for a dictionary entry and a heap push. "No responders" (a 503
    status reply) is reported the same. It uses nats-py's public API alone when its
    ``Writer`` does (``subscribe_inline`` and ``barrier`` then take nats-py's own paths).

    Batching: while other requests are in flight, the requests to a subject in a turn of
    the event loop wait for the end of the turn, to travel as one message
    (``reach.wire.envelope`` "Batch"). Every message costs parsing, dispatch and a protocol
    line on caller, server and callee; a batch pays them once. A request alone in flight
    is never held back: it goes to the socket at once (``Writer``).
    """

    def __init__(self, nc: _NatsClient, writer: Writer, inbox_prefix: str = "_INBOX") -> None:
        self._nc = nc
        self._writer = writer
        self._inbox_prefix = inbox_prefix
        self._base = ""
        self._tokens = ReplyTokens()
        self._pending: dict[str, asyncio.Future[bytes]] = {}
        #: reply token of a batch ("z…", never a request's hex token) → its subject and its
        #: requests (token, data), kept until its first reply in case it must go again
        self._batches: dict[str, tuple[str, list[tuple[str, bytes]]]] = {}
        #: reply token of a batch answered in parts → its requests not answered yet (only
        #: those may be answered on its reply subject), kept until its deadline at most
        self._unanswered: dict[str, set[str]] = {}
        self._outbox: dict[str, Outbox] = {}
        self._flush_handle: asyncio.Handle | None = None
        self._ready: asyncio.Lock = asyncio.Lock()
        # (loop time, token) of every request not yet past its deadline; answered ones are
        # dropped when they reach the top: a heap push per request instead of a timer
        # handle created, scheduled and cancelled in the loop's own heap
        self._deadlines: list[tuple[float, str]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = float("inf")

    async def _start(self) -> None:
        async with self._ready:
            if self._base:
                return
            base = call_reply_base(self._inbox_prefix)
            internals = self._writer.internals
            await subscribe_inline(self._nc, base + ".*", self._on_reply, inline=internals)
            await barrier(self._nc, internals=internals)
            self._base = base + "."

    def _on_reply(self, msg: _NatsMsg) -> None:
        token = msg.subject[len(self._base) :]
        future = self._pending.pop(token, None)
        if future is not None:
            if future.done():
                return
            if _is_no_responders(msg):
                future.set_exception(nats.errors.NoRespondersError())
            else:
                future.set_result(msg.data)
        elif token[:1] == "z":
            self._on_batch_reply(token, msg)

    def _settle(self, token: str, reply: bytes | BaseException) -> None:
        """Answer request ``token`` (if it still waits) with ``reply`` or that error."""
        future = self._pending.pop(token, None)
        if future is None or future.done():
            return
        if isinstance(reply, BaseException):
            future.set_exception(reply)
        else:
            future.set_result(reply)

    def _on_batch_reply(self, batch: str, msg: _NatsMsg) -> None:
        # a batch is refused or 503'd in one message, its first
        entry = self._batches.pop(batch, None)
        items: list[tuple[str, bytes]] = []
        if entry is None:  # a later part of its replies: the requests not answered yet
            subject, asked = "", self._unanswered.pop(batch, set())
        else:
            subject, items = entry
            asked = {token for token, _ in items}
        if _is_no_responders(msg):
            for token in asked:
                self._settle(token, nats.errors.NoRespondersError())
            return
        data = msg.data
        if not envelope.is_batch(data):
            # Answered as a whole: the callee did not serve the requests one by one (it
            # cannot read batches, or refused this one), so none of them ran. Each goes
            # again on its own, as if it had never been batched.
            for token, request in items:
                if token in self._pending:
                    self._publish_one(subject, request, token)
            return
        try:
            replies = envelope.unpack_batch(data)
        except ReachError as exc:
            log.warning("unreadable batch reply on %s: %s", msg.subject, exc)
            replies = []  # its requests wait for later parts, or time out
        # only this batch's own requests: whoever answers it must not settle other calls
        # (a responder may publish to the reply subject it was given, and nothing else)
        strangers = 0
        for token, reply in replies:
            if token in asked:
                asked.discard(token)
                self._settle(token, reply)
            else:
                strangers += 1
        if strangers:
            log.warning(
                "a batch reply on %s answers %d request(s) not of its batch: ignored",
                msg.subject,
                strangers,
            )
        if asked:  # the rest come in later parts (until the batch's deadline)
            self._unanswered[batch] = asked

    def close(self) -> None:
        """The connection is closing: every request still waiting fails now (as a closed
        connection) instead of at its deadline."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_at = float("inf")
        self._deadlines.clear()
        self._batches.clear()
        self._unanswered.clear()
        for token in list(self._pending):
            self._settle(token, nats.errors.ConnectionClosedError())

    def _expire(self) -> None:
        self._timer = None
        self._timer_at = float("inf")
        loop = asyncio.get_running_loop()
        now = loop.time()
        deadlines, pending, batches = self._deadlines, self._pending, self._batches
        unanswered = self._unanswered
        while deadlines and (
            deadlines[0][0] <= now
            or (
                deadlines[0][1] not in pending
                and deadlines[0][1] not in batches
                and deadlines[0][1] not in unanswered
            )
        ):
            _, token = heapq.heappop(deadlines)
            batches.pop(token, None)
            unanswered.pop(token, None)
            if token in pending:  # most were answered long ago: no error object for them
                self._settle(token, nats.errors.TimeoutError())
        if deadlines:
            self._timer_at = deadlines[0][0]
            self._timer = loop.call_at(self._timer_at, self._expire)

    def _expire_at(self, loop: asyncio.AbstractEventLoop, when: float, token: str) -> None:
        heapq.heappush(self._deadlines, (when, token))
        if when < self._timer_at:
            if self._timer is not None:
                self._timer.cancel()
            self._timer_at = when
            self._timer = loop.call_at(when, self._expire)

    async def request(self, subject: str, data: bytes, timeout: float, batch: bool) -> bytes:
        """The reply's bytes; with ``batch`` the request may travel with others to the
        same subject (only for a responder that reads batches: an instance that announced
        the "batch" feature)."""
        if not self._base:
            await self._start()
        token = self._tokens.next()
        loop = asyncio.get_running_loop()
        future: asyncio.Future[bytes] = loop.create_future()
        pending = self._pending
        pending[token] = future
        when = loop.time() + timeout
        self._expire_at(loop, when, token)
        try:
            box = self._outbox.get(subject) if batch else None
            size = len(data) + _ITEM_OVERHEAD
            limit = batch_bytes(self._nc)
            if box is None and batch and len(pending) > 1 and size <= limit:
                # others are in flight: the requests to this subject in this turn wait
                # for its end and go together
                box = self._outbox[subject] = Outbox()
                if self._flush_handle is None:
                    self._flush_handle = loop.call_soon(self._flush)
            if box is not None and size <= limit:
                if box.size + size > limit:
                    # it would not fit: what waits goes now, and this one after it
                    self._send(loop, subject, box)
                    box = self._outbox[subject] = Outbox()
                box.items.append((token, data))
                box.size += size
                if when > box.until:
                    box.until = when
                if len(box.items) >= _BATCH_ITEMS:
                    del self._outbox[subject]
                    self._send(loop, subject, box)
            else:
                self._writer.publish(subject, data, self._base + token)
            return await future
        finally:
            pending.pop(token, None)

    def _flush(self) -> None:
        self._flush_handle = None
        outbox, self._outbox = self._outbox, {}
        loop = asyncio.get_running_loop()
        for subject, box in outbox.items():
            if box.items:
                self._send(loop, subject, box)

    def _send(self, loop: asyncio.AbstractEventLoop, subject: str, box: Outbox) -> None:
        """Publish what waited in ``box``: alone, or as a batch with a reply token of its own."""
        items = box.items
        if len(items) == 1:
            token, data = items[0]
            reply = self._base + token
        else:
            batch = "z" + self._tokens.next()
            self._batches[batch] = (subject, items)
            self._expire_at(loop, box.until, batch)  # forgotten at the latest then
            data = envelope.pack_batch(items)
            reply = self._base + batch
        try:
            self._writer.publish(subject, data, reply)
        except Exception as exc:  # the connection is gone: every request of the box fails
            self._batches.pop(reply[len(self._base) :], None)
            for token, _ in items:
                self._settle(token, exc)

    def _publish_one(self, subject: str, data: bytes, token: str) -> None:
        try:
            self._writer.publish(subject, data, self._base + token)
        except Exception as exc:  # the connection is gone
            self._settle(token, exc)


class ReplyBatch:
    """The replies to one batch of requests, sent together when ready together (each
    message kept well under the server's max_payload)."""

    __slots__ = ("_handle", "_items", "_limit", "_reply", "_size", "_writer")

    def __init__(self, writer: Writer, reply: str, limit: int) -> None:
        self._writer = writer
        self._reply = reply
        self._items: list[tuple[str, bytes]] = []
        self._size = 0
        self._limit = limit
        self._handle: asyncio.Handle | None = None

    def add(self, token: str, data: bytes) -> None:
        """Queue the reply to request ``token``; it goes out at the end of this turn."""
        size = len(data) + _ITEM_OVERHEAD
        if self._items and self._size + size > self._limit:
            self.flush()  # it would not fit: what waits goes now
        self._items.append((token, data))
        self._size += size
        if self._handle is None:
            self._handle = asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        """Send the queued replies now (one message)."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        items, self._items, self._size = self._items, [], 0
        if items and self._reply:
            # replies to batches (calls under load) go with the rest of this turn's
            self._writer.respond(self._reply, envelope.pack_batch(items), now=False)
