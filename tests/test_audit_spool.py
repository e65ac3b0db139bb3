"""Audit events held until REACH_AUDIT acks them: through a server restart, across a
writer's restart (the spool), and counted and alerted when they must be dropped.
Against a real nats-server with JetStream."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import pytest

from reach.audit import AuditWriter, WriterConfig, ensure_streams, read_events
from reach.audit.alerts import decode_alert
from reach.audit.batch import RowSummary
from reach.audit.eventmodels import AuditNotice, decode_notice
from reach.audit.spool import MAGIC, SUFFIX, Batch, Spool, survey
from reach.errors import ConfigurationError
from reach.fabric.doctor import conclude, gather
from reach.registry import Registrar, RegistrarConfig
from reach.settings import resolve_audit_spool, resolve_audit_spool_max
from reach.testing import NatsServer
from reach.transport import Connection, Message, connect
from reach.wire import subjects
from tests.audit_helpers import event
from tests.poll_helpers import until


async def stored_ids(conn: Connection) -> Counter[str]:
    """How many times each call id is in REACH_AUDIT."""
    return Counter([e.call_id async for e in read_events(conn)])


def spool_files(root: Path) -> list[Path]:
    return sorted(root.glob(f"*/*/*{SUFFIX}"))


def spool_root() -> Path:
    root = resolve_audit_spool()
    assert root is not None  # (the suite points REACH_AUDIT_SPOOL at a test's own directory)
    return root


FAST = {"flush_interval": 0.02, "retry_min": 0.02, "retry_max": 0.2, "ack_timeout": 0.5}


async def test_events_written_through_a_server_restart_arrive_once_each(
    nats_server: NatsServer,
) -> None:
    """Events recorded before, during and after a nats-server restart (same port and
    store), more than memory holds while it is down: each stored exactly once. While
    the stream acks, the spool is never touched."""
    conn = await connect([nats_server.url], name="writer")
    await ensure_streams(conn)
    config = WriterConfig(max_buffer=100, batch_max=20, **FAST)
    writer = AuditWriter(conn, config, servers=[nats_server.url])
    await writer.start()
    try:
        for n in range(100):
            writer.record(event(n))
        await asyncio.wait_for(writer.flush(), 10)
        assert not spool_root().exists()  # the happy path writes nothing to disk
        await asyncio.to_thread(nats_server.stop_now)
        for n in range(100, 700):  # the calls go on while the server is away
            writer.record(event(n))
            if n % 50 == 0:
                await asyncio.sleep(0.02)
        assert writer.pending >= 600
        assert writer.spool is not None
        assert writer.spool.events > 0
        await asyncio.to_thread(nats_server.start_now)
        for n in range(700, 800):
            writer.record(event(n))
        await asyncio.wait_for(writer.flush(), 30)
        assert (writer.dropped, writer.pending) == (0, 0)
        ids = await stored_ids(conn)
        assert set(ids) == {f"c-{n}" for n in range(800)}
        assert max(ids.values()) == 1
        assert spool_files(spool_root()) == []  # sent and acked: the file is gone
    finally:
        await writer.stop()
        await conn.close()


async def test_a_writer_closed_while_the_server_is_down_leaves_a_spool_the_next_one_sends(
    nats_server: NatsServer,
) -> None:
    conn = await connect([nats_server.url], name="writer")
    await ensure_streams(conn)
    first = AuditWriter(conn, WriterConfig(**FAST), servers=[nats_server.url])
    await first.start()
    for n in range(50):
        first.record(event(n))
    await asyncio.wait_for(first.flush(), 10)
    await asyncio.to_thread(nats_server.stop_now)
    for n in range(50, 350):
        first.record(event(n))
    await first.stop(timeout=0.3)  # cannot flush: the rest goes to the spool
    await conn.close()
    assert first.dropped == 0
    (file,) = spool_files(spool_root())
    assert file.read_bytes().startswith(MAGIC)
    (found,) = survey(spool_root())
    assert (found.events, found.live, found.dropped) == (300, 0, 0)

    await asyncio.to_thread(nats_server.start_now)
    conn = await connect([nats_server.url], name="writer")
    # another order of the same servers: the same fabric, the same spool
    second = AuditWriter(conn, WriterConfig(**FAST), servers=[f" {nats_server.url}"])
    try:
        await second.start()
        assert second.pending == 300
        await asyncio.wait_for(second.flush(), 20)
        ids = await stored_ids(conn)
        assert set(ids) == {f"c-{n}" for n in range(350)}
        assert max(ids.values()) == 1
        assert not file.exists()
        assert survey(spool_root()) == []
    finally:
        await second.stop()
        await conn.close()


async def test_a_spooled_batch_sent_again_is_stored_once(nats_server: NatsServer) -> None:
    """A batch the stream stored but whose ack was lost before shutdown is spooled with
    its message id: sent again by the next writer (within the duplicate window) it is
    not stored twice."""
    conn = await connect([nats_server.url], name="writer")
    await ensure_streams(conn)
    writer = AuditWriter(conn, WriterConfig(**FAST), servers=[nats_server.url])
    await writer.start()
    for n in range(10):
        writer.record(event(n))
    await asyncio.wait_for(writer.flush(), 10)
    await writer.stop()
    stream = await conn.stream(subjects.AUDIT_STREAM)
    (stored,) = [m async for m in stream.read()]
    assert writer.spool is not None
    # the same batch, as a writer that lost its ack would have kept it
    msg_id = stored.headers["Nats-Msg-Id"] if stored.headers else ""
    spool = Spool(writer.spool.directory, "earlier", 1 << 20)
    spool.append(
        Batch("echo", msg_id, stored.data, 10, RowSummary())
    )  # fmt: skip
    spool.close()
    again = AuditWriter(conn, WriterConfig(**FAST), servers=[nats_server.url])
    await again.start()
    assert again.pending == 10
    await asyncio.wait_for(again.flush(), 10)
    await again.stop()
    assert again.written == 10
    ids = await stored_ids(conn)
    assert max(ids.values()) == 1
    assert len(ids) == 10
    await conn.close()


async def test_a_full_spool_drops_counts_alerts_and_doctor_shows_it(
    nats_server: NatsServer,
) -> None:
    """No stream yet, a small memory and a tiny spool: events past both are dropped and
    counted; once the stream is there, the rest is written, the notice carries the count,
    the registrar's alert rules raise ``audit_dropped`` and ``reach doctor`` shows it."""
    conn = await connect([nats_server.url], name="writer")
    config = WriterConfig(max_buffer=40, batch_max=10, spool_max_bytes=4096, **FAST)
    writer = AuditWriter(conn, config, servers=[nats_server.url])
    await writer.start()
    for n in range(400):
        writer.record(event(n))
    assert writer.dropped > 0
    assert writer.spool is not None
    assert 0 < writer.spool.own_bytes <= 4096
    kept = writer.pending
    assert kept + writer.dropped == 400

    reg_conn = await connect([nats_server.url], name="registrar")
    registrar = Registrar(reg_conn, RegistrarConfig(liveness_interval_sec=0.2))
    await registrar.start()  # makes the streams, watches the notices
    try:
        writer.reconnected()  # (as a reconnect would: no back-off)
        await asyncio.wait_for(writer.flush(), 20)
        assert writer.written == kept
        assert sum((await stored_ids(conn)).values()) == kept
        alerts = await conn.stream(subjects.ALERTS_STREAM)
        async with asyncio.timeout(10):
            while True:  # bounded by the timeout: the alert is published in the background
                found = [
                    decode_alert(m.data) async for m in alerts.read(subjects.alert("audit_dropped"))
                ]
                if found:
                    break
                await asyncio.sleep(0.05)
        (alert,) = found
        assert alert is not None
        assert (alert.key, alert.details["dropped"]) == (subjects.ANONYMOUS, writer.dropped)
        assert alert.severity == "critical"
        diagnosis = conclude(await gather(conn, "echo", probe_timeout=0.5))
        fabric = diagnosis.steps[5]
        text = "\n".join(fabric.findings)
        assert f"DROPPED in the last 10 min: {writer.dropped} by anonymous" in text
        assert fabric.verdict in ("warn", "fail")
    finally:
        await writer.stop()
        await registrar.stop()
        await reg_conn.close()
        await conn.close()


