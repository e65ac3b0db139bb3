"""Every call audited whatever the caller's language: a caller that records its calls
says so (``au``), and the callee records the calls of every other caller; readers merge
a call's events by call id."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import msgpack
import nats
import pytest

from reach.agent.agent import Agent
from reach.audit import AuditEvent, read_events
from reach.audit.events import CallEvent, denial_event
from reach.audit.merge import MergedCall, merge_calls
from reach.audit.reader import AuditRecord, read_records
from reach.caller.client import ReachClient
from reach.testing import NatsServer
from reach.transport import Connection

from .audit_helpers import write
from .calls_helpers import capability, make_agent, wait_routable

_STRICT = {"type": "object", "properties": {"q": {"type": "integer"}}, "required": ["q"]}


async def _raw_call(url: str, subject: str, envelope: dict[str, Any]) -> dict[str, Any]:
    """A request as a caller in any language sends it: nats and msgpack only."""
    nc = await nats.connect(url)
    try:
        msg = await nc.request(subject, msgpack.packb(envelope), timeout=5)
    finally:
        await nc.close()
    reply: dict[str, Any] = msgpack.unpackb(msg.data)
    return reply


async def _events_of(conn: Connection, agent: Agent, call_id: str) -> list[AuditEvent]:
    assert agent.audit is not None
    await asyncio.wait_for(agent.audit.flush(), 10)
    return [e async for e in read_events(conn) if e.call_id == call_id]


async def test_a_caller_in_another_language_is_recorded_by_the_callee(
    nats_server: NatsServer, client: ReachClient, conn: Connection
) -> None:
    agent, _ = make_agent(nats_server.url, "work-1", capability("work", input_schema=_STRICT))
    async with agent:
        await wait_routable(client, "work", 1)
        body = msgpack.packb({"q": 7})
        reply = await _raw_call(
            nats_server.url, "reach.v1.cap.work", {"v": 1, "id": "raw-ok", "b": body}
        )
        assert reply["ok"] is True
        assert reply["aud"] is True  # the callee says it recorded the call
        (event,) = await _events_of(conn, agent, "raw-ok")
    assert event.side == "callee"
    assert event.primary
    assert event.outcome == "ok"
    assert event.capability == "work"
    assert event.callee == "work-1"
    assert event.latency_ms >= 0


async def test_a_broken_contract_from_such_a_caller_is_recorded_too(
    nats_server: NatsServer, client: ReachClient, conn: Connection
) -> None:
    agent, behaviour = make_agent(
        nats_server.url, "work-1", capability("work", input_schema=_STRICT)
    )
    async with agent:
        await wait_routable(client, "work", 1)
        body = msgpack.packb({"q": "seven"})
        reply = await _raw_call(
            nats_server.url, "reach.v1.cap.work", {"v": 1, "id": "raw-bad", "b": body}
        )
        assert reply["ok"] is False
        assert reply["err"]["kind"] == "contract"
        assert "aud" not in reply  # only an ok reply says it
        (event,) = await _events_of(conn, agent, "raw-bad")
    assert behaviour.calls == 0
    assert (event.side, event.outcome, event.error) == ("callee", "error", "contract")
    assert event.code == reply["err"]["code"]
    assert event.primary


async def test_a_call_of_a_caller_that_audits_is_recorded_once_by_the_caller(
    nats_server: NatsServer, client: ReachClient, conn: Connection
) -> None:
    agent, _ = make_agent(nats_server.url, "work-1")
    async with agent:
        await wait_routable(client, "work", 1)
        result = await client.call("work", {"q": 1})
        assert client.audit is not None
        await asyncio.wait_for(client.audit.flush(), 10)
        events = await _events_of(conn, agent, result.call_id)
    assert [(e.side, e.primary) for e in events] == [("caller", True)]


async def test_a_client_without_audit_leaves_its_calls_to_the_callee(
    nats_server: NatsServer, registrar: object, conn: Connection
) -> None:
    agent, _ = make_agent(nats_server.url, "work-1")
    async with agent, ReachClient(servers=nats_server.url, audit=False) as quiet:
        await wait_routable(quiet, "work", 1)
        result = await quiet.call("work", {"q": 1})
        events = await _events_of(conn, agent, result.call_id)
    assert [(e.side, e.primary, e.outcome) for e in events] == [("callee", True, "ok")]


async def test_a_request_that_says_au_wrongly_is_refused_naming_the_field(
    nats_server: NatsServer, client: ReachClient
) -> None:
    agent, behaviour = make_agent(nats_server.url, "work-1")
    async with agent:
        await wait_routable(client, "work", 1)
        reply = await _raw_call(
            nats_server.url,
            "reach.v1.cap.work",
            {"v": 1, "id": "raw-au", "b": msgpack.packb({}), "au": "yes"},
        )
    assert reply["ok"] is False
    assert reply["err"]["kind"] == "contract"
    assert "'au'" in reply["err"]["desc"]
    assert behaviour.calls == 0


def _call(call_id: str, side: str = "caller") -> CallEvent:
    if side == "caller":
        return CallEvent(ts=1.0, capability="work", outcome="ok", call_id=call_id, callee="w")
    return denial_event(
        side="callee",
        ts=1.0,
        capability="work",
        callee="w",
        call_id=call_id,
        code="no_token",
        description="work requires a token",
    )


async def _merged(records: AsyncIterator[AuditRecord], count: int) -> list[MergedCall]:
    calls: list[MergedCall] = []
    async for call in merge_calls(records, window_sec=0.3):
        calls.append(call)
        if len(calls) == count:
            break
    return calls


async def test_readers_merge_the_events_of_one_call_by_its_id(
    registrar: object, conn: Connection
) -> None:
    await write(conn, _call("c-1"), _call("c-2"), _call("c-1", side="callee"))
    calls = await asyncio.wait_for(_merged(read_records(conn), 2), 10)
    assert [c.record.event.call_id for c in calls] == ["c-1", "c-2"]
    first, second = calls
    assert first.record.event.side == "caller"  # the primary event leads
    assert [o.event.outcome for o in first.others] == ["denied"]
    assert second.others == ()


async def test_a_live_call_is_shown_once_its_window_passed_while_the_stream_is_idle(
    registrar: object, conn: Connection
) -> None:
    await write(conn, _call("alone"))
    # following: the stream never ends, the call still comes out after its window
    records = read_records(conn, follow=True)
    (call,) = await asyncio.wait_for(_merged(records, 1), 10)
    assert call.record.event.call_id == "alone"


@pytest.mark.parametrize("au", [True, False])
async def test_au_travels_in_the_envelope(au: bool) -> None:
    from reach.wire import envelope

    meta, _ = envelope.unpack_request(
        envelope.pack_request(envelope.RequestMeta("id-1", audit=au), b"")
    )
    assert meta.audit is au
