"""Calls end to end on a real nats-server: contract, typed errors, routing by tag,
admission, timeouts, deadlines, repeated calls and idempotency keys. Retries and breakers
are in tests/test_retries.py, fallbacks in tests/test_fallbacks.py, refused inputs in
tests/test_call_inputs.py."""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

import pytest
from pydantic import BaseModel

from reach.agent.context import current_call
from reach.caller.client import ReachClient
from reach.clock import ManualClock
from reach.errors import (
    BusinessError,
    ContractError,
    InternalError,
    NotFound,
    ReachTimeout,
    RetriesExhausted,
)
from reach.resilience.fallback import Fallback
from reach.testing import NatsServer
from reach.wire import envelope, subjects
from reach.wire.models import Readiness

from .calls_helpers import REPORT_INPUT, Behaviour, capability, make_agent, wait_routable


async def test_a_call_reaches_a_healthy_instance_and_says_who_served_it(
    nats_server: NatsServer, client: ReachClient
) -> None:
    agent, b = make_agent(nats_server.url, "worker-1")
    async with agent:
        await wait_routable(client, "work", 1)
        result = await client.call("work", {"x": 1})
    assert result.value == {"by": "worker-1", "echo": {"x": 1}}
    assert result.agent_id == "worker-1"
    assert result.attempts == 1
    assert not result.from_fallback
    assert b.calls == 1


async def test_a_call_with_tags_goes_only_to_instances_whose_capability_carries_them(
    nats_server: NatsServer, client: ReachClient
) -> None:
    emea, _ = make_agent(nats_server.url, "worker-emea", capability(tags=("work", "emea")))
    amer, _ = make_agent(nats_server.url, "worker-amer", capability(tags=("work", "amer")))
    async with emea, amer:
        await wait_routable(client, "work", 2)
        for _ in range(10):
            assert (await client.call("work", {}, tags=("emea",))).agent_id == "worker-emea"
            assert (await client.call("work", {}, tags=["amer", "work"])).agent_id == "worker-amer"
        # nobody carries the tag: not found, never the queue group of every instance
        with pytest.raises(NotFound, match="apac"):
            await client.call("work", {}, tags=("apac",))
        # ... and a fallback to other tags then applies
        result = await client.call(
            "work", {}, tags=("apac",), fallback=Fallback(backup_tags=("emea",))
        )
        assert result.agent_id == "worker-emea"
        assert result.fallback is not None
        assert result.fallback.source == "backup"


async def test_caller_prevalidation_names_the_field_and_never_sends(
    nats_server: NatsServer, client: ReachClient
) -> None:
    agent, b = make_agent(
        nats_server.url, "report-1", capability("report", input_schema=REPORT_INPUT)
    )
    async with agent:
        await wait_routable(client, "report", 1)
        with pytest.raises(ContractError, match=r'include_charts: expected boolean, got "yes"'):
            await client.call(
                "report", {"industry": "ev", "time_range": "2025Q3", "include_charts": "yes"}
            )
    assert b.calls == 0


async def test_callee_validates_input_even_when_the_caller_does_not(
    nats_server: NatsServer, registrar: object
) -> None:
    agent, b = make_agent(
        nats_server.url, "report-2", capability("report", input_schema=REPORT_INPUT)
    )
    async with agent, ReachClient(servers=nats_server.url, validate=False) as client:
        await wait_routable(client, "report", 1)
        with pytest.raises(ContractError, match="time_range") as err:
            await client.call("report", {"industry": "ev"})
    assert b.calls == 0
    assert "report-2" in str(err.value)
    assert client.breakers.get("report-2").snapshot().failures == 0


async def test_an_infinity_never_passes_a_bound_on_either_side(
    nats_server: NatsServer, registrar: object
) -> None:
    schema = {"type": "object", "properties": {"n": {"minimum": 0}}, "required": ["n"]}
    agent, b = make_agent(nats_server.url, "bound-1", capability("bound", input_schema=schema))
    async with agent, ReachClient(servers=nats_server.url, validate=False) as loose:
        await wait_routable(loose, "bound", 1)
        with pytest.raises(ContractError, match="n"):  # the callee's check
            await loose.call("bound", {"n": -math.inf})
        async with ReachClient(servers=nats_server.url) as careful:
            await wait_routable(careful, "bound", 1)
            with pytest.raises(ContractError, match="n"):  # the caller's pre-check
                await careful.call("bound", {"n": -math.inf})
    assert b.calls == 0


