"""Reading the server's messages: MSG lines parsed and handed to inline subscriptions
without nats-py's per-message coroutine.

nats-py's parser matches each protocol line with regular expressions, copies it through
a buffer and awaits a coroutine per message (``Client._process_msg``) that builds the
message and puts it in its subscription's queue. For a subscription whose messages are
delivered inline (``natsio.subscribe_inline``) this reader does the same work in one
pass over what the socket returned: it splits each ``MSG`` line, builds the message and
calls the subscription's handler. Everything else (messages with headers, PING, INFO,
errors, JetStream subscriptions, subscriptions with a message limit, anything split
across two reads) goes through nats-py's own parser, byte for byte, in order.
"""

from __future__ import annotations

from typing import Any

from nats.protocol.parser import AWAITING_MSG_PAYLOAD
from nats.protocol.parser import Parser as _NatsParser

from reach.transport.natsio import InlineDelivery

__all__ = ["ProtocolReader"]

_MSG = b"MSG "
_HMSG = b"HMSG "
_CRLF = b"\r\n"


class ProtocolReader:
    """Stands in for nats-py's parser (``Client._ps``): ``parse`` and ``reset``."""

    __slots__ = ("_inner", "_nc")

    def __init__(self, nc: Any) -> None:
        # untyped: nats-py's client, read through its internals (reach.transport.internals)
        self._nc: Any = nc
        #: nats-py's parser, for everything but the messages of inline subscriptions
        self._inner: Any = _NatsParser(nc)

    def reset(self) -> None:
        self._inner.reset()

    async def parse(self, data: bytes = b"") -> None:
        """Handle what the socket returned, as nats-py's parser would."""
        inner = self._inner
        if inner.state == AWAITING_MSG_PAYLOAD:
            # a message whose line came in an earlier read: nats-py's parser ends it
            rest = inner.needed + len(_CRLF) - len(inner.buf)
            if len(data) < rest:
                await inner.parse(data)
                return
            await inner.parse(data[:rest])
            data = data[rest:]
        if inner.buf:  # the start of a line from an earlier read
            data = bytes(inner.buf) + data
            inner.buf.clear()
        pos = 0
        size = len(data)
        while pos < size:
            pos = self._messages(data, pos)
            if pos >= size:
                return
            end = _op_end(data, pos)
            if end < 0:  # split across reads: nats-py's parser keeps it until the rest
                await inner.parse(data[pos:])
                return
            # one operation: a message with headers or for a subscription that is not
            # inline, a PING, an INFO, an error
            await inner.parse(data[pos:end])
            pos = end

    def _messages(self, data: bytes, pos: int) -> int:
        """Deliver the whole ``MSG``s from ``pos`` on that go to inline subscriptions;
        the position of the first operation that is anything else."""
        nc = self._nc
        subs = nc._subs
        stats = nc.stats
        msg_class = nc.msg_class
        size = len(data)
        while data.startswith(_MSG, pos):
            line_end = data.find(_CRLF, pos)
            if line_end < 0:
                return pos
            args = data[pos + 4 : line_end].split()
            if len(args) == 3:
                subject, sid, length = args
                reply = b""
            elif len(args) == 4:
                subject, sid, reply, length = args
            else:
                return pos  # malformed: nats-py's parser says so
            if not (length.isdigit() and sid.isdigit()):
                return pos
            start = line_end + 2
            stop = start + int(length)
            if stop + 2 > size:
                return pos
            sid_n = int(sid)
            sub = subs.get(sid_n)
            if sub is not None and not _inline(sub):
                return pos
            pos = stop + 2
            stats["in_msgs"] += 1
            stats["in_bytes"] += stop - start
            if sub is None:  # unsubscribed meanwhile: counted and dropped, as nats-py does
                continue
            sub._received += 1
            sub._pending_queue.deliver(
                msg_class(
                    subject=subject.decode(),
                    reply=reply.decode(),
                    data=data[start:stop],
                    headers=None,
                    _client=nc,
                    _sid=sid_n,
                )
            )
        return pos


def _inline(sub: Any) -> bool:
    """Whether nats-py would hand every message of ``sub`` straight to its inline
    delivery (no JetStream, no message limit, no old-style request)."""
    return (
        type(sub._pending_queue) is InlineDelivery
        and not sub._max_msgs
        and sub._jsi is None
        and sub._future is None
    )


def _op_end(data: bytes, pos: int) -> int:
    """Where the protocol operation at ``pos`` ends (its payload included), or -1 if it
    is not all there yet."""
    line_end = data.find(_CRLF, pos)
    if line_end < 0:
        return -1
    end = line_end + 2
    if data.startswith((_MSG, _HMSG), pos):
        args = data[pos:line_end].split()
        length = args[-1] if len(args) >= 4 else b""
        if not length.isdigit():
            return end  # malformed: nats-py's parser refuses the line
        end += int(length) + 2
        if end > len(data):
            return -1
    return end
