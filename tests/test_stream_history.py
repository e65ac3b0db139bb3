"""Reading a stream's history (``reach agents``' p99 column, ``reach audit tail``,
``reach alerts``, the doctor): every stored message of the window once, in order; a
window with nothing in it is answered at once, without waiting for stragglers."""

from __future__ import annotations

import asyncio
import time

from reach.transport import Connection
from reach.transport.jetstream import _HISTORY_QUIET

STREAM = "HISTORY"


async def _stored(conn: Connection, n: int) -> float:
    """A stream holding ``n`` messages; the time after the last was stored."""
    stream = await conn.stream(STREAM, ["history.>"], create=True)
    for i in range(n):
        await stream.publish(f"history.{i % 2}", b"%d" % i, msg_id=f"h-{i}", timeout=5.0)
    return time.time()


async def test_a_history_read_yields_every_stored_message_once_in_order(
    conn: Connection,
) -> None:
    await _stored(conn, 5)
    stream = await conn.stream(STREAM)
    assert [m.data async for m in stream.read()] == [b"%d" % i for i in range(5)]
    assert [m.data async for m in stream.read("history.1")] == [b"1", b"3"]


async def test_an_empty_window_is_answered_at_once(conn: Connection) -> None:
    after = await _stored(conn, 3)
    stream = await conn.stream(STREAM)
    reads = 30

    async def empty_reads() -> None:
        for n in range(reads):
            # a window after every message, a subject with none
            since, subject = (after + 1, ">") if n % 2 else (None, "history.none")
            assert [m async for m in stream.read(subject, since=since)] == []

    # waiting the quiet time on each read would take twice this
    async with asyncio.timeout(reads * _HISTORY_QUIET / 2):
        await empty_reads()
