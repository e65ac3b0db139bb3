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
from collections import deque
from dataclasses import dataclass

from reach import subjects
from reach.audit.events import CAPABILITY_INDEX, EventRow, encode_batch
from reach.errors import NoResponders, ReachError
from reach.tasks import cancel_and_wait
from reach.transport import Connection, Stream

__all__ = ["AuditWriter", "WriterConfig"]

log = logging.getLogger("reach.audit")


@dataclass(frozen=True, slots=True)
class WriterConfig:
    #: events held while the stream cannot be written (then new ones are dropped, counted)
    max_buffer: int = 100_000
    #: events per stream message
    batch_max: int = 512
    #: how long an event may wait for company before its batch is written
    flush_interval: float = 0.1
    #: wait for a stream ack
    ack_timeout: float = 2.0
    #: back-off between failed writes: doubles from ``retry_min`` up to ``retry_max``
    retry_min: float = 0.05
    retry_max: float = 1.0


@dataclass(slots=True)
class _Batch:
    subject: str
    msg_id: str
    data: bytes
    count: int


class AuditWriter:
    """Buffers audit events and writes them to REACH_AUDIT in acked, idempotent batches."""

    def __init__(self, conn: Connection, config: WriterConfig | None = None) -> None:
        self._conn = conn
        self.config = config or WriterConfig()
        self._events: deque[EventRow] = deque()
        self._batches: deque[_Batch] = deque()
        self._held = 0  # events in unsent batches
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stream: Stream | None = None
        self._writer_id = secrets.token_hex(8)
        self._batch_seq = 0
        #: events acked by the stream / dropped because the buffer was full
        self.written = 0
        self.dropped = 0
        self._warned = False

    @property
    def pending(self) -> int:
        """Events recorded but not yet acked by the stream."""
        return len(self._events) + self._held

    def record(self, event: EventRow) -> None:
        """Queue one event row (see ``reach.audit.events``); never blocks, never raises."""
        if len(self._events) + self._held >= self.config.max_buffer:
            self.dropped += 1
            return
        self._events.append(event)
        if len(self._events) == self.config.batch_max:
            self._wake.set()

    def reconnected(self) -> None:
        """NATS is back: write what is waiting now rather than after the back-off."""
        self._wake.set()

    async def start(self) -> None:
        if self._task is None:
            self._stream = await self._conn.stream(subjects.AUDIT_STREAM, check=False)
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
            self._wake.set()
            await asyncio.sleep(self.config.retry_min)

    # -- the background writer -------------------------------------------------------

    async def _run(self) -> None:
        delay = self.config.retry_min
        while True:
            if not self._events and not self._batches:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.config.flush_interval)
                continue
            if len(self._events) < self.config.batch_max and not self._batches:
                # let the batch fill for one interval: fewer, larger stream writes
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.config.flush_interval)
            self._pack()
            try:
                await self._send_all()
            except ReachError as exc:
                self._warn(exc)
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), delay)
                delay = min(self.config.retry_max, delay * 2)
            else:
                delay = self.config.retry_min

    def _pack(self) -> None:
        """Move buffered events into batches of one capability each."""
        groups: dict[str, list[EventRow]] = {}
        while self._events:
            event = self._events.popleft()
            capability = event[CAPABILITY_INDEX]
            group = groups.setdefault(capability, [])
            group.append(event)
            if len(group) == self.config.batch_max:
                self._add_batch(groups.pop(capability))
        for group in groups.values():
            self._add_batch(group)

    def _add_batch(self, events: list[EventRow]) -> None:
        self._batch_seq += 1
        capability = str(events[0][CAPABILITY_INDEX]) or "_"
        batch = _Batch(
            subject=subjects.audit(capability),
            msg_id=f"{self._writer_id}.{self._batch_seq}",
            data=encode_batch(events),
            count=len(events),
        )
        self._batches.append(batch)
        self._held += batch.count

    async def _send_all(self) -> None:
        assert self._stream is not None
        while self._batches:
            batch = self._batches[0]
            await self._stream.publish(
                batch.subject, batch.data, msg_id=batch.msg_id, timeout=self.config.ack_timeout
            )
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
