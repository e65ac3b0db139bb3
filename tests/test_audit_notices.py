"""Notices of stored audit batches (``reach.v1.audited.<capability>``) and the alert
watcher that reads them instead of consuming REACH_AUDIT, against a real nats-server."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest

from reach.audit import AuditWriter, WriterConfig, ensure_streams
from reach.audit.alert_watcher import AlertWatcher
from reach.audit.batch import RowSummary, encode_notice
from reach.audit.eventmodels import AuditNotice, decode_batch, decode_notice
from reach.errors import ReachTimeout
from reach.registry import Registrar
from reach.transport import Connection, Message, Stream
from reach.wire import subjects
from tests.audit_helpers import MAX_TRACKED, event, until_fired

RETRIED = [{"agent_id": "echo-2", "outcome": "timeout"}, {"agent_id": "echo-1"}]


class Notices:
    """Every notice published, as decoded, in order."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, AuditNotice]] = []
        self.changed = asyncio.Event()

    async def handle(self, msg: Message) -> None:
        self.seen.append((msg.subject, decode_notice(msg.data)))
        self.changed.set()

    async def wait_for(self, count: int) -> None:
        async with asyncio.timeout(10):
            while len(self.seen) < count:
                self.changed.clear()
                await self.changed.wait()


def test_a_notice_round_trips_and_a_bad_one_names_its_field() -> None:
    summary = RowSummary()
    summary.add_calls("query", 30)
    summary.add(event(1, "query", attempts=RETRIED))
    notice = decode_notice(encode_notice(7, summary))
    assert notice == AuditNotice(seq=7, calls={"query": 31}, notable=1)
    for data, field in [
        (b'{"seq":0,"calls":{},"notable":0}', "seq"),
        (b'{"seq":"3","calls":{},"notable":0}', "seq"),
        (b'{"seq":3,"calls":{"q":0},"notable":0}', "calls"),
        (b'{"seq":3,"calls":{"":1},"notable":0}', "calls"),
        (b'{"seq":3,"calls":[],"notable":0}', "calls"),
        (b'{"seq":3,"calls":{},"notable":-1}', "notable"),
        (b'{"seq":3,"calls":{}}', "notable"),
    ]:
        with pytest.raises(ValueError, match=field):
            decode_notice(data)
    with pytest.raises(ValueError, match="Invalid JSON"):
        decode_notice(b"\xc1 not json")


async def test_each_stored_batch_is_announced_with_its_sequence_and_summary(
    conn: Connection,
) -> None:
    audit, _ = await ensure_streams(conn)
    notices = Notices()
    sub = await conn.subscribe(subjects.audited("*", "*"), notices.handle)
    await conn.flush()
    writer = AuditWriter(conn, WriterConfig(flush_interval=0.02))
    await writer.start()
    try:
        writer.record_all([event(n) for n in range(5)] + [event(5, attempts=RETRIED)])
        writer.record_all([event(n, "report") for n in range(6, 9)])
        await asyncio.wait_for(writer.flush(), 10)
        await notices.wait_for(2)
    finally:
        await writer.stop()
        await sub.unsubscribe()
    by_subject = dict(notices.seen)
    assert set(by_subject) == {
        subjects.audited("echo", subjects.ANONYMOUS),
        subjects.audited("report", subjects.ANONYMOUS),
    }
    echo = by_subject[subjects.audited("echo", subjects.ANONYMOUS)]
    assert (echo.calls, echo.notable) == ({"echo": 6}, 1)
    report = by_subject[subjects.audited("report", subjects.ANONYMOUS)]
    assert (report.calls, report.notable) == ({"report": 3}, 0)
    # the sequence is the stream's: the batch is there
    events, bad = decode_batch(await audit.get(echo.seq))
    assert bad == 0
    assert sorted(e.call_id for e in events) == [f"c-{n}" for n in range(6)]


