"""The audit writer and the record streams, against a real nats-server with JetStream,
and the filters events are read back with."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import msgpack
import nats
import pytest

from reach.audit import AuditFilter, AuditWriter, WriterConfig, ensure_streams, read_events
from reach.audit.batch import encode_batch, event_row
from reach.audit.eventmodels import AuditAttempt, AuditEvent, decode_batch
from reach.audit.events import EVENT_FIELDS, CallEvent, attempt
from reach.audit.reader import read_records
from reach.audit.recording import CallRecorder, CallTrail
from reach.clock import SystemClock
from reach.errors import ReachError
from reach.telemetry import Telemetry, new_traceparent
from reach.testing import NatsServer
from reach.transport import Connection, connect
from reach.wire import subjects
from reach.wire.envelope import RequestMeta
from tests.audit_helpers import event, until_fired
from tests.poll_helpers import until

#: what the writer logs once an outage keeps it from writing (reach.audit.writer)
HOLDING = f"cannot write to {subjects.AUDIT_STREAM} yet, holding"


async def count_events(conn: Connection, flt: AuditFilter | None = None) -> list[AuditEvent]:
    return [e async for e in read_events(conn, flt)]


async def test_streams_are_file_backed_and_refuse_delete_and_purge(conn: Connection) -> None:
    audit, _ = await ensure_streams(conn)
    await audit.publish(subjects.audit("echo", subjects.ANONYMOUS), b"\x90", msg_id="m1", timeout=2)
    # the JetStream API answers both with an error: a record is never edited
    for api in (f"$JS.API.STREAM.PURGE.{subjects.AUDIT_STREAM}",):
        reply = await conn.request(api, b"", timeout=2)
        assert b"error" in reply
    reply = await conn.request(
        f"$JS.API.STREAM.MSG.DELETE.{subjects.AUDIT_STREAM}", b'{"seq":1}', timeout=2
    )
    assert b"error" in reply
    info = await conn.request(f"$JS.API.STREAM.INFO.{subjects.AUDIT_STREAM}", b"", timeout=2)
    assert b'"storage":"file"' in info
    assert b'"deny_delete":true' in info
    assert b'"deny_purge":true' in info


async def test_a_resent_batch_is_stored_once(conn: Connection) -> None:
    audit, _ = await ensure_streams(conn)
    first = await audit.publish(
        subjects.audit("echo", subjects.ANONYMOUS), b"\x90", msg_id="same", timeout=2
    )
    again = await audit.publish(
        subjects.audit("echo", subjects.ANONYMOUS), b"\x90", msg_id="same", timeout=2
    )
    assert first == again
    assert len([m async for m in audit.read()]) == 1


async def test_events_are_batched_per_capability_and_read_back_with_filters(
    conn: Connection,
) -> None:
    await ensure_streams(conn)
    writer = AuditWriter(conn, WriterConfig(flush_interval=0.02, batch_max=50))
    await writer.start()
    for n in range(120):
        writer.record(event(n, "echo" if n % 3 else "report"))
    await asyncio.wait_for(writer.flush(), 10)
    assert writer.written == 120
    assert writer.pending == 0
    assert writer.dropped == 0
    everything = await count_events(conn)
    assert sorted(e.call_id for e in everything) == sorted(f"c-{n}" for n in range(120))
    reports = await count_events(conn, AuditFilter(capability="report"))
    assert len(reports) == 40
    assert all(e.capability == "report" for e in reports)
    # batches hold many events: far fewer stream messages than events
    stream = await conn.stream(subjects.AUDIT_STREAM)
    messages = [m async for m in stream.read()]
    assert len(messages) < 20
    assert sum(len(decode_batch(m.data)[0]) for m in messages) == 120
    await writer.stop()


async def test_events_survive_a_nats_restart_and_none_is_written_twice(
    nats_server: NatsServer, caplog: pytest.LogCaptureFixture
) -> None:
    conn = await connect([nats_server.url], name="writer")
    await ensure_streams(conn)
    writer = AuditWriter(conn, WriterConfig(flush_interval=0.02, retry_max=0.2))
    await writer.start()
    try:
        for n in range(100):
            writer.record(event(n))
        await asyncio.wait_for(writer.flush(), 10)
        await asyncio.to_thread(nats_server.stop_now)
        # recorded while NATS is away: held, not lost (the call path never waits)
        for n in range(100, 400):
            writer.record(event(n))
        # the writer tries, and says it holds them until the stream acks
        await until(
            lambda: any(HOLDING in r.getMessage() for r in caplog.records),
            "the writer says it holds them",
        )
        assert writer.pending >= 300
        await asyncio.to_thread(nats_server.start_now)
        await asyncio.wait_for(writer.flush(), 30)
        assert writer.dropped == 0
        ids = [e.call_id for e in await count_events(conn)]
        assert sorted(ids) == sorted(f"c-{n}" for n in range(400))  # each exactly once
    finally:
        await writer.stop()
        await conn.close()


async def test_a_full_buffer_without_a_spool_drops_new_events_and_counts_them(
    conn: Connection,
) -> None:
    # no stream yet: nothing can be written, so the buffer fills
    config = WriterConfig(max_buffer=50, flush_interval=0.01, retry_max=0.05, spool="off")
    writer = AuditWriter(conn, config)
    await writer.start()
    for n in range(80):
        writer.record(event(n))
    assert writer.dropped == 30
    assert writer.pending == 50
    # once the stream exists the held events are written, in order, and nothing more lost
    await ensure_streams(conn)
    await asyncio.wait_for(writer.flush(), 10)
    ids = [e.call_id for e in await count_events(conn)]
    assert ids == [f"c-{n}" for n in range(50)]
    await writer.stop()


async def test_a_plain_call_recorded_as_columns_reads_back_as_the_same_event(
    conn: Connection,
) -> None:
    """Plain calls (one attempt, answered by the instance it went to) are kept as columns
    and read back as the events recorded; a call with a retry stays a full row among
    them, in the order recorded."""
    await ensure_streams(conn)
    writer = AuditWriter(conn, WriterConfig(flush_interval=0.01))
    await writer.start()
    trace = "0af7651916cd43dd8448eb211c80319c"
    for n in range(3):
        writer.record(
            CallEvent(
                ts=1000.5 + n,
                capability="echo",
                call_id=f"c-{n}",
                trace_id=trace,
                caller="tester",
                callee="echo-1",
                outcome="ok",
                latency_ms=1.25,
                candidates=("echo-1", "echo-2"),
                n_candidates=5,
                attempts=(attempt(agent_id="echo-1", score=0.75, latency_ms=1.0),),
            )
        )
    retried = [{"agent_id": "echo-2", "outcome": "timeout"}, {"agent_id": "echo-1"}]
    writer.record(event(3, attempts=retried))
    writer.record(
        event(
            4, ts=1003.5, trace_id=trace, candidates=["echo-1", "echo-2"], n_candidates=5,
            latency_ms=1.25, attempts=[{"agent_id": "echo-1", "score": 0.75, "latency_ms": 1.0}],
        )
    )  # fmt: skip
    await writer.stop()
    assert writer.written == 5
    stream = await conn.stream(subjects.AUDIT_STREAM)
    (message,) = [m async for m in stream.read()]
    events, bad = decode_batch(message.data)
    assert bad == 0
    assert [e.call_id for e in events] == ["c-0", "c-1", "c-2", "c-3", "c-4"]
    assert len(msgpack.unpackb(message.data)["events"]) == 1  # the retried call alone
    first, last = events[0], events[4]
    assert first.model_dump(exclude={"call_id", "ts"}) == last.model_dump(exclude={"call_id", "ts"})
    assert (first.ts, last.ts) == (1000.5, 1003.5)
    assert first.trace_id == trace
    assert first.candidates == ["echo-1", "echo-2"]
    assert first.n_candidates == 5
    assert first.attempts[0].model_dump() == {
        "agent_id": "echo-1", "score": 0.75, "outcome": "ok", "latency_ms": 1.0,
    }  # fmt: skip
    assert events[3].retries == 1


async def test_an_unpackable_plain_call_is_dropped_and_counted_and_the_writer_goes_on(
    conn: Connection,
) -> None:
    """A plain call is packed when its batch is sealed, in the background: one that
    cannot be (a lone surrogate is not UTF-8) is counted in ``dropped``; its batch's other
    events and every later one are written."""
    await ensure_streams(conn)
    writer = AuditWriter(conn, WriterConfig(flush_interval=0.01))
    await writer.start()
    writer.record(event(0))
    writer.record(event(1, caller="x\udcff"))
    writer.record(event(2))
    await asyncio.wait_for(writer.flush(), 10)
    writer.record(event(3))
    await asyncio.wait_for(writer.flush(), 10)
    await writer.stop()
    assert (writer.written, writer.dropped, writer.pending) == (3, 1, 0)
    assert sorted(e.call_id for e in await count_events(conn)) == ["c-0", "c-2", "c-3"]


async def test_a_plain_call_the_columns_cannot_hold_is_written_as_a_row(
    conn: Connection,
) -> None:
    """A count of candidates past the columns' four bytes is kept as a row: written and
    read back as recorded, nothing dropped."""
    await ensure_streams(conn)
    writer = AuditWriter(conn, WriterConfig(flush_interval=0.01))
    await writer.start()
    writer.record_all([event(n, n_candidates=count) for n, count in enumerate([3, 2**40, 3])])
    await writer.stop()
    assert (writer.written, writer.dropped, writer.pending) == (3, 0, 0)
    stored = await count_events(conn)
    assert [(e.call_id, e.n_candidates) for e in stored] == [
        ("c-0", 3), ("c-1", 2**40), ("c-2", 3),
    ]  # fmt: skip


async def test_events_recorded_together_keep_to_batch_max_and_an_unpackable_one_is_counted(
    conn: Connection,
) -> None:
    await ensure_streams(conn)
    writer = AuditWriter(conn, WriterConfig(flush_interval=0.01, batch_max=7))
    await writer.start()
    events = [event(n, "echo" if n % 4 else "report") for n in range(40)]
    events[9] = event(9, description="x\udcff")  # not UTF-8, cannot be packed: the rest is kept
    writer.record_all(events)
    assert writer.dropped == 1
    await asyncio.wait_for(writer.flush(), 10)
    await writer.stop()
    stored = await count_events(conn)
    assert sorted(e.call_id for e in stored) == sorted(f"c-{n}" for n in range(40) if n != 9)
    stream = await conn.stream(subjects.AUDIT_STREAM)
    # no batch over batch_max, whatever the size of the turn that filled it
    assert all(len(decode_batch(m.data)[0]) <= 7 for m in [m async for m in stream.read()])


async def test_a_full_batch_goes_at_once_and_a_young_one_waits_for_company(
    conn: Connection,
) -> None:
    await ensure_streams(conn)
    writer = AuditWriter(conn, WriterConfig(flush_interval=30.0, batch_max=5))
    await writer.start()
    writer.record_all([event(n) for n in range(5)] + [event(n, "report") for n in (5, 6)])
    await until(lambda: writer.written >= 5, "the full batch written")
    assert writer.pending == 2  # the report batch is not due for 30 s: no tiny message
    stream = await conn.stream(subjects.AUDIT_STREAM)
    assert [m.subject async for m in stream.read()] == [subjects.audit("echo", subjects.ANONYMOUS)]
    await writer.stop()  # stopping writes it
    assert writer.written == 7
    assert writer.pending == 0


async def test_batches_stay_under_their_byte_limit(conn: Connection) -> None:
    await ensure_streams(conn)
    writer = AuditWriter(conn, WriterConfig(flush_interval=0.01, batch_max_bytes=2000))
    await writer.start()
    writer.record_all([event(n, description="x" * 100) for n in range(100)])
    await asyncio.wait_for(writer.flush(), 10)
    await writer.stop()
    stream = await conn.stream(subjects.AUDIT_STREAM)
    sizes = [len(m.data) async for m in stream.read()]
    assert len(sizes) > 5
    assert max(sizes) < 2000 + 1000  # the limit plus the last row and the batch's head
    assert len(await count_events(conn)) == 100


async def test_rows_of_any_size_never_make_a_batch_over_its_limit_nor_stall_the_writer(
    conn: Connection,
) -> None:
    await ensure_streams(conn)
    limit = 64 * 1024
    writer = AuditWriter(conn, WriterConfig(flush_interval=0.01, batch_max_bytes=limit))
    await writer.start()
    writer.record_all([event(n, "small") for n in range(10)])  # rows of ~150 bytes seen
    big = [event(n, "big", description="x" * 2000) for n in range(10, 400)]
    big[7] = event(17, "big", description="x\udcff")  # cannot be packed
    big[9] = event(19, "big", description="y" * (2 * limit))  # alone over the limit
    writer.record_all(big)
    writer.record(event(400, "small"))
    assert writer.dropped == 2  # each counted once
    await asyncio.wait_for(writer.flush(), 20)
    await writer.stop()
    stream = await conn.stream(subjects.AUDIT_STREAM)
    sizes = [len(m.data) async for m in stream.read()]
    assert max(sizes) <= limit + 1024  # the rows within the limit, plus the batch's head
    ids = {e.call_id for e in await count_events(conn)}
    assert ids == {f"c-{n}" for n in range(401)} - {"c-17", "c-19"}


async def test_a_batch_carries_its_summary_in_headers_for_headers_only_readers(
    conn: Connection,
) -> None:
    from reach.audit.decode import read_counts, read_header_counts

    await ensure_streams(conn)
    writer = AuditWriter(conn, WriterConfig(flush_interval=0.01))
    await writer.start()
    writer.record_all([event(n) for n in range(5)])
    retried = {"agent_id": "echo-2", "outcome": "timeout"}
    writer.record(event(5, capability="report", attempts=[retried, {"agent_id": "echo-1"}]))
    await asyncio.wait_for(writer.flush(), 10)
    await writer.stop()
    stream = await conn.stream(subjects.AUDIT_STREAM)
    light = {m.subject: m async for m in stream.read(headers_only=True)}
    assert set(light) == {
        subjects.audit("echo", subjects.ANONYMOUS),
        subjects.audit("report", subjects.ANONYMOUS),
    }
    plain, notable = (
        light[subjects.audit("echo", subjects.ANONYMOUS)],
        light[subjects.audit("report", subjects.ANONYMOUS)],
    )
    assert plain.data == notable.data == b""  # the server sent headers alone
    assert read_header_counts(plain.headers) == {"echo": 5}
    assert read_header_counts(notable.headers) is None  # a retried call: read its rows
    full = await stream.get(notable.seq)
    assert [e.call_id for e in decode_batch(full)[0]] == ["c-5"]
    assert read_counts(await stream.get(plain.seq)) == {"echo": 5}


async def test_reading_a_stream_that_does_not_exist_is_a_clear_error(conn: Connection) -> None:
    with pytest.raises(ReachError, match="REACH_AUDIT does not exist"):
        await count_events(conn)


async def test_follow_yields_live_events(conn: Connection) -> None:
    await ensure_streams(conn)
    writer = AuditWriter(conn, WriterConfig(flush_interval=0.01))
    await writer.start()
    writer.record(event(0))
    await writer.flush()
    seen: list[str] = []

    async def tail() -> None:
        async for e in read_events(conn, follow=True):
            seen.append(e.call_id)
            if len(seen) == 3:
                return

    task = asyncio.create_task(tail())
    # the history is read: what is written now comes live
    await until(lambda: seen, "the history read")
    writer.record(event(1))
    writer.record(event(2))
    await asyncio.wait_for(task, 10)
    assert seen == ["c-0", "c-1", "c-2"]
    await writer.stop()


def test_batches_decode_robustly() -> None:
    good = event(1)
    data = encode_batch([good, event(2, capability="echo")])
    events, bad = decode_batch(data)
    assert [e.call_id for e in events] == ["c-1", "c-2"]
    assert bad == 0
    assert events[0].attempts[0].score == 0.9
    assert decode_batch(b"\xc1 not msgpack") == ([], 1)
    assert decode_batch(msgpack.packb([1, 2, 3])) == ([], 1)
    short = msgpack.packb(
        {
            "v": 4,
            "fields": list(EVENT_FIELDS),
            "attempt_fields": [],
            "events": [[1, 2], list(event_row(good))],
        }
    )
    events, bad = decode_batch(short)
    assert [e.call_id for e in events] == ["c-1"]
    assert bad == 1
    wrong_types = list(event_row(good))
    wrong_types[EVENT_FIELDS.index("ts")] = "yesterday"
    packed = msgpack.packb(
        {"v": 4, "fields": list(EVENT_FIELDS), "attempt_fields": [], "events": [wrong_types]}
    )
    assert decode_batch(packed) == ([], 1)


async def test_a_reader_skips_a_batch_of_another_version_and_reads_on(
    conn: Connection, caplog: pytest.LogCaptureFixture
) -> None:
    audit, _ = await ensure_streams(conn)
    other = msgpack.unpackb(encode_batch([event(1, call_id="other-version")]), raw=False)
    other["v"] = 3
    subject = subjects.audit("echo", "tester")
    await audit.publish(subject, msgpack.packb(other, use_bin_type=True), msg_id="v3", timeout=2)
    await audit.publish(subject, encode_batch([event(2, call_id="current")]), msg_id="v", timeout=2)
    with caplog.at_level(logging.WARNING, logger="reach.audit"):
        found = [record.event.call_id async for record in read_records(conn)]
    assert found == ["current"]
    assert "audit batch of version 3; this reader reads version 4" in caplog.text


async def test_the_alert_watcher_skips_a_batch_it_cannot_fetch_and_reads_the_next(
    conn: Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A notable batch whose rows cannot be fetched (gone by retention, no answer) is
    skipped; the watcher goes on with the next batch instead of resubscribing (which
    would miss what is published meanwhile)."""
    from reach.audit.alert_watcher import AlertWatcher
    from reach.errors import ReachTimeout
    from reach.transport import Stream

    await ensure_streams(conn)
    fetch = Stream.get_message
    failed = asyncio.Event()

    async def first_fetch_fails(self: Stream, seq: int) -> tuple[str, bytes]:
        if not failed.is_set():
            failed.set()
            raise ReachTimeout(f"no reply for message {seq} in time")
        return await fetch(self, seq)

    monkeypatch.setattr(Stream, "get_message", first_fetch_fails)
    watcher = AlertWatcher(conn)
    await watcher.start()
    writer = AuditWriter(conn, WriterConfig(flush_interval=0.01))
    await writer.start()
    retried = [{"agent_id": "echo-2", "outcome": "timeout"}, {"agent_id": "echo-1"}]
    try:
        writer.record(event(0, attempts=retried))
        await asyncio.wait_for(failed.wait(), 10)
        writer.record_all([event(n, attempts=retried) for n in range(1, 12)])  # 11 retries
        await until_fired(watcher)
        assert [a.rule for a in watcher.fired] == ["retry_storm"]
    finally:
        await writer.stop()
        await watcher.stop()


