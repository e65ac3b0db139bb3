"""Writing audit events off the hot path, without losing them.

``record`` takes one event (``reach.audit.events.CallEvent``), synchronously and in
O(1): the event joins the batch being filled for its capability (a plain call as a slot
in its columns, anything else as a packed row, ``reach.audit.batch.BatchBuilder``) and
the call goes on. A background task seals batches when they are full or due (one stream
message each) and publishes each with a message id, waiting for the stream's ack. A
batch that is not acked (NATS unreachable, stream missing, timeout) stays at the head and
is resent with the *same* message id, so a resend after a lost ack is not stored twice;
the writer keeps trying for as long as it runs, sooner when its connection is back.

While the stream does not ack, events are held in memory up to ``max_buffer``; past it
the oldest sealed batches go to a spool file on local disk (``reach.audit.spool``, with
their message ids), and at shutdown whatever the stream has not acked by then goes there
too. A writer of the same NATS user on the same fabric sends what it finds there first,
at its start. Only when the spool is full (or off) are events dropped: counted in
``dropped``, logged once per outage, and told to the alert rules (``audit_dropped``)
once the stream acks again. The spool costs nothing while the stream acks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path

from reach.audit.batch import (
    BatchBuilder,
    pack_event,
    summary_headers,
)
from reach.audit.events import CallEvent
from reach.audit.notices import Notices
from reach.audit.spool import Batch, Spool
from reach.audit.writerconfig import WriterConfig
from reach.errors import ConfigurationError, NoResponders, ReachError, StoreFull
from reach.settings import resolve_audit_spool, resolve_audit_spool_max
from reach.tasks import cancel_and_wait, wait_set
from reach.transport import Connection, Stream
from reach.wire import subjects

__all__ = ["AuditWriter", "WriterConfig"]

log = logging.getLogger("reach.audit")


class _Open:
    """The batch being filled for one capability, and when it is written even if not full."""

    __slots__ = ("batch", "due")

    def __init__(self, capability: str, due: float) -> None:
        self.batch = BatchBuilder(capability)
        #: monotonic time at which it is written even if not full
        self.due = due


class AuditWriter:
    """Buffers audit events and writes them to REACH_AUDIT in acked, idempotent batches.

    ``servers``: the URLs the fabric was reached at; with the connection's NATS user they
    name the spool directory (none given: the URL the connection is on at ``start``)."""

    def __init__(
        self, conn: Connection, config: WriterConfig | None = None, *, servers: Sequence[str] = ()
    ) -> None:
        self._conn = conn
        self.config = config or WriterConfig()
        self._servers = tuple(servers)
        self._spool_root: Path | None = resolve_audit_spool(self.config.spool)
        self._spool_max = resolve_audit_spool_max(self.config.spool_max_bytes)
        self._spool: Spool | None = None
        #: batches being filled, one per capability (columns of numbers and names, packed
        #: rows: nothing that keeps the garbage collector busy)
        self._open: dict[str, _Open] = {}
        self._filling = 0  # events in them
        self._batches: deque[Batch] = deque()
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
        #: events acked by the stream / dropped (memory and spool full, or not packable)
        self.written = 0
        self.dropped = 0
        #: the alert rules' notices, and the drops not told to them yet
        self._notices = Notices(conn, self.config.ack_timeout)
        #: why the stream does not ack now (a ``StoreFull`` names a full disk); None while
        #: it acks
        self.last_error: ReachError | None = None
        #: said once per outage (and once more when it turns out to be a full store): the
        #: stream does not ack, events go to the spool, dropped
        self._warned = False
        self._warned_full = False
        self._spilling = False
        self._dropping = False

    @property
    def pending(self) -> int:
        """Events recorded but not yet acked by the stream (in memory or spooled)."""
        spooled = self._spool.events if self._spool is not None else 0
        return self._filling + self._held + spooled

    @property
    def spool(self) -> Spool | None:
        """Where events wait on disk (None: no spool, or not started)."""
        return self._spool

    def record(self, event: CallEvent) -> None:
        """Queue one event; never blocks, never raises. A plain call (the common case) is
        a few list appends, anything else is packed here."""
        capability = event.capability
        batch = self._batch_for(capability)
        if batch is None:
            return
        try:
            if batch.add_if_plain(event):
                self._added(capability, batch)
                return
            data = pack_event(event)
        except (TypeError, ValueError, OverflowError) as exc:  # a field of the wrong type
            self._drop(1)
            log.error("audit: an event of %s cannot be recorded: %s", capability, exc)
            return
        if len(data) > self._max_bytes:  # alone it is more than a message may carry
            self._drop(1)
            log.error(
                "audit: an event of %s is %d bytes packed, more than a batch may carry"
                " (%d): dropped",
                capability,
                len(data),
                self._max_bytes,
            )
            return
        if batch.count and batch.size + len(data) > self._max_bytes:
            self._seal(capability)  # the row starts a batch of its own
            batch = self._start(capability).batch
        batch.add_packed(event, data)
        self._added(capability, batch)

    def record_plain(
        self, *, capability: str, ts: float, call_id: str, trace_id: str, caller: str,
        caller_agent: str | None, callee: str, latency_ms: float, candidates: tuple[str, ...],
        n_candidates: int, score: float | None, attempt_latency_ms: float,
        actor: str | None = None,
    ) -> None:  # fmt: skip
        """A caller's plain call (answered at its first attempt by the instance it went
        to, nothing skipped, no fallback) by its fields, ``CallEvent``'s: what ``record``
        does with such an event, without one built (``Columns.add_call``). Never blocks,
        never raises."""
        batch = self._batch_for(capability)
        if batch is None:
            return
        try:
            batch.columns.add_call(
                ts=ts, call_id=call_id, trace_id=trace_id, caller=caller,
                caller_agent=caller_agent, callee=callee, latency_ms=latency_ms,
                candidates=candidates, n_candidates=n_candidates, score=score,
                attempt_latency_ms=attempt_latency_ms, actor=actor,
            )  # fmt: skip
        except (TypeError, ValueError) as exc:  # a field of the wrong type or range
            self._drop(1)
            log.error("audit: an event of %s cannot be recorded: %s", capability, exc)
            return
        batch.count += 1
        self._added(capability, batch)

    def _batch_for(self, capability: str) -> BatchBuilder | None:
        """The batch an event of ``capability`` joins; None when there is no room in
        memory or the spool (the event is dropped, counted)."""
        if self._filling + self._held >= self._max_buffer and not self._make_room():
            self._full()
            return None
        at = self._open.get(capability)  # (sealed once full: an open one has room)
        return at.batch if at is not None else self._start(capability).batch

    def _added(self, capability: str, batch: BatchBuilder) -> None:
        """One event joined ``batch``: it is sealed once full (by count, bytes or names)."""
        self._filling += 1
        if batch.count >= self._batch_max or batch.size >= self._max_bytes or batch.full:
            self._seal(capability)
            self._wake.set()

    def record_all(self, events: Sequence[CallEvent]) -> None:
        """Queue events; never blocks, never raises."""
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
            if self._spool_root is not None:
                servers = self._servers or (self._conn.connected_url,)
                self._spool = Spool.open(
                    self._spool_root, servers, self._conn.writer, self._writer_id, self._spool_max
                )
            self._task = asyncio.create_task(self._run(), name="reach-audit-writer")

    async def stop(self, timeout: float = 5.0) -> None:
        """Write what is buffered (waiting at most ``timeout``), then stop; what the stream
        has not acked by then stays in the spool for the next writer of this user."""
        if self._task is None:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.flush(), timeout)
        await cancel_and_wait([self._task])
        self._task = None
        self._keep_rest()

    def _keep_rest(self) -> None:
        """At shutdown: every batch not acked goes to the spool (dropped, counted, if it
        cannot), with the count of drops the alert rules have not heard of."""
        for capability in list(self._open):
            self._seal(capability)
        spool = self._spool
        while self._batches and spool is not None and self._spill(self._batches[0]):
            self._batches.popleft()
        lost = sum(batch.count for batch in self._batches)
        if lost:
            self._batches.clear()
            self._held -= lost
            self._drop(lost)
            log.error(
                "audit: %d event(s) not written before shutdown, and dropped: %s",
                lost,
                "no spool (REACH_AUDIT_SPOOL=off)" if spool is None else "the spool is full",
            )
        if spool is None:
            return
        notices = self._notices
        if notices.unreported and spool.append_drops(notices.unreported):
            notices.unreported = 0
        if spool.events:
            log.warning(
                "audit: %d event(s) not acked by %s before shutdown: kept in %s, sent by the"
                " next writer of %s on this fabric",
                spool.events,
                subjects.AUDIT_STREAM,
                spool.directory,
                self._conn.writer,
            )
        spool.close()

    async def flush(self) -> None:
        """Return once every event recorded so far is acked by the stream."""
        while self.pending:
            self._flushing = True
            self._wake.set()
            await asyncio.sleep(self.config.retry_min)

    # -- memory, spool, drops --------------------------------------------------------

    def _make_room(self) -> bool:
        """Memory is at its bound: the oldest sealed batches go to the spool, down to half
        the bound (not a disk write per event). False when there is no room (no spool,
        or a full one): the new event is dropped, the oldest ones kept."""
        if self._spool is None:
            return False
        for capability in list(self._open):
            self._seal(capability)
        target = self._max_buffer // 2
        while self._held > target and self._batches and self._spill(self._batches[0]):
            self._batches.popleft()
        return self._filling + self._held < self._max_buffer

    def _spill(self, batch: Batch) -> bool:
        """``batch`` (the head of ``_batches``, which the caller pops) to the spool."""
        assert self._spool is not None
        if not self._spool.append(batch):
            return False
        self._held -= batch.count
        if not self._spilling:
            self._spilling = True
            log.warning(
                "audit: %d event(s) wait for %s: past %d in memory they go to %s (up to %s)",
                self.pending,
                subjects.AUDIT_STREAM,
                self._max_buffer,
                self._spool.path,
                _size(self._spool.max_bytes),
            )
        return True

    def _drop(self, count: int) -> None:
        """``count`` events are lost: counted, and told to the alert rules (once the
        stream acks again; see ``Notices.report_drops``)."""
        self.dropped += count
        self._notices.unreported += count

    def _full(self) -> None:
        """No room for a new event, in memory or the spool: dropped, logged once."""
        self._drop(1)
        if not self._dropping:
            self._dropping = True
            where = f"the spool {self._spool.path} is full" if self._spool else "no spool"
            log.error(
                "audit: dropping events while %s does not ack: %s (counted; alert audit_dropped)",
                subjects.AUDIT_STREAM,
                where,
            )

    # -- the background writer -------------------------------------------------------

    async def _run(self) -> None:
        delay = self.config.retry_min
        while True:
            if not self._batches and not self._spooled():
                # wait for a full batch (recording wakes us), or for the oldest one to be due
                due = min((b.due for b in self._open.values()), default=None)
                wait = self.config.flush_interval if due is None else due - time.monotonic()
                if wait > 0 and not self._flushing:
                    self._wake.clear()
                    await wait_set(self._wake, wait)
            self._seal_due(time.monotonic())
            if not self._batches and not self._spooled():
                if self._notices.drops_due():
                    await self._notices.report_drops()
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
                await wait_set(self._retry_now, delay)
                delay = min(self.config.retry_max, delay * 2)
            else:
                delay = self.config.retry_min

    def _spooled(self) -> bool:
        return self._spool is not None and self._spool.records > 0

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
            self._drop(batch.count)
            log.exception(
                "audit: a batch of %d event(s) of %s was dropped", batch.count, capability
            )
            return
        if lost:
            self._drop(lost)
            log.error("audit: %d event(s) of %s cannot be packed: dropped", lost, capability)
        if batch.count == lost:
            return
        self._batches.append(
            Batch(
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
        """Write the spool's batches (the oldest), then memory's, each until acked."""
        while True:
            batch, spooled = self._next()
            if batch is None:
                return
            failure: ReachError | None = None
            seq = 0
            try:
                seq = await self._publish(batch)
            except ReachError as exc:
                failure = exc
            except BaseException:  # cancelled (stop): the batch keeps its place
                if not spooled:
                    self._batches.appendleft(batch)
                raise
            if failure is not None and not isinstance(failure, ConfigurationError):
                if not spooled:
                    self._batches.appendleft(batch)
                raise failure
            self._sent(batch, spooled)
            if failure is not None:
                # refused for good (larger than the server takes): resending cannot help,
                # and holding it would hold up every batch behind it
                self._drop(batch.count)
                log.error("audit: a batch of %d event(s) was refused: %s", batch.count, failure)
                continue
            self.written += batch.count
            if self._warned:
                self._back()
            await self._notices.stored(batch, seq)

    def _next(self) -> tuple[Batch | None, bool]:
        """The next batch to write, and whether it comes from the spool (else it is taken
        off ``_batches``: a spill while it is in flight cannot take it)."""
        spool = self._spool
        if spool is not None and spool.records:
            batch = spool.peek()
            self._drop(spool.lost)  # damaged records skipped
            self._notices.unreported += spool.drops  # drops an earlier writer had not reported
            spool.lost = spool.drops = 0
            if batch is not None:
                return batch, True
        if self._batches:
            return self._batches.popleft(), False
        return None, False

    def _sent(self, batch: Batch, spooled: bool) -> None:
        if spooled:
            assert self._spool is not None
            self._spool.done()
        else:
            self._held -= batch.count

    def _back(self) -> None:
        """The stream acks again after an outage: the next one is worth a line again."""
        self._warned = self._warned_full = self._spilling = self._dropping = False
        self.last_error = None
        log.info("audit: %s acks again; %d event(s) to write", subjects.AUDIT_STREAM, self.pending)

    async def _publish(self, batch: Batch) -> int:
        assert self._stream is not None
        return await self._stream.publish(
            subjects.audit(batch.capability, self._conn.writer),
            batch.data,
            msg_id=batch.msg_id,
            timeout=self.config.ack_timeout,
            headers=summary_headers(batch.summary),
        )

    def _warn(self, exc: ReachError) -> None:
        self.last_error = exc
        full = isinstance(exc, StoreFull)
        if not self._warned or (full and not self._warned_full):
            self._warned = True
            self._warned_full = full
            hint = (
                " (`reach up` or a registrar creates it)" if isinstance(exc, NoResponders) else ""
            )
            spool = self._spool
            where = f", then in {spool.directory}" if spool is not None else ""
            log.warning(
                "audit: cannot write to %s yet, holding %d event(s) (in memory up to %d%s;"
                " retrying until it acks): %s%s",
                subjects.AUDIT_STREAM,
                self.pending,
                self._max_buffer,
                where,
                exc,
                hint,
            )


def _size(n: int) -> str:
    return f"{n / (1 << 20):.0f} MiB" if n >= 1 << 20 else f"{n / 1024:.0f} KiB"
