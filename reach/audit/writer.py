"""Writing audit events off the hot path, without losing them.

``record`` is synchronous and O(1): the event joins a bounded buffer and the call goes
on. A background task packs buffered events into batches (one capability per batch,
one stream message per batch) and publishes each with a message id, waiting for the
stream's ack. A batch that is not acked (NATS unreachable, stream missing, timeout)
stays at the head and is resent with the *same* message id, so a resend after a lost
ack is not stored twice. While NATS is away events keep collecting up to the bound;
past it new events are dropped and counted (``dropped``), never silently.
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
    EventRow,
    RowSummary,
    capability_of,
    encode_rows,
    pack_row,
    pack_rows,
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
    #: events per stream message at most: every message costs each reader (the registrar's
    #: alert watcher, `reach audit tail`) and the server a fixed price, so fewer is cheaper
    batch_max: int = 2048
    #: packed rows per stream message at most (and never over half the server's max_payload)
    batch_max_bytes: int = 256 * 1024
    #: how long an event may wait for company before its batch is written
    flush_interval: float = 0.1
    #: wait for a stream ack
    ack_timeout: float = 2.0
    #: back-off between failed writes: doubles from ``retry_min`` up to ``retry_max``
    retry_min: float = 0.05
    retry_max: float = 1.0


class _Open:
    """The batch being filled for one capability: rows packed as they are recorded."""

    __slots__ = ("count", "due", "rows", "summary")

    def __init__(self, due: float) -> None:
        self.rows = bytearray()
        self.count = 0
        self.summary = RowSummary()
        #: monotonic time at which it is written even if not full
        self.due = due


@dataclass(slots=True)
class _Batch:
    subject: str
    msg_id: str
    data: bytes
    count: int
    headers: dict[str, str]


def _pack(
    events: Sequence[EventRow],
) -> tuple[bytes | memoryview, Sequence[EventRow], list[Exception]]:
    """The rows packed, which they are, and why the others could not be packed: all of
    them in one call, or one by one when that fails."""
    try:
        return pack_rows(events), events, []
    except (TypeError, ValueError, OverflowError):
        pass
    parts: list[bytes] = []
    packed: list[EventRow] = []
    errors: list[Exception] = []
    for event in events:
        try:
            parts.append(pack_row(event))
        except (TypeError, ValueError, OverflowError) as exc:
            errors.append(exc)
            continue
        packed.append(event)
    return b"".join(parts), packed, errors


class AuditWriter:
    """Buffers audit events and writes them to REACH_AUDIT in acked, idempotent batches."""

    def __init__(self, conn: Connection, config: WriterConfig | None = None) -> None:
        self._conn = conn
        self.config = config or WriterConfig()
        #: batches being filled, one per capability (packed rows: nothing for the GC)
        self._open: dict[str, _Open] = {}
        self._filling = 0  # events in them
        #: events to record at the end of this turn of the event loop
        self._soon: list[EventRow] = []
        self._soon_handle: asyncio.Handle | None = None
        self._batches: deque[_Batch] = deque()
        self._held = 0  # events in unsent batches
        self._wake = asyncio.Event()
        self._retry_now = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stream: Stream | None = None
        self._writer_id = secrets.token_hex(8)
        self._max_bytes = self.config.batch_max_bytes
        self._row_bytes = 256  # packed size of a row, as last seen
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
        return len(self._soon) + self._filling + self._held

    def record_soon(self, event: EventRow) -> None:
        """Queue one event row, packed with the rest of this turn's at its end (one call
        into msgpack for all of them); never blocks, never raises. For the call path."""
        self._soon.append(event)
        if self._soon_handle is None:
            self._soon_handle = asyncio.get_running_loop().call_soon(self._record_soon)

    def _record_soon(self) -> None:
        self._soon_handle = None
        soon, self._soon = self._soon, []
        self.record_all(soon)

    def record(self, event: EventRow) -> None:
        """Queue one event row (see ``reach.audit.events``); never blocks, never raises."""
        self.record_all((event,))

    def record_all(self, events: Sequence[EventRow]) -> None:
        """Queue event rows; never blocks, never raises. Those of one capability are packed
        together (one call into msgpack for a turn's events, not one per event)."""
        room = self.config.max_buffer - self._filling - self._held
        if len(events) > room:
            self.dropped += len(events) - max(room, 0)
            events = events[: max(room, 0)]
        if not events:
            return
        try:
            capabilities = list(map(capability_of, events))
        except (IndexError, TypeError, KeyError):
            capabilities = []  # a malformed row among them: sorted out one by one below
        if capabilities and capabilities.count(capabilities[0]) == len(events):
            self._add(capabilities[0], events)  # the common case: a turn of one capability
            return
        by_capability: dict[str, list[EventRow]] = {}
        for event in events:
            try:
                by_capability.setdefault(event[CAPABILITY_INDEX], []).append(event)
            except (IndexError, TypeError, KeyError) as exc:  # a bug in who built it
                self.dropped += 1
                log.error("audit: an event without a capability was dropped: %s", exc)
        for capability, rows in by_capability.items():
            self._add(capability, rows)

    def _add(self, capability: str, events: Sequence[EventRow]) -> None:
        """Pack ``events`` of one capability into its open batch; a batch is sealed when
        it holds ``batch_max`` events or would exceed its byte limit with one more."""
        limit = self.config.batch_max
        at = 0
        most = limit  # events packed at a time: halved when a chunk turns out too big
        while at < len(events):
            batch = self._open.get(capability)
            if batch is None:
                due = time.monotonic() + self.config.flush_interval
                batch = self._open[capability] = _Open(due)
            # as many as fit by count and, at the size of the rows seen last, by bytes
            fit = (self._max_bytes - len(batch.rows)) // self._row_bytes
            chunk = events[at : at + max(1, min(limit - batch.count, fit, most))]
            data, rows, errors = _pack(chunk)
            if rows and len(batch.rows) + len(data) > self._max_bytes:
                self._row_bytes = max(1, len(data) // len(rows))
                if len(chunk) > 1:
                    most = len(chunk) // 2
                elif batch.count:
                    self._seal(capability)  # the row starts a batch of its own
                else:  # alone it is more than a stream message may carry
                    at += 1
                    self.dropped += 1
                    log.error(
                        "audit: an event of %s is %d bytes packed, more than a batch may"
                        " carry (%d): dropped",
                        capability,
                        len(data),
                        self._max_bytes,
                    )
                continue
            at += len(chunk)
            most = limit
            for error in errors:  # a bug in who built them: counted, never raised
                self.dropped += 1
                log.error("audit: an event of %s cannot be packed: %s", capability, error)
            if rows:
                batch.rows += data
                batch.count += len(rows)
                batch.summary.add_all(rows)
                self._filling += len(rows)
                self._row_bytes = max(1, len(data) // len(rows))
            if batch.count >= limit or len(batch.rows) >= self._max_bytes:
                self._seal(capability)
                self._wake.set()

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
        if self._soon_handle is not None:
            self._soon_handle.cancel()
            self._record_soon()
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
            try:
                await self._send_all()
            except ReachError as exc:
                self._warn(exc)
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
        batch = self._open.pop(capability)
        if not batch.count:  # every event of it was dropped: nothing to write
            return
        self._filling -= batch.count
        self._batch_seq += 1
        self._batches.append(
            _Batch(
                subject=subjects.audit(str(capability) or "_"),
                msg_id=f"{self._writer_id}.{self._batch_seq}",
                data=encode_rows(batch.rows, batch.count, batch.summary),
                count=batch.count,
                headers=summary_headers(batch.summary),
            )
        )
        self._held += batch.count

    async def _send_all(self) -> None:
        assert self._stream is not None
        while self._batches:
            batch = self._batches[0]
            try:
                await self._stream.publish(
                    batch.subject,
                    batch.data,
                    msg_id=batch.msg_id,
                    timeout=self.config.ack_timeout,
                    headers=batch.headers,
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
