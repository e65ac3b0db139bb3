"""Calls end to end on a real nats-server: contract, typed errors, routing, timeouts,
deadlines, retries, breakers, fallbacks."""

from __future__ import annotations

import asyncio
import math
import time
from contextlib import AsyncExitStack
from typing import Any

import pytest
from pydantic import BaseModel

from reach import envelope, subjects
from reach.audit import AuditFilter, read_events
from reach.client import ReachClient
from reach.clock import ManualClock
from reach.context import current_call
from reach.errors import (
    BusinessError,
    CircuitOpen,
    ContractError,
    InternalError,
    NotFound,
    ReachTimeout,
    RetriesExhausted,
    Unavailable,
)
from reach.fallback import Fallback
from reach.models import Readiness
from reach.resilience import BreakerBoard, BreakerConfig, RetryBudget
from reach.testing import NatsServer
from reach.transport import Connection

from .calls_helpers import Behaviour, capability, make_agent, wait_routable

REPORT_INPUT = {
    "type": "object",
    "properties": {
        "industry": {"type": "string"},
        "time_range": {"type": "string"},
        "include_charts": {"type": "boolean"},
    },
    "required": ["industry", "time_range"],
}


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
    from reach.agent import Agent

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


async def test_slow_instance_times_out_and_an_idempotent_call_moves_to_another(
    nats_server: NatsServer, client: ReachClient
) -> None:
    slow, bs = make_agent(nats_server.url, "slow-2", capability(sla_ms=300, idempotent=True))
    fast, _bf = make_agent(nats_server.url, "fast-2", capability(sla_ms=300, idempotent=True))
    bs.sleep = 5.0
    async with slow, fast:
        await wait_routable(client, "work", 2)
        client.peers.observe("slow-2", 1)
        client.peers.observe("fast-2", 250)
        result = await client.call("work", {}, timeout=1.5)
    assert result.agent_id == "fast-2"
    assert result.attempts == 2
    assert bs.calls == 1


async def test_nested_call_stops_the_innermost_handler_at_the_outer_deadline(
    nats_server: NatsServer, client: ReachClient
) -> None:
    c_agent, bc = make_agent(nats_server.url, "c-1", capability("step_c", sla_ms=5000))
    bc.sleep = 10.0
    seen: dict[str, Any] = {}

    async def step_b(req: Any) -> Any:
        ctx = current_call()
        seen["b_deadline"] = ctx.deadline_ms if ctx else None
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


async def test_retries_back_off_200ms_doubling_and_stop_after_three(
    nats_server: NatsServer, client: ReachClient
) -> None:
    agent, b = make_agent(nats_server.url, "down-1", readiness=lambda: False)
    async with agent:
        await client.routes.wait_for(lambda c: c.get("down-1") is not None, timeout=5)
        client.retry_budget = RetryBudget(min_retries=100)
        started = time.monotonic()
        with pytest.raises((RetriesExhausted, Unavailable)) as err:
            await client.call("work", {}, timeout=5.0)
        elapsed = time.monotonic() - started
    if isinstance(err.value, RetriesExhausted):
        assert err.value.attempts == 4
        assert isinstance(err.value.__cause__, Unavailable)
        # 0.2 + 0.4 + 0.8 plus jitter of at most 3 × 0.1
        assert 1.4 <= elapsed <= 1.4 + 0.3 + 0.5
    else:  # the registrar already marked it degraded → routed but unavailable
        pytest.fail(f"expected RetriesExhausted, got {err.value!r}")
    assert b.calls == 0


async def test_retry_budget_stops_a_retry_storm(nats_server: NatsServer, registrar: object) -> None:
    agent, _ = make_agent(nats_server.url, "down-2", readiness=lambda: False)
    budget = RetryBudget(ratio=0.1, min_retries=2, min_per_sec=0)
    async with agent, ReachClient(servers=nats_server.url, retry_budget=budget) as client:
        await client.routes.wait_for(lambda c: c.get("down-2") is not None, timeout=5)
        outcomes = []
        for _ in range(5):
            try:
                await client.call("work", {}, timeout=0.1)
            except (RetriesExhausted, Unavailable) as exc:
                outcomes.append(exc)
    assert budget.retries <= 2
    assert sum(isinstance(o, Unavailable) for o in outcomes) >= 3


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


