"""One view per call: the audit events of a call, merged by call id.

A call can leave more than one event: its caller's (or, when its caller does not record
calls, its callee's), and the denials of the callee or the registrar that refused it. One
of them is the call's *primary* event (``AuditEvent.primary``), the one counted as the
call; the others add to it. Writers send their batches within a fraction of a second of each other,
so ``merge_calls`` holds a call's events for ``window_sec`` after its first one arrives,
then yields the call once: its primary event, with the others beside it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass

from reach.audit.reader import AuditRecord
from reach.tasks import cancel_and_wait

__all__ = ["MERGE_WINDOW_SEC", "MergedCall", "merge_calls", "merged"]

#: how long a call's first event waits for the others: twice the writers' flush interval
#: (``WriterConfig.flush_interval``), the most two writers' batches of one call lie apart
MERGE_WINDOW_SEC = 1.0
#: records read ahead of the merge at most (the reader waits beyond it)
_READ_AHEAD = 10_000


@dataclass(frozen=True, slots=True)
class MergedCall:
    """A call as one view: its primary record (else its first), and the other records
    of the same call id in the order they arrived."""

    record: AuditRecord
    others: tuple[AuditRecord, ...] = ()


def merged(records: Iterable[AuditRecord]) -> MergedCall:
    """The records of one call as one view: the primary one leads (a caller's before a
    callee's when both say so), else the first that is not forged, else the first."""
    group = list(records)
    lead = next(
        (r for r in group if r.event.primary and r.event.side == "caller" and _trusted(r)),
        None,
    )
    lead = lead or next((r for r in group if r.event.primary and _trusted(r)), None)
    lead = lead or next((r for r in group if _trusted(r)), group[0])
    return MergedCall(lead, tuple(r for r in group if r is not lead))


def _trusted(record: AuditRecord) -> bool:
    return record.verdict != "forged"


async def merge_calls(
    records: AsyncIterator[AuditRecord], window_sec: float = MERGE_WINDOW_SEC
) -> AsyncIterator[MergedCall]:
    """``records`` merged by call id (records without one pass alone), in the order each
    call's first record arrived; a call is yielded ``window_sec`` after its first record
    arrived, or when ``records`` ends."""
    queue: asyncio.Queue[AuditRecord | None] = asyncio.Queue(_READ_AHEAD)

    async def pump() -> None:
        try:
            async for record in records:
                await queue.put(record)
        finally:
            await queue.put(None)

    reading = asyncio.create_task(pump(), name="reach-audit-merge")
    loop = asyncio.get_running_loop()
    #: call id → when it is due, and its records (in arrival order: the oldest first)
    pending: dict[str, tuple[float, list[AuditRecord]]] = {}
    try:
        while True:
            now = loop.time()
            while pending:
                call_id, (due, group) = next(iter(pending.items()))
                if due > now:
                    break
                del pending[call_id]
                yield merged(group)
            wait = next(iter(pending.values()))[0] - now if pending else None
            try:  # (not wait_for: on Python 3.11 it can lose a cancellation, see reach.tasks)
                async with asyncio.timeout(wait):
                    record = await queue.get()
            except TimeoutError:
                continue
            if record is None:
                break
            call_id = record.event.call_id
            if not call_id:
                yield MergedCall(record)
            elif call_id in pending:
                pending[call_id][1].append(record)
            else:
                pending[call_id] = (loop.time() + window_sec, [record])
        for _due, group in pending.values():
            yield merged(group)
    finally:
        await cancel_and_wait([reading])
        with contextlib.suppress(asyncio.CancelledError):
            await reading  # what the reader raised, if it failed, is raised here