async def test_drops_at_shutdown_are_kept_in_the_spool_and_reported_by_the_next_writer(
    nats_server: NatsServer,
) -> None:
    """A writer that dropped events and stops before it could tell the alert rules leaves
    the count in its spool: doctor shows it there, and the next writer reports it in its
    first notice."""
    conn = await connect([nats_server.url], name="writer")
    config = WriterConfig(max_buffer=40, batch_max=10, spool_max_bytes=4096, **FAST)
    writer = AuditWriter(conn, config, servers=[nats_server.url])
    await writer.start()
    for n in range(200):
        writer.record(event(n))
    await writer.stop(timeout=0.2)
    dropped = writer.dropped
    assert dropped > 0
    (found,) = survey(spool_root())
    assert found.dropped == dropped
    findings = (
        conclude(await gather(conn, "echo", probe_timeout=0.5, servers=[nats_server.url]))
        .steps[5]
        .findings
    )
    assert any(f"{dropped} dropped event(s) not yet alerted" in f for f in findings)
    # the spool root is the user's, shared by every fabric: another fabric's doctor
    # does not count this one's spool
    assert survey(spool_root(), ["nats://127.0.0.1:1"]) == []
    elsewhere = await gather(conn, "echo", probe_timeout=0.5, servers=["nats://127.0.0.1:1"])
    assert not any("dropped event(s)" in f for f in conclude(elsewhere).steps[5].findings)

    await ensure_streams(conn)
    reports: list[AuditNotice] = []

    async def alert_rules(msg: Message) -> None:  # what a registrar's alert watcher does
        notice = decode_notice(msg.data)
        if notice.dropped:
            reports.append(notice)
            await conn.respond(msg, b"")

    sub = await conn.subscribe(subjects.audited("*", "*"), alert_rules)
    await conn.flush()
    again = AuditWriter(conn, WriterConfig(**FAST), servers=[nats_server.url])
    await again.start()
    await asyncio.wait_for(again.flush(), 10)
    await until(lambda: reports, "the drops reported", timeout=5)
    await again.stop()
    (report,) = reports
    assert report.dropped == dropped
    assert survey(spool_root()) == []
    await sub.unsubscribe()
    await conn.close()