async def test_a_flush_does_not_cut_the_back_off_short_while_the_stream_is_away(
    conn: Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No REACH_AUDIT: every write fails. Someone waiting in flush() must not turn the
    writer's doubling back-off into a write attempt every retry_min."""
    from reach.transport import Stream

    publish = Stream.publish
    attempts = 0

    async def counted(self: Stream, *args: Any, **kwargs: Any) -> int:
        nonlocal attempts
        attempts += 1
        return await publish(self, *args, **kwargs)

    monkeypatch.setattr(Stream, "publish", counted)
    config = WriterConfig(flush_interval=0.01, retry_min=0.05, retry_max=1.0)
    writer = AuditWriter(conn, config)
    await writer.start()
    writer.record(event(0))
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(writer.flush(), 1.6)
    # back-off 0.05, 0.1, 0.2, 0.4, 0.8 s: at most 6 attempts in 1.6 s (32 at one per 50 ms)
    assert 2 <= attempts <= 7
    assert writer.pending == 1
    assert writer.dropped == 0
    await writer.stop(timeout=0.1)


# -- the filters see calls that passed an open breaker over ----------------------------


def skipped_call(ts: float, *, skipped: str = "u-1", served: str = "u-2") -> AuditEvent:
    """Served by ``served`` after passing ``skipped`` over: its breaker was open."""
    return AuditEvent(
        ts=ts,
        capability="unav",
        callee=served,
        outcome="ok",
        candidates=[skipped, served],
        n_candidates=2,
        skipped=[skipped],
        attempts=[AuditAttempt(agent_id=served, outcome="ok", latency_ms=1.0)],
    )


def test_the_callee_filter_and_the_breaker_kind_match_a_skipped_instance() -> None:
    call = skipped_call(time.time())
    assert AuditFilter(callee="u-1").matches(call)
    assert AuditFilter(kind="breaker").matches(call)
    assert AuditFilter(callee="u-1", kind="breaker").matches(call)
    assert AuditFilter(callee="u-2").matches(call)  # served it
    assert not AuditFilter(callee="u-3").matches(call)
    assert not AuditFilter(kind="timeout").matches(call)
    assert not AuditFilter(kind="retry").matches(call)
    # a call that skipped nothing is no breaker event
    plain = call.model_copy(update={"skipped": []})
    assert not AuditFilter(kind="breaker").matches(plain)
    assert not AuditFilter(callee="u-1").matches(plain)


def _plain_recorder(writer: AuditWriter) -> CallRecorder:
    recorder = CallRecorder(Telemetry(), SystemClock(), lambda _c, _t, _e: ("echo-1",))
    recorder.caller = "tester"
    recorder.audit = writer
    return recorder


def _serve_plain(recorder: CallRecorder, n: int) -> None:
    """Call ``c-<n>``, answered by echo-1 at its first attempt: recorded by its fields."""
    trail = CallTrail("echo", time.time(), [])
    trail.last_target = "echo-1"
    route = (attempt(agent_id="echo-1", score=0.5, latency_ms=1.0),)
    recorder.served(trail, RequestMeta(f"c-{n}", traceparent=new_traceparent()), 1.0, route)


async def _stored_call_ids(url: str) -> list[str]:
    """Every call id in REACH_AUDIT, read with plain nats-py as a foreign reader would."""
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        info = await js.stream_info(subjects.AUDIT_STREAM)
        ids: list[str] = []
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            msg = await js.get_msg(subjects.AUDIT_STREAM, seq)
            events, bad = decode_batch(msg.data or b"")
            assert bad == 0
            ids += [e.call_id for e in events]
        return ids
    finally:
        await nc.close()


async def test_plain_calls_recorded_by_their_fields_survive_a_nats_restart_once_each(
    nats_server: NatsServer, caplog: pytest.LogCaptureFixture
) -> None:
    """The caller's path with no event built: held while NATS is away, written once it is
    back, none lost and none twice."""
    conn = await connect([nats_server.url], name="writer")
    await ensure_streams(conn)
    writer = AuditWriter(conn, WriterConfig(flush_interval=0.02, retry_max=0.2))
    await writer.start()
    recorder = _plain_recorder(writer)
    try:
        for n in range(100):
            _serve_plain(recorder, n)
        await asyncio.wait_for(writer.flush(), 10)
        await asyncio.to_thread(nats_server.stop_now)
        for n in range(100, 400):
            _serve_plain(recorder, n)
        await until(
            lambda: any(HOLDING in r.getMessage() for r in caplog.records),
            "the writer says it holds them",
        )
        assert writer.pending >= 300
        await asyncio.to_thread(nats_server.start_now)
        await asyncio.wait_for(writer.flush(), 30)
        assert writer.dropped == 0
        ids = await _stored_call_ids(nats_server.url)
        assert sorted(ids) == sorted(f"c-{n}" for n in range(400))
    finally:
        await writer.stop()
        await conn.close()


async def test_plain_calls_past_a_full_buffer_are_dropped_and_counted(conn: Connection) -> None:
    config = WriterConfig(max_buffer=50, flush_interval=0.01, retry_max=0.05, spool="off")
    writer = AuditWriter(conn, config)
    await writer.start()
    recorder = _plain_recorder(writer)
    for n in range(80):
        _serve_plain(recorder, n)
    assert (writer.dropped, writer.pending) == (30, 50)
    await ensure_streams(conn)
    await asyncio.wait_for(writer.flush(), 10)
    assert [e.call_id for e in await count_events(conn)] == [f"c-{n}" for n in range(50)]
    await writer.stop()
