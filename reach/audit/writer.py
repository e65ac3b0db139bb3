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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from reach import subjects
from reach.audit.events import CAPABILITY_INDEX, EventRow, RowSummary, encode_rows, pack_row
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


class _Open:
    """The batch being filled for one capability: rows packed as they are recorded."""

    __slots__ = ("count", "rows", "summary")

    def __init__(self) -> None:
        self.rows = bytearray()
        self.count = 0
        self.summary = RowSummary()


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
        #: batches being filled, one per capability (packed rows: nothing for the GC)
        self._open: dict[str, _Open] = {}
        self._filling = 0  # events in them
        #: events to build and record at the end of this turn of the event loop
        self._soon: list[tuple[Callable[..., EventRow], tuple[Any, ...]]] = []
        self._soon_handle: asyncio.Handle | None = None
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
        return len(self._soon) + self._filling + self._held

    def record_soon(self, build: Callable[..., EventRow], *args: Any) -> None:
        """Record the event ``build(*args)`` at the end of this turn of the event loop.

        For the call path: the call returns before its event is built and packed, and the
        events of a turn are then built together. ``args`` must not change until then.
        """
        self._soon.append((build, args))
        if self._soon_handle is None:
            self._soon_handle = asyncio.get_running_loop().call_soon(self._record_soon)

    def _record_soon(self) -> None:
        self._soon_handle = None
        soon, self._soon = self._soon, []
        for build, args in soon:
            try:
                event = build(*args)
            except Exception:  # a bug in who built it: counted, never raised into the loop
                self.dropped += 1
                log.exception("audit: an event could not be built")
                continue
            self.record(event)

    def record(self, event: EventRow) -> None:
        """Queue one event row (see ``reach.audit.events``); never blocks, never raises."""
        if self._filling + self._held >= self.config.max_buffer:
            self.dropped += 1
            return
        capability = event[CAPABILITY_INDEX]
        try:
            data = pack_row(event)
        except (TypeError, ValueError, OverflowError) as exc:  # a bug in who built it
            self.dropped += 1
            log.error("audit: an event of %s cannot be packed: %s", capability, exc)
            return
        batch = self._open.get(capability)
        if batch is None:
            batch = self._open[capability] = _Open()
        batch.rows += data
        batch.count += 1
        batch.summary.add(event)
        self._filling += 1
        if batch.count >= self.config.batch_max:
            self._seal(capability)
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
            self._wake.set()
            await asyncio.sleep(self.config.retry_min)

    # -- the background writer -------------------------------------------------------

    async def _run(self) -> None:
        delay = self.config.retry_min
        while True:
            if not self._filling and not self._batches:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.config.flush_interval)
                continue
            if not self._batches:
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
        """Seal the batches being filled: each becomes one stream message."""
        for capability in list(self._open):
            self._seal(capability)

    def _seal(self, capability: str) -> None:
        batch = self._open.pop(capability)
        self._filling -= batch.count
        self._batch_seq += 1
        self._batches.append(
            _Batch(
                subject=subjects.audit(str(capability) or "_"),
                msg_id=f"{self._writer_id}.{self._batch_seq}",
                data=encode_rows(batch.rows, batch.count, batch.summary),
                count=batch.count,
            )
        )
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