def test_a_live_writers_spool_is_not_taken_and_a_damaged_record_is_skipped(
    tmp_path: Path,
) -> None:
    def batch(n: int) -> Batch:
        return Batch("echo", f"w.{n}", b"x" * 100, 2, RowSummary())

    live = Spool(tmp_path, "live", 1 << 20)
    assert live.append(batch(1))
    assert live.append(batch(2))
    other = Spool(tmp_path, "other", 1 << 20)
    assert other.adopt() == 0  # locked by a live writer (another process, or this one)
    live.close()
    path = tmp_path / f"live{SUFFIX}"
    data = bytearray(path.read_bytes())
    data[len(MAGIC) + 16 + 5] ^= 0xFF  # a bit flipped in the first record's payload
    path.write_bytes(bytes(data) + bytes(data[len(MAGIC) : len(MAGIC) + 30]))  # a torn tail
    taker = Spool(tmp_path, "taker", 1 << 20)
    assert taker.adopt() == 4  # two whole records; the torn one is not counted
    got = taker.peek()
    assert taker.lost == 2  # the damaged record's events: skipped, counted
    assert got is not None
    assert got.msg_id == "w.2"
    taker.done()
    assert taker.peek() is None
    assert (taker.records, taker.events) == (0, 0)
    assert not path.exists()  # everything in it settled: gone
    taker.close()


def test_the_spools_size_limit_and_its_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spool = Spool(tmp_path, "w", 600)
    assert spool.append(Batch("echo", "w.1", b"x" * 300, 1, RowSummary()))
    assert not spool.append(Batch("echo", "w.2", b"x" * 300, 1, RowSummary()))  # full
    assert spool.append_drops(7)  # a drop count: past the limit too
    assert (spool.events, spool.records) == (1, 2)
    spool.close()
    monkeypatch.setenv("REACH_AUDIT_SPOOL", "off")
    assert resolve_audit_spool() is None
    monkeypatch.setenv("REACH_AUDIT_SPOOL", str(tmp_path / "s"))
    assert resolve_audit_spool() == tmp_path / "s"
    monkeypatch.delenv("REACH_AUDIT_SPOOL")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    assert resolve_audit_spool() == tmp_path / "reach" / "audit-spool"
    monkeypatch.setenv("REACH_AUDIT_SPOOL_MAX_MB", "1.5")
    assert resolve_audit_spool_max() == 3 << 19
    monkeypatch.setenv("REACH_AUDIT_SPOOL_MAX_MB", "lots")
    with pytest.raises(ConfigurationError, match="REACH_AUDIT_SPOOL_MAX_MB"):
        resolve_audit_spool_max()
    with pytest.raises(ConfigurationError, match="size limit"):
        resolve_audit_spool_max(0)
