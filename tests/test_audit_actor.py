"""Audit events name the gateway that made a call for its caller (``actor``): written
and read back through a real nats-server, a batch that names no actor read as calls
without one, and a gateway's calls for a client logged in through it are recorded with
both names by the gateway and by the callee."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import msgpack
import pytest

from reach.audit import AuditFilter, AuditWriter, WriterConfig, ensure_streams, format_event
from reach.audit.batch import encode_batch
from reach.audit.events import served_event
from reach.audit.provenance import verdict
from reach.audit.reader import AuditRecord, read_records
from reach.caller.client import ReachClient
from reach.errors import NotAuthorized
from reach.security.credentials import ROLE_GATEWAY, CredentialsFile, CredentialStore
from reach.security.membership import acting_for, connect_as
from reach.security.session import TokenSession
from reach.transport import Connection
from reach.wire import subjects

from .audit_helpers import event, flushed
from .calls_helpers import wait_routable
from .up_helpers import Secured, secured_agent


async def _records(conn: Connection, flt: AuditFilter | None = None) -> dict[str, AuditRecord]:
    """Every record in REACH_AUDIT now, by call id."""
    return {r.event.call_id: r async for r in read_records(conn, flt)}


def _record_plain(writer: AuditWriter, call_id: str, caller: str, actor: str | None) -> None:
    """A caller's plain call by its fields, as the recorder hands it to the writer."""
    writer.record_plain(
        capability="echo", ts=time.time(), call_id=call_id, trace_id="", caller=caller,
        caller_agent=None, callee="echo-1", latency_ms=1.0, candidates=("echo-1",),
        n_candidates=1, score=0.5, attempt_latency_ms=0.9, actor=actor,
    )  # fmt: skip


async def test_an_actor_reads_back_from_columns_rows_and_a_callees_columns(
    conn: Connection,
) -> None:
    await ensure_streams(conn)
    writer = AuditWriter(conn, WriterConfig(flush_interval=0.01, spool="off"))
    await writer.start()
    # a caller's plain calls: by their fields (the recorder's path), and as an event
    _record_plain(writer, "plain-gw", "alice", "gw")
    _record_plain(writer, "plain-own", "bob", None)
    writer.record(event(1, call_id="event-gw", caller="carol", actor="gw"))
    # a full row: a failed call
    writer.record(
        event(2, call_id="row-gw", caller="alice", actor="gw", outcome="error", error="timeout",
              attempts=[{"agent_id": "echo-1", "outcome": "timeout"}])
    )  # fmt: skip
    # a callee's plain event, from the claims of the call token it verified
    writer.record(
        served_event(
            ts=time.time(), capability="echo", callee="echo-1", call_id="served-gw",
            caller="alice", caller_agent=None, trace_id="", latency_ms=0.5, actor="gw",
        )
    )  # fmt: skip
    await writer.stop()
    assert writer.written == 5
    records = await _records(conn)
    assert {call_id: r.event.actor for call_id, r in records.items()} == {
        "plain-gw": "gw",
        "plain-own": None,
        "event-gw": "gw",
        "row-gw": "gw",
        "served-gw": "gw",
    }
    assert records["plain-gw"].event.caller == "alice"
    assert records["served-gw"].event.side == "callee"
    line = format_event(records["row-gw"].event)
    assert "alice via gw → echo@echo-1" in line
    assert " via " not in format_event(records["plain-own"].event)
    # `reach audit tail --actor gw`
    assert set(await _records(conn, AuditFilter(actor="gw"))) == {
        "plain-gw", "event-gw", "row-gw", "served-gw",
    }  # fmt: skip
    assert set(await _records(conn, AuditFilter(actor="gw", caller="alice"))) == {
        "plain-gw", "row-gw", "served-gw",
    }  # fmt: skip


def _without_the_actor_field(data: bytes) -> bytes:
    """A batch of events without actors as a writer that knows no actor writes it: rows
    without an ``actor`` field, columns without an ``actor`` column."""
    batch = msgpack.unpackb(data, raw=False)
    at = batch["fields"].index("actor")
    batch["fields"] = [name for name in batch["fields"] if name != "actor"]
    for row in batch["events"]:
        assert row.pop(at) is None
    for part in ("plain", "served"):
        assert "actor" not in batch.get(part, {})  # (none had one: no column)
    packed: bytes = msgpack.packb(batch, use_bin_type=True)
    return packed


async def test_a_batch_that_names_no_actor_reads_as_calls_without_one(
    conn: Connection,
) -> None:
    events = [
        event(1, call_id="plain"),
        event(2, call_id="row", outcome="error", error="timeout",
              attempts=[{"agent_id": "echo-1", "outcome": "timeout"}]),
        served_event(
            ts=time.time(), capability="echo", callee="echo-1", call_id="served",
            caller="tester", caller_agent=None, trace_id="", latency_ms=0.5,
        ),
    ]  # fmt: skip
    batch = _without_the_actor_field(encode_batch(events))
    audit, _ = await ensure_streams(conn)
    await audit.publish(subjects.audit("echo", "tester"), batch, msg_id="no-actor", timeout=2)
    records = await _records(conn)
    assert set(records) == {"plain", "row", "served"}
    for record in records.values():
        assert record.event.actor is None
        assert record.event.caller == "tester"
    # a caller's event its caller wrote is its own
    assert records["plain"].verdict == "verified"
    assert records["row"].event.error == "timeout"