async def test_output_that_breaks_the_output_schema_is_a_contract_error(
    nats_server: NatsServer, client: ReachClient
) -> None:
    async def bad(req: Any) -> Any:
        return {"report_id": 42}

    agent, _ = make_agent(
        nats_server.url,
        "report-3",
        capability(
            "report",
            output_schema={"type": "object", "properties": {"report_id": {"type": "string"}}},
        ),
        handler=bad,
    )
    async with agent:
        await wait_routable(client, "report", 1)
        with pytest.raises(ContractError, match="report_id") as err:
            await client.call("report", {})
    assert not isinstance(err.value, RetriesExhausted)


class Query(BaseModel):
    industry: str
    years: int


class Answer(BaseModel):
    rows: int


async def test_pydantic_models_in_and_out(nats_server: NatsServer, client: ReachClient) -> None:
    from reach.agent.agent import Agent

    agent = Agent(
        {
            "agent_id": "typed-1",
            "agent_name": "typed",
            "version": "1.0.0",
            "capabilities": [{"name": "query", "security_level": 1}],
        },
        servers=nats_server.url,
    )

    @agent.capability("query")
    async def query(q: Query) -> Answer:
        return Answer(rows=q.years * 10)

    # the schema derived from the model travels in the manifest
    assert agent.manifest.capabilities[0].input_schema["required"] == ["industry", "years"]
    async with agent:
        await wait_routable(client, "query", 1)
        assert (await client.call("query", Query(industry="ev", years=3))).value == {"rows": 30}
        with pytest.raises(ContractError, match="years"):
            await client.call("query", {"industry": "ev", "years": "three"})


async def test_business_error_and_crash_are_typed_and_not_retried(
    nats_server: NatsServer, client: ReachClient
) -> None:
    agent, b = make_agent(nats_server.url, "worker-2")
    other, b2 = make_agent(nats_server.url, "worker-3")
    async with agent, other:
        await wait_routable(client, "work", 2)
        b.fail = b2.fail = "business"
        with pytest.raises(BusinessError) as business:
            await client.call("work", {})
        assert business.value.code == "no_data"
        assert business.value.agent_id in {"worker-2", "worker-3"}
        b.fail = b2.fail = "crash"
        with pytest.raises(InternalError, match="boom"):
            await client.call("work", {})
    assert b.calls + b2.calls == 2


async def test_not_ready_instance_answers_unavailable_and_the_call_moves_on(
    nats_server: NatsServer, client: ReachClient
) -> None:
    ready = {"ok": True}

    def readiness() -> Readiness:
        return Readiness(ready=ready["ok"], reason="connection pool 90% used")

    sick, bs = make_agent(nats_server.url, "sick-1", readiness=readiness)
    well, _bw = make_agent(nats_server.url, "well-1")
    async with sick, well:
        await wait_routable(client, "work", 2)
        ready["ok"] = False
        await sick.current_readiness()
        # route to the sick one explicitly first: it refuses, and the retry goes elsewhere
        client.peers.observe("sick-1", 0.01)
        client.peers.observe("well-1", 300)
        result = await client.call("work", {})
        assert result.agent_id == "well-1"
        assert bs.calls == 0
        # the refusal is an answer, not a fault: the retry goes to another instance at
        # once, so a deadline shorter than the retry backoff (200 ms) still holds it
        client.peers.observe("sick-1", 0.01)
        client.peers.observe("well-1", 300)
        quick = await client.call("work", {}, timeout=0.15)
        assert (quick.agent_id, quick.attempts) == ("well-1", 2)
        data = await client.connection.request(
            subjects.capability_instance("work", "sick-1"),
            envelope.pack_request(envelope.RequestMeta(call_id="direct"), b"\x80"),
            2,
        )
        reply = envelope.unpack_reply(data)
        assert reply.kind == "unavailable"
        assert "not ready: connection pool 90% used" in reply.description


async def test_instance_over_its_declared_concurrency_answers_unavailable_at_once(
    nats_server: NatsServer, client: ReachClient
) -> None:
    busy, bb = make_agent(nats_server.url, "busy-1", max_concurrency=1)
    bb.sleep = 0.3
    free, _bf = make_agent(nats_server.url, "free-1")
    async with busy, free:
        await wait_routable(client, "work", 2)
        client.peers.observe("busy-1", 0.01)
        client.peers.observe("free-1", 100)
        results = await asyncio.gather(*(client.call("work", {"i": i}) for i in range(4)))
    assert {r.agent_id for r in results} >= {"free-1"}
    assert bb.calls <= 1


async def test_unknown_capability_is_not_found(client: ReachClient) -> None:
    with pytest.raises(NotFound, match="nothing_here"):
        await client.call("nothing_here", {})


