"""Replies to many requests of one kind, matched by their owner in a callback.

For a component that sends requests by the thousand and needs no coroutine waiting on
each (the registrar's probes): one wildcard subscription on a reply base of its own
(``<inbox prefix>.r.<random>``, where responders are allowed to answer), each request
published with an unguessable token after that base, and every reply handed to
``deliver(token, data)`` as soon as the connection's reader has parsed it. No future, no
task and no timer per request: the owner keeps its table of pending tokens and its
deadlines, and asks :meth:`ReplyInbox.timeout_error` for the error of one that expired.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import nats.errors
from nats.aio.client import Client as _NatsClient
from nats.aio.msg import Msg as _NatsMsg
from nats.aio.subscription import Subscription as _NatsSubscription

from reach.errors import NoResponders, ReachError
from reach.transport.denials import Denials, translate_error
from reach.transport.mux import ReplyTokens, call_reply_base
from reach.transport.natsio import Writer, barrier, subscribe_inline

__all__ = ["ReplyDelivery", "ReplyInbox"]

#: (token, reply bytes), or (token, None) for nats-server's "no responders" status
ReplyDelivery = Callable[[str, bytes | None], None]


def _no_responders(msg: _NatsMsg) -> bool:
    headers = msg.headers
    return headers is not None and headers.get("Status") == "503"


class ReplyInbox:
    """One reply subscription for requests whose replies the owner matches itself."""

    def __init__(
        self, nc: _NatsClient, writer: Writer, denials: Denials, inbox_prefix: str
    ) -> None:
        self._nc = nc
        self._writer = writer
        self._denials = denials
        self._base = call_reply_base(inbox_prefix) + "."
        self._tokens = ReplyTokens()
        self._sub: _NatsSubscription | None = None
        self._deliver: ReplyDelivery | None = None

    async def open(self, deliver: ReplyDelivery) -> None:
        """Subscribe; every reply from now on goes to ``deliver`` (which must not block)."""
        self._deliver = deliver
        internals = self._writer.internals
        try:
            self._sub = await subscribe_inline(
                self._nc, self._base + "*", self._on_reply, inline=internals
            )
            await barrier(self._nc, internals=internals)
        except Exception as exc:
            raise translate_error(exc, self._base + "*") from exc

    def _on_reply(self, msg: _NatsMsg) -> None:
        subject = msg.subject
        if self._deliver is None or not subject.startswith(self._base):
            return
        token = subject[len(self._base) :]
        self._deliver(token, None if _no_responders(msg) else msg.data)

    def token(self) -> str:
        """A fresh unguessable token for one request."""
        return self._tokens.next()

    def publish(self, subject: str, data: bytes, token: str) -> None:
        """Send a request whose reply comes back with ``token``; a Disconnected (or another
        ReachError) if it cannot go out."""
        try:
            # with the rest of this turn's messages: requests of this kind come by the many
            self._writer.publish(subject, data, self._base + token, now=False)
        except Exception as exc:
            raise translate_error(exc, subject) from exc

    def timeout_error(self, subject: str, started: float) -> ReachError:
        """The error of a request to ``subject`` sent at ``started`` (``time.monotonic``)
        that got no reply in time: a timeout, or the refusal or the lost connection that
        explains it."""
        return self._denials.explain(nats.errors.TimeoutError(), subject, started, subject)

    @staticmethod
    def no_responders(subject: str) -> NoResponders:
        return NoResponders(f"no responders on {subject}")

    @staticmethod
    def now() -> float:
        """The clock ``timeout_error`` wants its ``started`` on."""
        return time.monotonic()

    async def close(self) -> None:
        self._deliver = None
        sub, self._sub = self._sub, None
        if sub is not None and not self._nc.is_closed:
            try:
                await sub.unsubscribe()
            except Exception as exc:
                raise translate_error(exc, self._base + "*") from exc
