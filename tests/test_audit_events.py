"""Audit events written by real calls: the right fields for each way a call can end."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from reach.agent.context import current_call
from reach.audit import AuditEvent, read_events
from reach.caller.client import ReachClient
from reach.errors import (
    BusinessError,
    ContractError,
    NotAuthorized,
    ReachTimeout,
    RegistrationRefused,
    Unavailable,
)
from reach.resilience.fallback import Fallback
from reach.testing import NatsServer
from reach.transport import Connection

from .calls_helpers import Behaviour, capability, make_agent, wait_routable
from .conftest import Fabric, vault_agent


async def audit_of(
    conn: Connection, client: ReachClient, call_id: str = "", side: str = "caller"
) -> list[AuditEvent]:
    """The events of one side (or the one with ``call_id``), once the client wrote them."""
    assert client.audit is not None
    await asyncio.wait_for(client.audit.flush(), 10)
    events = [e async for e in read_events(conn) if side in ("", e.side)]
    if call_id:
        events = [e for e in events if e.call_id == call_id]
    return events


async def test_a_successful_call(
    nats_server: NatsServer, client: ReachClient, conn: Connection
) -> None:
    before = time.time()
    agent, _ = make_agent(nats_server.url, "work-1")
    async with agent:
        await wait_routable(client, "work", 1)
        result = await client.call("work", {"q": 1})
    (event,) = await audit_of(conn, client, result.call_id)
    assert event.capability == "work"
    assert event.callee == "work-1"
    assert event.outcome == "ok"
    assert event.error is None
    assert before <= event.ts <= time.time()
    assert event.latency_ms == pytest.approx(result.latency_ms)
    assert event.candidates == ["work-1"]
    assert event.n_candidates == 1
    assert len(event.trace_id) == 32
    assert int(event.trace_id, 16)
    (attempt,) = event.attempts
    assert attempt.agent_id == "work-1"
    assert attempt.outcome == "ok"
    assert event.retries == 0
    assert event.caller == "reach-client"  # an open fabric has no client ids: the name
    assert event.caller_agent is None


async def test_route_decision_carries_the_score_among_several_candidates(
    nats_server: NatsServer, client: ReachClient, conn: Connection
) -> None:
    a, _ = make_agent(nats_server.url, "work-a")
    b, _ = make_agent(nats_server.url, "work-b")
    async with a, b:
        await wait_routable(client, "work", 2)
        result = await client.call("work", {"q": 1})
    (event,) = await audit_of(conn, client, result.call_id)
    assert sorted(event.candidates) == ["work-a", "work-b"]
    assert event.attempts[0].agent_id == result.agent_id
    assert event.attempts[0].score is not None
    assert 0 < event.attempts[0].score <= 1


async def test_contract_errors_on_either_side(
    nats_server: NatsServer, client: ReachClient, conn: Connection
) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    agent, _ = make_agent(
        nats_server.url,
        "strict-1",
        capability("strict", input_schema=schema, output_schema={"type": "string"}),
    )
    async with agent:
        await wait_routable(client, "strict", 1)
        with pytest.raises(ContractError):
            await client.call("strict", {"n": "seven"})  # the caller's own check
        with pytest.raises(ContractError):
            await client.call("strict", {"n": 7})  # the handler's output is not a string
    pre, post = await audit_of(conn, client)
    assert (pre.outcome, pre.error) == ("error", "contract")
    assert "n: " in pre.description
    assert pre.attempts == []  # never sent
    assert (post.outcome, post.error) == ("error", "contract")
    assert post.attempts[0].outcome == "contract"
    assert post.callee == "strict-1"


async def test_a_business_error(
    nats_server: NatsServer, client: ReachClient, conn: Connection
) -> None:
    agent, _ = make_agent(nats_server.url, "biz-1", behaviour=Behaviour(fail="business"))
    async with agent:
        await wait_routable(client, "work", 1)
        with pytest.raises(BusinessError):
            await client.call("work", {})
    (event,) = await audit_of(conn, client)
    assert (event.outcome, event.error, event.code) == ("error", "business", "no_data")
    assert event.description == "no data for that range"
    assert event.callee == "biz-1"


async def test_a_timeout(nats_server: NatsServer, client: ReachClient, conn: Connection) -> None:
    agent, _ = make_agent(
        nats_server.url, "slow-1", capability(sla_ms=100), behaviour=Behaviour(sleep=2)
    )
    async with agent:
        await wait_routable(client, "work", 1)
        with pytest.raises(ReachTimeout):
            await client.call("work", {})
    (event,) = await audit_of(conn, client)
    assert (event.outcome, event.error) == ("error", "timeout")
    assert event.attempts[0].outcome == "timeout"
    assert event.latency_ms >= 140  # 1.5 × the 100 ms SLA


async def test_a_retry_is_visible_as_such(
    nats_server: NatsServer, client: ReachClient, conn: Connection
) -> None:
    async def busy_once(req: Any) -> Any:
        call = current_call()
        assert call is not None
        if call.attempt == 1:
            raise Unavailable("pool full, try again")
        return {"attempt": call.attempt}

    agent, _ = make_agent(nats_server.url, "flaky-1", handler=busy_once)
    async with agent:
        await wait_routable(client, "work", 1)
        result = await client.call("work", {})
    assert result.attempts == 2
    (event,) = await audit_of(conn, client, result.call_id)
    assert event.outcome == "ok"
    assert event.retries == 1
    assert [(a.agent_id, a.outcome) for a in event.attempts] == [
        ("flaky-1", "unavailable"),
        ("flaky-1", "ok"),
    ]
    assert event.callee == "flaky-1"


async def test_a_fallback_is_visible_as_such(
    nats_server: NatsServer, client: ReachClient, conn: Connection
) -> None:
    agent, _ = make_agent(
        nats_server.url, "slow-2", capability(sla_ms=100), behaviour=Behaviour(sleep=2)
    )
    async with agent:
        await wait_routable(client, "work", 1)
        result = await client.call("work", {}, fallback=Fallback(default={"cached": True}))
    assert result.value == {"cached": True}
    (event,) = await audit_of(conn, client)
    assert event.outcome == "fallback"
    assert event.fallback == "default"
    assert event.error == "timeout"
    assert "ReachTimeout" in event.fallback_reason


async def test_auth_denials_are_written_by_the_side_that_denied(fabric: Fabric) -> None:
    b = Behaviour()
    async with (
        vault_agent(fabric, b) as vault,
        ReachClient(servers=fabric.url, credentials=fabric.creds["analyst"]) as analyst,
    ):
        await wait_routable(analyst, "customer_orders", 1)
        with pytest.raises(NotAuthorized):
            await analyst.call("customer_orders", {"user": 7})
        assert vault.audit is not None
        await asyncio.wait_for(vault.audit.flush(), 10)
        events = await audit_of(fabric.conn, analyst, side="")
    (denial,) = [e for e in events if e.side == "callee"]
    assert denial.outcome == "denied"
    assert denial.code == "insufficient_level:3:2"
    assert denial.caller == "analyst"
    assert denial.callee == "vault-1"
    assert "requires clearance level 3" in denial.description
    (seen_by_caller,) = [e for e in events if e.side == "caller"]
    assert (seen_by_caller.caller, seen_by_caller.error) == ("analyst", "denied")
    assert seen_by_caller.call_id == denial.call_id
    assert seen_by_caller.trace_id == denial.trace_id
    assert b.calls == 0


async def test_the_registrar_audits_an_announce_as_another_agent(fabric: Fabric) -> None:
    intruder, _ = make_agent(fabric.url, "vault-1", capability("customer_orders", level=3))
    intruder.credentials = fabric.creds["intruder"]  # bound to intruder-1, not vault-1
    with pytest.raises(RegistrationRefused):
        async with intruder:
            pass
    for _ in range(100):  # the registrar writes in the background
        events = [e async for e in read_events(fabric.conn) if e.side == "registrar"]
        if events:
            break
        await asyncio.sleep(0.05)
    (denial,) = events
    assert denial.capability == "_registry"
    assert denial.code == "wrong_agent"
    assert denial.caller == "intruder"
    assert denial.callee == "vault-1"


async def test_a_nested_call_names_the_agent_that_made_it_and_shares_the_trace(
    nats_server: NatsServer, client: ReachClient, conn: Connection
) -> None:
    async def outer(req: Any) -> Any:
        return (await client.call("inner", req)).value

    a, _ = make_agent(nats_server.url, "outer-1", capability("outer"), handler=outer)
    b, _ = make_agent(nats_server.url, "inner-1", capability("inner"))
    async with a, b:
        await wait_routable(client, "outer", 1)
        await wait_routable(client, "inner", 1)
        result = await client.call("outer", {"x": 1})
    events = await audit_of(conn, client)
    (top,) = [e for e in events if e.call_id == result.call_id]
    (nested,) = [e for e in events if e.capability == "inner"]
    assert top.caller_agent is None
    assert nested.caller_agent == "outer-1"
    assert nested.trace_id == top.trace_id


async def test_a_client_whose_audit_connection_is_refused_leaves_nothing_behind(
    tmp_path: Any,
) -> None:
    """The audit writer has a connection of its own: when the server refuses it (here:
    at most two connections), connecting fails and what had started is stopped: the
    first connection is closed, so a client can connect once the slot is free."""
    from reach.errors import ReachError
    from reach.registry.store import RegistryStore
    from reach.transport import connect

    config = tmp_path / "nats.conf"
    config.write_text("max_connections: 2\n")
    with NatsServer(store_dir=tmp_path / "nats", config_file=config) as server:
        server.start_now()
        setup = await connect([server.url], name="setup")
        await RegistryStore.open(setup)  # the registry a client needs
        client = ReachClient(servers=server.url, name="refused")
        before = asyncio.all_tasks()
        with pytest.raises(ReachError):
            await client.connect()
        assert client.audit is None
        # nothing it started runs on (the route cache's watch, its token session)
        assert asyncio.all_tasks() - before == set()
        await setup.close()
        # had the failed client kept its first connection, this one's audit would not fit
        async with ReachClient(servers=server.url, name="second") as second:
            assert second.audit is not None
            assert client.audit is None