async def test_a_batch_resent_after_a_lost_ack_is_announced_once_at_its_first_place(
    conn: Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stream stored the batch but its ack never came back: the writer resends it (the
    message id makes the stream keep one copy) and announces it once, with the sequence of
    the copy that is there."""
    audit, _ = await ensure_streams(conn)
    publish = Stream.publish
    lost = 0

    async def ack_lost_once(self: Stream, *args: Any, **kwargs: Any) -> int:
        nonlocal lost
        seq = await publish(self, *args, **kwargs)
        if lost == 0:
            lost = seq
            raise ReachTimeout("no ack in time")
        return seq

    monkeypatch.setattr(Stream, "publish", ack_lost_once)
    notices = Notices()
    sub = await conn.subscribe(subjects.audited("*", "*"), notices.handle)
    await conn.flush()
    writer = AuditWriter(conn, WriterConfig(flush_interval=0.01, retry_min=0.01))
    await writer.start()
    try:
        writer.record_all([event(n) for n in range(3)])
        await asyncio.wait_for(writer.flush(), 10)
        await notices.wait_for(1)
        await conn.flush()  # a second notice, had there been one, is here by now
    finally:
        await writer.stop()
        await sub.unsubscribe()
    assert lost > 0
    assert [(n.seq, n.calls) for _, n in notices.seen] == [(lost, {"echo": 3})]
    assert len([m async for m in audit.read()]) == 1


async def test_the_watcher_counts_plain_notices_and_reads_only_notable_batches(
    conn: Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    await ensure_streams(conn)
    fetch = Stream.get_message
    fetched: list[int] = []

    async def counted_get(self: Stream, seq: int) -> tuple[str, bytes]:
        fetched.append(seq)
        return await fetch(self, seq)

    monkeypatch.setattr(Stream, "get_message", counted_get)
    watcher = AlertWatcher(conn)
    await watcher.start()
    writer = AuditWriter(conn, WriterConfig(flush_interval=0.01))
    await writer.start()
    notices = Notices()
    sub = await conn.subscribe(subjects.audited("*", "*"), notices.handle)
    await conn.flush()
    try:
        writer.record_all([event(n) for n in range(40)])
        await asyncio.wait_for(writer.flush(), 10)
        await notices.wait_for(1)
        await conn.flush()
        assert watcher.engine._calls["echo"].count(time.time()) == 40
        assert fetched == []  # nothing notable: the batch itself is never read
        writer.record_all([event(40 + n, attempts=RETRIED) for n in range(11)])  # 11 retries
        await until_fired(watcher)
    finally:
        await writer.stop()
        await sub.unsubscribe()
        await watcher.stop()
    assert [a.rule for a in watcher.fired] == ["retry_storm"]
    assert len(fetched) >= 1
    assert watcher.engine._calls["echo"].count(time.time()) == 51


async def test_a_malformed_notice_is_skipped_and_the_watcher_goes_on(conn: Connection) -> None:
    await ensure_streams(conn)
    watcher = AlertWatcher(conn)
    await watcher.start()
    writer = AuditWriter(conn, WriterConfig(flush_interval=0.01))
    await writer.start()
    try:
        for junk in (
            b"",
            b"\xc1",
            b'{"seq":1}',
            b'{"seq":1,"calls":{"echo":-5},"notable":0}',
            b'{"seq":999999,"calls":{"echo":1},"notable":1}',  # no such batch
        ):
            await conn.publish(subjects.audited("echo", subjects.ANONYMOUS), junk)
        await conn.flush()
        writer.record_all([event(n, attempts=RETRIED) for n in range(11)])
        await until_fired(watcher)
    finally:
        await writer.stop()
        await watcher.stop()
    assert [a.rule for a in watcher.fired] == ["retry_storm"]


# -- notices with many names -----------------------------------------------------------


async def test_forged_notices_with_many_names_keep_the_registrars_alert_state_bounded(
    registrar: Registrar, conn: Connection
) -> None:
    watcher = registrar._alerts
    assert watcher is not None
    engine = watcher.engine
    subject = subjects.audited("x", subjects.ANONYMOUS)

    def notice(calls: dict[str, int]) -> bytes:
        return json.dumps({"seq": 1, "calls": calls, "notable": 0}).encode()

    await conn.publish(subject, notice({"sentinel": 1}))
    for n in range(2):  # 10,100 names: just over the limit
        await conn.publish(subject, notice({f"n{n}-{i}": 1 for i in range(5050)}))
    await conn.publish(subject, notice({"sentinel": 1000}))  # the last one: all are counted
    await conn.flush()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        sentinel = engine._calls.get("sentinel")
        if sentinel is not None and sentinel.total >= 1001:
            break
        await asyncio.sleep(0.05)
    else:
        pytest.fail("the registrar did not count the notices")
    assert len(engine._calls) <= MAX_TRACKED