@pytest.mark.parametrize(
    ("caller", "actor", "writer", "expected"),
    [
        ("alice", "gw", "gw", "verified"),  # the gateway records the calls it makes
        ("alice", "gw", "alice", "forged"),  # nobody else writes the gateway's events
        ("alice", "gw", "mallory", "forged"),
        ("alice", None, "alice", "verified"),
        ("alice", None, "gw", "forged"),
    ],
)
def test_a_gateways_event_is_genuine_when_the_gateway_wrote_it(
    caller: str, actor: str | None, writer: str, expected: str
) -> None:
    assert verdict("caller", caller, "echo-1", writer, None, actor) == expected


# -- a gateway calling for a client logged in through it -------------------------------


@contextlib.asynccontextmanager
async def _admin_with_gateways(secured: Secured, tmp_path: Path) -> AsyncIterator[Connection]:
    """An admin's connection, after it made two gateway credentials: ``gw`` (level 2)
    and ``gw-low`` (level 1), written to ``tmp_path``."""
    conn, _ = await connect_as([secured.url], name="test-admin", credentials=secured.admin)
    try:
        store = await CredentialStore.open(conn)
        for client_id, level in (("gw", 2), ("gw-low", 1)):
            record, secret = await store.add(client_id, level, roles=(ROLE_GATEWAY,))
            CredentialsFile(secured.url, record.client_id, secret).write(
                tmp_path / f"{client_id}.creds"
            )
        yield conn
    finally:
        await conn.close()


async def _logged_in(gateway: ReachClient, creds: Path) -> TokenSession:
    """The session of the client with ``creds``, logged in through ``gateway``."""
    own = gateway._security.own
    assert own is not None
    session = TokenSession(gateway.connection, CredentialsFile.read(creds), actor=own)
    await session.start()
    return session


async def test_a_gateways_call_names_the_caller_and_the_gateway_on_both_sides(
    secured: Secured, tmp_path: Path
) -> None:
    agent = secured_agent(secured)
    gw, low = tmp_path / "gw.creds", tmp_path / "gw-low.creds"
    async with _admin_with_gateways(secured, tmp_path) as admin:
        async with (
            agent,
            ReachClient(servers=secured.url, credentials=gw) as gateway,
            # a gateway that does not record its calls: its callee records them
            ReachClient(servers=secured.url, credentials=gw, audit=False) as quiet,
            ReachClient(servers=secured.url, credentials=low) as low_gateway,
        ):
            sessions = []
            for client in (gateway, quiet, low_gateway):
                await wait_routable(client, "echo", 1)
                sessions.append(await _logged_in(client, secured.watcher))
            try:
                with acting_for(sessions[0]):
                    recorded = await gateway.call("echo", {"n": 1})
                with acting_for(sessions[1]):
                    served = await quiet.call("echo", {"n": 2})
                # the caller's clearance through a gateway is the lower of the two: denied
                with acting_for(sessions[2]), pytest.raises(NotAuthorized):
                    await low_gateway.call("echo", {"n": 3})
                # without acting_for the gateway calls for itself
                own = await gateway.call("echo", {"n": 4})
            finally:
                for session in sessions:
                    await session.stop()
            await flushed(gateway)
            await flushed(low_gateway)
            assert agent.audit is not None
            await asyncio.wait_for(agent.audit.flush(), 10)
        records = [r async for r in read_records(admin)]
    by_call: dict[str, list[AuditRecord]] = {}
    for record in records:
        by_call.setdefault(record.event.call_id, []).append(record)

    # the gateway's own record of a call it made for the watcher: a plain call's columns
    (mine,) = by_call[recorded.call_id]
    assert (mine.event.side, mine.event.caller, mine.event.actor) == ("caller", "watcher", "gw")
    assert (mine.writer, mine.verdict) == ("gw", "verified")
    # the callee's record of a call whose caller does not record it: the token's claims
    (theirs,) = by_call[served.call_id]
    assert (theirs.event.side, theirs.event.caller, theirs.event.actor) == (
        "callee", "watcher", "gw"
    )  # fmt: skip
    assert theirs.event.callee == "a-1"
    # a denied call: the gateway's row and the callee's denial both name the two
    denied = [r for r in records if r.event.outcome == "denied" or r.event.error == "denied"]
    assert {(r.event.side, r.event.caller, r.event.actor) for r in denied} == {
        ("caller", "watcher", "gw-low"),
        ("callee", "watcher", "gw-low"),
    }
    assert len({r.event.call_id for r in denied}) == 1
    (gateways,) = [r for r in denied if r.event.side == "caller"]
    assert (gateways.writer, gateways.verdict) == ("gw-low", "verified")
    (refusal,) = [r for r in denied if r.event.side == "callee"]
    assert refusal.event.code == "insufficient_level:2:1"
    # the gateway calling for itself: no actor
    (itself,) = by_call[own.call_id]
    assert (itself.event.caller, itself.event.actor, itself.verdict) == ("gw", None, "verified")
