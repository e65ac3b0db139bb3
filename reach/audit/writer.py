"""Writing audit events off the hot path, without losing them.

``record_call`` (a plain call) and ``record`` (any event row) are synchronous and O(1):
the event joins the batch being filled for its capability (a plain call as a slot in its
columns, anything else as a packed row, ``reach.audit.events.BatchBuilder``) and the call
goes on. A background task seals batches when they are full or due (one stream message
each) and publishes each with a message id, waiting for the stream's ack. A batch that
is not acked (NATS unreachable, stream missing, timeout) stays at the head and is resent
with the *same* message id, so a resend after a lost ack is not stored twice. While NATS
is away events keep collecting up to the bound; past it new events are dropped and
counted (``dropped``), never silently.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from reach import subjects
from reach.audit.events import (
    CAPABILITY_INDEX,
    BatchBuilder,
    EventRow,
    RowSummary,
    encode_notice,
    pack_row,
    summary_headers,
)
from reach.errors import ConfigurationError, NoResponders, ReachError
from reach.tasks import cancel_and_wait
from reach.transport import Connection, Stream

__all__ = ["AuditWriter", "WriterConfig"]

log = logging.getLogger("reach.audit")


@dataclass(frozen=True, slots=True)
class WriterConfig:
    #: events held while the stream cannot be written (then new ones are dropped, counted)
    max_buffer: int = 100_000
    #: events per stream message at most: every message costs the writer, the server and
    #: each reader (the registrar's alert watcher, `reach audit tail`) a fixed price, so
    #: fewer is cheaper (measured at 128 calls in flight: the registrar's share of auditing
    #: went from 0.11 to 0.04 µs a call with batches of ~5,000 instead of 2,048)
    batch_max: int = 8192
    #: bytes per stream message at most (and never over half the server's max_payload:
    #: with nats-server's default of 1 MiB, this is what ends a batch at full load)
    batch_max_bytes: int = 512 * 1024
    #: how long an event may wait for company before its batch is written
    flush_interval: float = 0.25
    #: wait for a stream ack
    ack_timeout: float = 2.0
    #: back-off between failed writes: doubles from ``retry_min`` up to ``retry_max``
    retry_min: float = 0.05
    retry_max: float = 1.0


class _Open:
    """The batch being filled for one capability, and when it is written even if not full."""

    __slots__ = ("batch", "due")

    def __init__(self, capability: str, due: float) -> None:
        self.batch = BatchBuilder(capability)
        #: monotonic time at which it is written even if not full
        self.due = due


@dataclass(slots=True)
class _Batch:
    capability: str
    msg_id: str
    data: bytes
    count: int
    summary: RowSummary


class AuditWriter:
    """Buffers audit events and writes them to REACH_AUDIT in acked, idempotent batches."""

    def __init__(self, conn: Connection, config: WriterConfig | None = None) -> None:
        self._conn = conn
        self.config = config or WriterConfig()
        #: batches being filled, one per capability (columns of numbers and names, packed
        #: rows: nothing that keeps the garbage collector busy)
        self._open: dict[str, _Open] = {}
        self._filling = 0  # events in them
        self._batches: deque[_Batch] = deque()
        self._held = 0  # events in unsent batches
        self._wake = asyncio.Event()
        self._retry_now = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stream: Stream | None = None
        self._writer_id = secrets.token_hex(8)
        self._max_bytes = self.config.batch_max_bytes
        # read on every event: kept here, where compiled code reads them directly
        self._max_buffer = self.config.max_buffer
        self._batch_max = self.config.batch_max
        #: flush() wants every batch written now, full or not
        self._flushing = False
        self._batch_seq = 0
        #: events acked by the stream / dropped because the buffer was full
        self.written = 0
        self.dropped = 0
        self._warned = False

    @property
    def pending(self) -> int:
        """Events recorded but not yet acked by the stream."""
        return self._filling + self._held

    def record_call(
        self,
        capability: str,
        ts: float,
        call_id: str,
        trace_id: str,
        caller: str,
        caller_agent: str | None,
        callee: str,
        latency_ms: float,
        candidates: tuple[str, ...],
        n_candidates: int,
        score: float | None,
        attempt_latency_ms: float,
    ) -> None:
        """Queue the event of a plain call: answered by ``callee`` at the first attempt,
        nothing skipped, no fallback (``make_event``'s fields; ``score`` and
        ``attempt_latency_ms`` those of its one attempt). The call path's way: a few
        list appends, no row is built. Never blocks, never raises."""
        if self._filling + self._held >= self._max_buffer:
            self.dropped += 1
            return
        at = self._open.get(capability)
        if at is None:
            at = self._start(capability)
        batch = at.batch
        try:
            batch.columns.add(
                ts,
                call_id,
                trace_id,
                caller,
                caller_agent,
                callee,
                latency_ms,
                candidates,
                n_candidates,
                score,
                attempt_latency_ms,
            )
        except (TypeError, ValueError, OverflowError) as exc:  # a bug in who called
            self.dropped += 1
            log.error("audit: a call to %s could not be recorded: %s", capability, exc)
            if batch.full:  # (only after an add that failed part way)
                self._seal(capability)
                self._wake.set()
            return
        batch.count += 1
        self._added(capability, batch)

    def record(self, event: EventRow) -> None:
        """Queue one event row (see ``reach.audit.events``); never blocks, never raises."""
        if self._filling + self._held >= self._max_buffer:
            self.dropped += 1
            return
        try:
            capability = event[CAPABILITY_INDEX]
            at = self._open.get(capability)
        except (IndexError, TypeError, KeyError) as exc:  # a bug in who built it
            self.dropped += 1
            log.error("audit: an event without a capability was dropped: %s", exc)
            return
        if at is None:
            at = self._start(capability)
        if not at.batch.add_if_plain(event):
            try:
                data = pack_row(event)
            except (TypeError, ValueError, OverflowError) as exc:  # a bug in who built it
                self.dropped += 1
                log.error("audit: an event of %s cannot be packed: %s", capability, exc)
                return
            if len(data) > self._max_bytes:  # alone it is more than a message may carry
                self.dropped += 1
                log.error(
                    "audit: an event of %s is %d bytes packed, more than a batch may carry"
                    " (%d): dropped",
                    capability,
                    len(data),
                    self._max_bytes,
                )
                return
            if at.batch.count and at.batch.size + len(data) > self._max_bytes:
                self._seal(capability)  # the row starts a batch of its own
                at = self._start(capability)
            at.batch.add_packed(event, data)
        self._added(capability, at.batch)

    def _added(self, capability: str, batch: BatchBuilder) -> None:
        """One event joined ``batch``: it is sealed once full (by count, bytes or names)."""
        self._filling += 1
        if batch.count >= self._batch_max or batch.size >= self._max_bytes or batch.full:
            self._seal(capability)
            self._wake.set()

    def record_all(self, events: Sequence[EventRow]) -> None:
        """Queue event rows; never blocks, never raises."""
        for event in events:
            self.record(event)

    def _start(self, capability: str) -> _Open:
        at = self._open[capability] = _Open(
            capability, time.monotonic() + self.config.flush_interval
        )
        return at

    def reconnected(self) -> None:
        """NATS is back: write what is waiting now rather than after the back-off."""
        self._retry_now.set()
        self._wake.set()

    async def start(self) -> None:
        if self._task is None:
            self._stream = await self._conn.stream(subjects.AUDIT_STREAM, check=False)
            self._conn.on_reconnect(self.reconnected)
            self._max_bytes = min(self.config.batch_max_bytes, self._conn.max_payload // 2)
            self._task = asyncio.create_task(self._run(), name="reach-audit-writer")

    async def stop(self, timeout: float = 5.0) -> None:
        """Write what is buffered (waiting at most ``timeout``), then stop."""
        if self._task is None:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.flush(), timeout)
        await cancel_and_wait([self._task])
        self._task = None
        if self.pending:
            log.warning("audit: %d event(s) not written before shutdown", self.pending)

    async def flush(self) -> None:
        """Return once every event recorded so far is acked by the stream."""
        while self.pending:
            self._flushing = True
            self._wake.set()
            await asyncio.sleep(self.config.retry_min)

    # -- the background writer -------------------------------------------------------

    async def _run(self) -> None:
        delay = self.config.retry_min
        while True:
            if not self._batches:
                # wait for a full batch (recording wakes us), or for the oldest one to be due
                due = min((b.due for b in self._open.values()), default=None)
                wait = self.config.flush_interval if due is None else due - time.monotonic()
                if wait > 0 and not self._flushing:
                    self._wake.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), wait)
            self._seal_due(time.monotonic())
            if not self._batches:
                continue
            failed = False
            try:
                await self._send_all()
            except ReachError as exc:  # (no await in here: compiled, it would leak exc)
                self._warn(exc)
                failed = True
            if failed:
                # back off: new events or a flush() do not cut it short, a reconnect does
                self._retry_now.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._retry_now.wait(), delay)
                delay = min(self.config.retry_max, delay * 2)
            else:
                delay = self.config.retry_min

    def _seal_due(self, now: float) -> None:
        """Seal the batches whose time has come (all of them when flushing): each becomes
        one stream message. Younger ones keep filling: fewer, larger stream writes."""
        flushing, self._flushing = self._flushing, False
        for capability, batch in list(self._open.items()):
            if flushing or batch.due <= now:
                self._seal(capability)

    def _seal(self, capability: str) -> None:
        batch = self._open.pop(capability).batch
        if not batch.count:  # every event of it was dropped: nothing to write
            return
        self._filling -= batch.count
        self._batch_seq += 1
        try:
            data, summary, lost = batch.encode()
        except Exception:  # a bug in who built the events: counted, never the writer's end
            self.dropped += batch.count
            log.exception(
                "audit: a batch of %d event(s) of %s was dropped", batch.count, capability
            )
            return
        if lost:
            self.dropped += lost
            log.error("audit: %d event(s) of %s cannot be packed: dropped", lost, capability)
        if batch.count == lost:
            return
        self._batches.append(
            _Batch(
                # the subject's last token: a name that cannot be one (a caller asked
                # for "a.>" or "" by mistake) goes under "_", the events keep the name
                capability=capability if subjects.is_token(capability) else "_",
                msg_id=f"{self._writer_id}.{self._batch_seq}",
                data=data,
                count=batch.count - lost,
                summary=summary,
            )
        )
        self._held += batch.count - lost

    async def _send_all(self) -> None:
        assert self._stream is not None
        while self._batches:
            batch = self._batches[0]
            try:
                seq = await self._stream.publish(
                    subjects.audit(batch.capability, self._conn.writer),
                    batch.data,
                    msg_id=batch.msg_id,
                    timeout=self.config.ack_timeout,
                    headers=summary_headers(batch.summary),
                )
            except ConfigurationError as exc:
                # refused for good (larger than the server takes): resending cannot help,
                # and holding it would hold up every batch behind it
                self._batches.popleft()
                self._held -= batch.count
                self.dropped += batch.count
                log.error("audit: a batch of %d event(s) was refused: %s", batch.count, exc)
                continue
            self._batches.popleft()
            self._held -= batch.count
            self.written += batch.count
            self._warned = False
            await self._notify(batch, seq)

    async def _notify(self, batch: _Batch, seq: int) -> None:
        """Tell the alert rules where the stream holds ``batch`` (core NATS, best effort:
        the events are stored either way; a notice lost with the connection only leaves
        its calls out of the last minute's counts). After a resend whose first ack was
        lost the notice goes out once, with the first copy's sequence."""
        try:
            await self._conn.publish(
                subjects.audited(batch.capability, self._conn.writer),
                encode_notice(seq, batch.summary),
            )
        except ReachError as exc:
            log.debug("audit: no notice of batch %d of %s: %s", seq, batch.capability, exc)

    def _warn(self, exc: ReachError) -> None:
        if not self._warned:
            self._warned = True
            hint = (
                " (`reach up` or a registrar creates it)" if isinstance(exc, NoResponders) else ""
            )
            log.warning(
                "audit: cannot write to %s yet, holding %d event(s): %s%s",
                subjects.AUDIT_STREAM,
                self.pending,
                exc,
                hint,
            )
