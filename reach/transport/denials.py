"""nats-py's errors in Agent-Reach terms, and the refusals the server reports.

``translate_error`` is the one place a nats-py exception becomes an Agent-Reach error.
``Denials`` remembers the permission refusals a server reported on a connection: the
server drops a message it refuses and says so only in an asynchronous ``-ERR``, so an
operation whose message was refused would otherwise end as a plain timeout. A write to
JetStream that went unanswered is explained the same way by what the connection knows
of the fabric's store (``reach.transport.storestate``): a full disk, not a timeout.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TypeVar

import nats.errors
import nats.js.errors

from reach.errors import (
    ConfigurationError,
    Disconnected,
    NoResponders,
    PermissionDenied,
    ReachError,
    ReachTimeout,
    TransportError,
)
from reach.transport.link import Link
from reach.transport.storestate import StoreState, store_full

__all__ = [
    "Denials",
    "api_refusal_of",
    "is_permission_error",
    "refusal_of",
    "translate_error",
]

_T = TypeVar("_T")

#: JetStream's API errors that say its store has no room: the server's storage limit
#: (``insufficient storage resources available``, ``insufficient resources``)
_NO_ROOM = (10047, 10023)


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
    if isinstance(exc, nats.js.errors.APIError) and exc.err_code in _NO_ROOM:
        # nats-server grants its streams 75 % of the disk space free at its start
        return store_full(what, f"no room within the server's storage limit: {exc.description}")
    return TransportError(f"{what}: {type(exc).__name__}: {exc}")


class Denials:
    """What the server refused these credentials lately (``-ERR 'Permissions Violation
    for Publish to "…"'``): the server drops such a message and says so only in this
    error, so a request to it would otherwise end as a plain timeout. ``guard`` ends an
    operation as soon as the refusal arrives instead."""

    __slots__ = ("_link", "_seen", "_waiting", "store")

    def __init__(self, link: Link | None = None) -> None:
        #: the connection's state: an operation that failed while it was down says why
        self._link = link
        self._seen: deque[tuple[float, str]] = deque(maxlen=32)
        #: operations in ``guard``: what to call on a refusal, and which refusals end it
        self._waiting: dict[Callable[[str], None], Callable[[str], bool]] = {}
        #: what the connection knows of the fabric's JetStream store
        self.store = StoreState()

    def add(self, error: str) -> None:
        error = error.removeprefix("nats: ")
        self._seen.append((time.monotonic(), error))
        for stop, refuses in list(self._waiting.items()):
            if refuses(error):
                stop(error)

    def since(self, started: float, subject: str | None = None) -> str | None:
        """The latest refusal since ``started`` (monotonic), of ``subject`` if given
        (nats-py reports it in lower case), else of a JetStream or KV subject."""
        refuses = refusal_of(subject)
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

    async def explain_write(
        self, exc: BaseException, what: str, started: float, subject: str | None = None
    ) -> ReachError:
        """``explain`` for a write to JetStream: one that went unanswered, or that no
        stream heard, while the fabric's store takes no writes is a ``StoreFull`` naming
        why (a full disk), not a timeout."""
        err = self.explain(exc, what, started, subject)
        return await self.store.explain(err, what)

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
        " use credentials allowed to do this: an agent's own to serve (reach creds add"
        " NAME --agent-id ID --cap CAPABILITY), an admin's for operator commands"
    )


def refusal_of(subject: str | None) -> Callable[[str], bool]:
    """Recognises a refusal to publish to ``subject`` (nats-py reports it in lower case),
    or, for None, of any JetStream or KV subject."""
    if subject is not None:
        quoted = f'"{subject.lower()}"'
        return lambda error: quoted in error
    return lambda error: '"$js.' in error or '"$kv.' in error


def api_refusal_of(request: str, stream: str) -> Callable[[str], bool]:
    """Recognises a refusal of the JetStream API ``request`` (``STREAM.INFO``,
    ``CONSUMER.CREATE``) about ``stream``: ``$JS.API.<request>.<stream>[.…]`` (nats-py
    reports it in lower case). Another request about the stream, refused at the same
    moment, does not end this one."""
    prefix = f'"$js.api.{request.lower()}.{stream.lower()}'
    return lambda error: prefix + '"' in error or prefix + "." in error


def is_permission_error(exc: BaseException) -> bool:
    return "permissions violation" in str(exc).lower()
