"""An operator's read of a stream, started within a deadline: ``reach agents`` (its p99
column), ``reach top``, ``reach audit``, ``reach alerts``, ``reach doctor`` and the
console read REACH_AUDIT and REACH_ALERTS this way.

Starting a read takes requests of JetStream's API (the stream's info, a consumer, how
many messages it has to read), and any of them can fail for a moment while the fabric
is busy or changing: no reply in time (a server that stalls, a backlog of API requests),
JetStream unavailable (503, or no responders: while a stream's leader is elected), the
connection lost and back. Such a failure is tried again, with jittered back-off, until
the read's deadline; only a stream that stays unreachable that long is named, with the
last failure. Any other failure (a permission refused, no such stream) is said at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import nats.js.errors

from reach.clock import Clock, system_clock
from reach.deadline import Deadline
from reach.errors import Disconnected, NoResponders, ReachError, ReachTimeout
from reach.transport.connection import Connection
from reach.transport.jetstream import Stream, StreamMessage

__all__ = ["READ_WITHIN_SEC", "is_transient", "read_stream", "start_within"]

log = logging.getLogger("reach.transport.streamreads")

T = TypeVar("T")

#: how long an operator's read keeps trying to start while its stream does not answer
READ_WITHIN_SEC = 10.0
#: the first pause before trying again (jittered), doubled up to the last
_PAUSE = 0.1
_PAUSE_MAX = 1.0


def is_transient(exc: BaseException) -> bool:
    """Whether trying again soon may succeed: no reply in time, nobody answering,
    JetStream unavailable (503), the connection lost meanwhile."""
    return isinstance(exc, NoResponders | ReachTimeout | Disconnected) or isinstance(
        exc.__cause__, nats.js.errors.ServiceUnavailableError
    )


async def start_within(
    conn: Connection,
    name: str,
    start: Callable[[Stream], Awaitable[T]],
    *,
    within: float = READ_WITHIN_SEC,
    clock: Clock = system_clock,
) -> T:
    """``start(stream)`` (``Stream.start_read``, ``Stream.start_follow``) on the stream
    ``name`` of ``conn``, opened first; both tried again after a transient failure until
    ``within`` seconds have passed, an attempt cut short at that deadline. A failure
    that lasts raises its error (its type kept) saying the stream was unreachable."""
    deadline = Deadline.after(within, clock)
    pause = _PAUSE
    while True:
        failure: BaseException
        # no await inside the except blocks: compiled by mypyc, an await there loses
        # track of which exception is being handled
        try:
            async with asyncio.timeout(deadline.remaining()):
                return await start(await conn.stream(name))
        except ReachError as exc:
            if not is_transient(exc):
                raise
            failure = exc
        except TimeoutError as exc:  # the deadline cut the attempt short
            failure = exc
        if not isinstance(failure, ReachError) or pause > deadline.remaining():
            raise unreachable(name, within, failure)
        log.info("stream %s did not answer (%s); trying again", name, failure)
        await clock.sleep(pause * (0.5 + random.random()))
        pause = min(pause * 2, _PAUSE_MAX)


def unreachable(name: str, within: float, failure: BaseException) -> ReachError:
    """The error of a read whose stream ``name`` stayed unreachable for ``within``
    seconds: the last ``failure`` (a ReachError keeps its type), named."""
    said = f"stream {name} unreachable for {within:g} s"
    if isinstance(failure, ReachError):
        failure.args = (f"{said}: {failure}", *failure.args[1:])
        return failure
    err = ReachTimeout(f"{said}: no answer in time")
    err.__cause__ = failure
    return err


async def read_stream(
    conn: Connection,
    name: str,
    subject: str = ">",
    *,
    since: float | None = None,
    follow: bool = False,
    new_only: bool = False,
    within: float = READ_WITHIN_SEC,
) -> AsyncIterator[StreamMessage]:
    """``Stream.read`` of the stream ``name`` for an operator: its start tried again
    after a transient failure for ``within`` seconds (``start_within``); once started,
    as ``Stream.read`` goes on (a follower across reconnects too)."""
    messages = await start_within(
        conn,
        name,
        lambda stream: stream.start_read(subject, since=since, follow=follow, new_only=new_only),
        within=within,
    )
    async with contextlib.aclosing(messages):
        async for msg in messages:
            yield msg