async def test_breaker_opens_at_threshold_then_half_open_trial_closes_it(
    nats_server: NatsServer, client: ReachClient
) -> None:
    clock = ManualClock()
    client.breakers = BreakerBoard(BreakerConfig(min_calls=20, consecutive_failures=20), clock)
    client.retry_budget = RetryBudget(min_retries=0, ratio=0.0, min_per_sec=0)
    ready = {"ok": False}
    agent, _b = make_agent(nats_server.url, "flaky-1", readiness=lambda: ready["ok"])
    async with agent:
        await client.routes.wait_for(lambda c: c.get("flaky-1") is not None, timeout=5)
        for _ in range(20):
            with pytest.raises(Unavailable):
                await client.call("work", {})
        assert client.breakers.get("flaky-1").state == "open"
        with pytest.raises(CircuitOpen) as opened:
            await client.call("work", {})
        assert opened.value.retry_in > 0
        ready["ok"] = True
        await agent.current_readiness()
        clock.advance(opened.value.retry_in + 0.01)
        assert (await client.call("work", {})).agent_id == "flaky-1"
        assert (await client.call("work", {})).agent_id == "flaky-1"
        assert client.breakers.get("flaky-1").state == "closed"


async def test_contract_and_business_errors_never_open_a_breaker(
    nats_server: NatsServer, client: ReachClient
) -> None:
    agent, b = make_agent(
        nats_server.url, "strict-1", capability("report", input_schema=REPORT_INPUT)
    )
    b.fail = "business"
    client.validate = False
    async with agent:
        await wait_routable(client, "report", 1)
        for _ in range(25):
            with pytest.raises(ContractError):
                await client.call("report", {"industry": 1})
            with pytest.raises(BusinessError):
                await client.call("report", {"industry": "a", "time_range": "b"})
    assert client.breakers.get("strict-1").state == "closed"


async def test_fallbacks_cached_result_backup_capability_and_default_body(
    nats_server: NatsServer, client: ReachClient
) -> None:
    primary, bp = make_agent(nats_server.url, "primary-1", capability("summary", sla_ms=300))
    backup, _ = make_agent(nats_server.url, "backup-1", capability("summary_lite", sla_ms=300))
    cache = Fallback(cache_max_age_sec=60)
    async with AsyncExitStack() as stack:
        await stack.enter_async_context(primary)
        await stack.enter_async_context(backup)
        await wait_routable(client, "summary", 1)
        fresh = await client.call("summary", {"q": 1}, fallback=cache)
        assert not fresh.from_fallback
        bp.sleep = 5.0
        cached = await client.call("summary", {"q": 1}, fallback=cache)
        assert cached.from_fallback
        assert cached.fallback is not None
        assert cached.fallback.source == "cache"
        assert "ReachTimeout" in cached.fallback.reason
        assert cached.value == fresh.value
        backed = await client.call(
            "summary", {"q": 2}, fallback=Fallback(backup_capability="summary_lite")
        )
        assert backed.fallback is not None
        assert backed.fallback.source == "backup"
        assert backed.agent_id == "backup-1"
        default = await client.call(
            "summary", {"q": 3}, fallback=Fallback(default={"summary": None, "stale": True})
        )
        assert default.value == {"summary": None, "stale": True}
        assert default.fallback is not None
        assert default.fallback.source == "default"


async def test_a_call_no_fallback_could_answer_fails_and_is_audited(
    nats_server: NatsServer, client: ReachClient, conn: Connection
) -> None:
    """A cache with nothing in it yet, or a backup that fails too: the call fails with
    its own error, and its audit event says so."""
    with pytest.raises(NotFound):
        await client.call("nobody_serves", {"q": 1}, fallback=Fallback(cache_max_age_sec=60))
    with pytest.raises(NotFound):
        await client.call("nobody_serves", {"q": 2}, fallback=Fallback(backup_capability="none"))
    assert client.audit is not None
    await asyncio.wait_for(client.audit.flush(), 10)
    events = [e async for e in read_events(conn, AuditFilter(capability="nobody_serves"))]
    assert [(e.outcome, e.error, e.fallback) for e in events] == [("error", "discovery", None)] * 2


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


async def test_fallback_never_hides_a_contract_error(
    nats_server: NatsServer, client: ReachClient
) -> None:
    agent, _ = make_agent(
        nats_server.url, "strict-2", capability("report", input_schema=REPORT_INPUT)
    )
    async with agent:
        await wait_routable(client, "report", 1)
        with pytest.raises(ContractError):
            await client.call("report", {}, fallback=Fallback(default={}))


async def test_retries_prefer_an_instance_that_has_not_failed_this_call(
    nats_server: NatsServer, client: ReachClient
) -> None:
    flags = {"a": False}
    a, ba = make_agent(nats_server.url, "pick-a", readiness=lambda: flags["a"])
    bagent, bb = make_agent(nats_server.url, "pick-b")
    async with a, bagent:
        await client.routes.wait_for(lambda c: len(c.find("work")) == 2, timeout=5)
        client.peers.observe("pick-a", 0.001)
        client.peers.observe("pick-b", 390)
        result = await client.call("work", {})
    assert result.agent_id == "pick-b"
    assert result.attempts == 2
    assert ba.calls == 0
    assert bb.calls == 1


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
