"""What the console knows of the fabric, followed live while it runs.

Like ``reach top``: the registry through a route cache (``reach.caller.routecache``),
the calls from the audit stream (``reach.audit.reader.read_events``, folded into a
``Rollup``), and the alerts from REACH_ALERTS, all with the console's one connection and
so with what its credential may read. What cannot be read (an audit stream the
credential may not read, a fabric without alerts) is said on the pages, in ``notes``,
instead of stopping the console; a follower that fails starts again after a pause.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any

from reach.audit.alerts import Alert, decode_alert
from reach.audit.decode import BatchVersionError
from reach.audit.provenance import verdict
from reach.audit.split import ColumnPart, split_batch
from reach.caller.routecache import RouteCache
from reach.clock import Clock, system_clock
from reach.console.rollup import Rollup
from reach.errors import ReachError
from reach.registry.store import RegistryStore
from reach.tasks import cancel_and_wait
from reach.transport import Connection, StreamMessage
from reach.transport.streamreads import read_stream, start_within
from reach.wire import subjects
from reach.wire.models import Instance

__all__ = ["ALERTS_KEPT", "FabricView"]

log = logging.getLogger(__name__)

#: the newest alerts kept for the alerts page
ALERTS_KEPT = 500
#: how far back the alerts page starts, in seconds
ALERTS_SINCE_SEC = 24 * 3600.0
#: pause before a failed follower starts again
RETRY_SEC = 2.0


class FabricView:
    """The registry, the last minutes of calls and the recent alerts, kept current."""

    def __init__(
        self, conn: Connection, *, window_sec: float = 300.0, clock: Clock = system_clock
    ) -> None:
        self.conn = conn
        self.clock = clock
        self.rollup = Rollup(window_sec=window_sec)
        self.alerts: deque[Alert] = deque(maxlen=ALERTS_KEPT)
        #: what cannot be shown and why, by source ("registry", "calls", "alerts")
        self.notes: dict[str, str] = {}
        self.routes: RouteCache | None = None
        #: audit events not counted: unreadable, malformed, or written by someone other
        #: than who they name (forged)
        self.bad_events = 0
        #: (stream sequence, time stored) of the last message read of each stream
        self._calls_at: tuple[int, float] = (0, 0.0)
        self._alerts_at: tuple[int, float] = (0, 0.0)
        #: calls that started before it are not counted (the window when reading began)
        self._window_start = 0.0
        self._tasks: list[asyncio.Task[None]] = []

    def now(self) -> float:
        return self.clock.time()

    def version(self) -> tuple[int, ...]:
        """Changes when what a live page must show at once changes: a registry record (a
        health change, an instance come or gone), a breaker passed over, a new alert."""
        routes = self.routes
        return (
            routes.changes if routes is not None else -1,
            self.rollup.skips,
            self._alerts_at[0],
            len(self.notes),
        )

    def instances(self) -> list[Instance]:
        return self.routes.all() if self.routes is not None else []

    async def start(self) -> None:
        try:
            routes = RouteCache(await RegistryStore.open(self.conn, create=False))
            await routes.start()
            self.routes = routes
        except (ReachError, TimeoutError) as exc:
            self.notes["registry"] = f"registry not readable: {exc}"
        self._tasks = [
            asyncio.create_task(self._keep(self._follow_calls, "calls"), name="console-calls"),
            asyncio.create_task(self._keep(self._follow_alerts, "alerts"), name="console-alerts"),
        ]

    async def stop(self) -> None:
        await cancel_and_wait(self._tasks)
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task  # done: raises what it failed with, if anything
        self._tasks = []
        if self.routes is not None:
            await self.routes.stop()

    async def _keep(self, follow: Callable[[], Coroutine[Any, Any, None]], source: str) -> None:
        """Run ``follow`` again whenever it fails or ends, saying why in ``notes``, and at
        once after the connection came back: a server that restarted has forgotten the
        consumer a follower reads from, which then waits for nothing, silently."""
        reconnected = asyncio.Event()
        self.conn.on_reconnect(reconnected.set)
        while True:
            reconnected.clear()
            reading = asyncio.create_task(follow(), name=f"console-{source}-read")
            waiting = asyncio.create_task(reconnected.wait(), name=f"console-{source}-wait")
            try:
                await asyncio.wait({reading, waiting}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                await cancel_and_wait([reading, waiting])
            if not reading.cancelled():
                self._failed(source, reading.exception())
                await asyncio.sleep(RETRY_SEC)

    def _failed(self, source: str, exc: BaseException | None) -> None:
        if exc is None:
            self.notes[source] = f"{source}: the stream ended; reading it again"
        elif isinstance(exc, ReachError):
            self.notes[source] = f"{source} not shown: {exc}"
        else:  # a bug must not stop the page: it says so
            log.error("console: following %s failed", source, exc_info=exc)
            self.notes[source] = f"{source} not shown: {type(exc).__name__}: {exc}"

    async def _follow_calls(self) -> None:
        """The audit stream as ``reach.audit.reader.read_events`` reads it (forged events
        left out), each event folded from its map rather than made a model first, and a
        plain call from its batch's columns without a map: the console reads every call
        of the fabric, so each batch is handed to ``_count`` as it arrives. Read again,
        it goes on after the last message it read (by the stream's sequence: none lost,
        none counted twice)."""
        self._window_start = self.now() - self.rollup.window_sec
        since = max(self._calls_at[1], self._window_start)
        following = await start_within(
            self.conn,
            subjects.AUDIT_STREAM,
            lambda stream: stream.start_follow(subjects.AUDIT_ALL, self._count, since=since),
        )
        await following

    def _count(self, msg: StreamMessage) -> None:
        """One batch of the audit stream, folded into the rollup."""
        self.notes.pop("calls", None)
        if msg.seq <= self._calls_at[0]:
            return
        self._calls_at = (msg.seq, msg.time)
        rollup, window_start = self.rollup, self._window_start
        writer = subjects.writer_of(msg.subject)
        try:
            batch = split_batch(msg.data)
        except BatchVersionError as exc:
            log.warning("console: audit batch %d not counted: %s", msg.seq, exc)
            self.bad_events += 1
            return
        self.bad_events += batch.bad
        for item in batch.rows:
            ts = item.get("ts")
            if isinstance(ts, int | float) and ts < window_start:
                continue  # a call that started before the window
            if _forged(item, writer) or not rollup.add_map(item):
                self.bad_events += 1
        for part in batch.columns:
            calls, bad = _plain_calls(part, writer, window_start)
            rollup.add_plain(part.capability, calls)
            self.bad_events += bad

    async def _follow_alerts(self) -> None:
        since = self._alerts_at[1] or self.now() - ALERTS_SINCE_SEC
        reading = read_stream(
            self.conn, subjects.ALERTS_STREAM, subjects.alert("*"), since=since, follow=True
        )
        async for msg in reading:
            self.notes.pop("alerts", None)
            if msg.seq <= self._alerts_at[0]:
                continue
            self._alerts_at = (msg.seq, msg.time)
            alert = decode_alert(msg.data)
            if alert is not None:
                self.alerts.append(alert)


def _forged(item: dict[str, Any], writer: str) -> bool:
    """Whether the subject's writer is not who the event says recorded it (as
    ``read_events`` leaves such events out; a callee's denial is not verified here)."""
    side, caller, callee, actor = (
        item.get("side", "caller"),
        item.get("caller", ""),
        item.get("callee", ""),
        item.get("actor"),
    )
    if not (isinstance(side, str) and isinstance(caller, str) and isinstance(callee, str)):
        return True
    if actor is not None and not isinstance(actor, str):
        return True
    return verdict(side, caller, callee, writer, actor=actor) == "forged"