async def test_default_timeout_is_one_and_a_half_times_the_sla(
    nats_server: NatsServer, client: ReachClient
) -> None:
    agent, b = make_agent(nats_server.url, "slow-1", capability(sla_ms=200))
    b.sleep = 2.0
    async with agent:
        await wait_routable(client, "work", 1)
        started = time.monotonic()
        with pytest.raises(ReachTimeout):
            await client.call("work", {})
        elapsed = time.monotonic() - started
    assert 0.3 - 0.02 <= elapsed < 0.3 + 0.25
    assert b.calls == 1  # not idempotent: a timed-out call is not retried
    await asyncio.sleep(0)  # let the callee notice
    assert b.finished == 0


async def test_nested_call_stops_the_innermost_handler_at_the_outer_deadline(
    nats_server: NatsServer, client: ReachClient
) -> None:
    c_agent, bc = make_agent(nats_server.url, "c-1", capability("step_c", sla_ms=5000))
    bc.sleep = 10.0
    seen: dict[str, Any] = {}

    async def step_b(req: Any) -> Any:
        ctx = current_call()
        seen["b_deadline"] = ctx.deadline_ms if ctx else None
        seen["b_left"] = ctx.deadline.remaining() if ctx and ctx.deadline else None
        inner = ReachClient(servers=nats_server.url)
        async with inner:
            await wait_routable(inner, "step_c", 1)
            return (await inner.call("step_c", req)).value

    b_agent, _ = make_agent(
        nats_server.url, "b-1", capability("step_b", sla_ms=5000), handler=step_b
    )
    async with c_agent, b_agent:
        await wait_routable(client, "step_b", 1)
        started = time.time()
        with pytest.raises(ReachTimeout):
            await client.call("step_b", {}, timeout=1.0)
        # C's handler is cancelled when A's deadline passes: no work past A's budget
        async with asyncio.timeout(2):
            await bc.cancelled_event.wait()
    assert bc.finished == 0
    assert seen["b_deadline"] is not None
    assert abs(seen["b_deadline"] / 1000 - (started + 1.0)) < 0.2
    assert 0.8 < seen["b_left"] <= 1.0  # the handler reads its time left


async def test_a_repeated_call_id_gets_the_first_result_and_runs_the_handler_once(
    nats_server: NatsServer, client: ReachClient
) -> None:
    agent, b = make_agent(nats_server.url, "once-1")
    b.sleep = 0.2
    async with agent:
        await wait_routable(client, "work", 1)
        request = envelope.pack_request(
            envelope.RequestMeta(call_id="same-call", deadline_ms=int((time.time() + 5) * 1000)),
            b"\x81\xa1n\x01",
        )
        subject = subjects.capability_instance("work", "once-1")
        first, second = await asyncio.gather(
            client.connection.request(subject, request, 5),
            client.connection.request(subject, request, 5),
        )
        third = await client.connection.request(subject, request, 5)
    assert first == second == third
    assert b.calls == 1


async def test_idempotency_key_dedups_across_calls(
    nats_server: NatsServer, client: ReachClient
) -> None:
    agent, b = make_agent(nats_server.url, "once-2")
    async with agent:
        await wait_routable(client, "work", 1)
        one = await client.call("work", {"n": 1}, idempotency_key="order-77")
        two = await client.call("work", {"n": 1}, idempotency_key="order-77")
    assert one.value == two.value
    assert b.calls == 1


async def test_a_call_measures_its_time_on_the_injected_clock(
    nats_server: NatsServer, registrar: object
) -> None:
    clock = ManualClock(wall=time.time())  # still: every latency it measures is zero
    agent, _ = make_agent(nats_server.url, "timed-1")
    async with agent, ReachClient(servers=nats_server.url, clock=clock, audit=False) as client:
        await wait_routable(client, "work", 1)
        result = await client.call("work", {"n": 1})
    assert result.latency_ms == 0.0
    assert [(agent_id, ms) for agent_id, _score, _outcome, ms in result.route] == [("timed-1", 0.0)]


def test_behaviour_defaults() -> None:
    assert Behaviour().calls == 0


async def test_an_idempotency_key_is_scoped_to_its_capability(
    nats_server: NatsServer, client: ReachClient
) -> None:
    agent, b = make_agent(nats_server.url, "scoped-1", capability("one"), capability("two"))
    async with agent:
        await wait_routable(client, "two", 1)
        first = await client.call("one", {"n": 1}, idempotency_key="k-1")
        second = await client.call("two", {"n": 2}, idempotency_key="k-1")
    assert first.value["echo"] == {"n": 1}
    assert second.value["echo"] == {"n": 2}
    assert b.calls == 2