def _genuine_plain(side: str, caller: object, actor: object, writer: str) -> bool:
    """Whether a plain call's caller (and the gateway that made the call for it, if one
    did) are names, and ``writer`` may have recorded it."""
    if type(caller) is not str or (actor is not None and type(actor) is not str):
        return False
    return verdict(side, caller, "", writer, actor=actor) != "forged"


def _plain_calls(
    part: ColumnPart, writer: str, window_start: float
) -> tuple[list[tuple[float, str, float]], int]:
    """The calls of ``part`` for ``Rollup.add_plain`` (those that started within the
    window), and how many are not counted: forged as ``_forged`` tells, or with a name,
    time or latency that ``Rollup.add_map`` would refuse."""
    values = part.values
    # (caller, actor) index pairs; a batch without the actor column names no actor
    actors = part.actor if part.actor is not None else [-1] * len(part.caller)
    genuine = {
        (i, a): _genuine_plain(part.side, values[i], values[a] if a >= 0 else None, writer)
        for i, a in set(zip(part.caller, actors, strict=True))
    }
    answers = part.attempt_latency if part.side == "caller" else part.latency
    isfinite = math.isfinite
    calls: list[tuple[float, str, float]] = []
    bad = 0
    for ts, caller, actor, callee, latency, answer in zip(
        part.ts, part.caller, actors, part.callee, part.latency, answers, strict=True
    ):
        if ts < window_start:
            continue  # a call that started before the window
        agent_id = values[callee]
        if (
            agent_id is None
            or not genuine[caller, actor]
            or not (isfinite(ts) and isfinite(latency) and isfinite(answer))
        ):
            bad += 1
            continue
        calls.append((ts, agent_id, answer))
    return calls, bad
