"""Retries and breakers on real calls: what is retried, where and how often, what the
retry budget pays, what an instance's breaker learns, how an answer met on a retry or in a
nested call reaches the caller, and how calls end when their instance stops, their
connection is lost or their client closes."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from reach.agent.context import current_call
from reach.caller.client import ReachClient
from reach.clock import ManualClock
from reach.errors import (
    BusinessError,
    CircuitOpen,
    ContractError,
    Disconnected,
    InternalError,
    RetriesExhausted,
    Unavailable,
)
from reach.registry import Registrar
from reach.resilience import BreakerConfig, RetryBudget
from reach.resilience.fallback import Fallback
from reach.testing import NatsServer

from .calls_helpers import (
    REPORT_INPUT,
    Behaviour,
    capability,
    hold_until_released,
    make_agent,
    wait_routable,
)
from .conftest import Fabric, vault_agent
from .poll_helpers import until

#: a bound on waits for the fabric to settle (a restart, a record leaving the registry)
SETTLE = 10.0


#: the nested calls' contract: C takes an integer n
N_SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


def _backoff_clock() -> ManualClock:
    """The clock of a client whose backoff must not wait: each sleep moves it at once. Its
    wall clock starts at the real one, since callees read the deadlines it sends."""
    return ManualClock(wall=time.time())


def _prefer(client: ReachClient, first: str, second: str) -> None:
    """Make ``client`` route to ``first`` before ``second`` (far better measured latency)."""
    client.peers.observe(first, 1)
    client.peers.observe(second, 990)


# -- retries ---------------------------------------------------------------------------


async def test_slow_instance_times_out_and_an_idempotent_call_moves_to_another(
    nats_server: NatsServer, registrar: Registrar
) -> None:
    slow, bs = make_agent(nats_server.url, "slow-2", capability(sla_ms=300, idempotent=True))
    fast, _bf = make_agent(nats_server.url, "fast-2", capability(sla_ms=300, idempotent=True))
    bs.sleep = 5.0
    clock = _backoff_clock()
    async with slow, fast, ReachClient(servers=nats_server.url, clock=clock) as client:
        await wait_routable(client, "work", 2)
        client.peers.observe("slow-2", 1)
        client.peers.observe("fast-2", 250)
        result = await client.call("work", {}, timeout=1.5)
    assert result.agent_id == "fast-2"
    assert result.attempts == 2
    assert bs.calls == 1
    (backoff,) = clock.slept  # a timeout is retried after the first backoff
    assert 0.2 <= backoff <= 0.3


async def test_retries_back_off_200ms_doubling_and_stop_after_three(
    nats_server: NatsServer, registrar: Registrar
) -> None:
    agent, b = make_agent(nats_server.url, "down-1", readiness=lambda: False)
    clock = _backoff_clock()
    budget = RetryBudget(min_retries=100)
    async with (
        agent,
        ReachClient(servers=nats_server.url, clock=clock, retry_budget=budget) as client,
    ):
        await client.routes.wait_for(lambda c: c.get("down-1") is not None, timeout=5)
        started = clock.monotonic()
        really_started = time.monotonic()
        with pytest.raises((RetriesExhausted, Unavailable)) as err:
            await client.call("work", {}, timeout=5.0)
        elapsed = clock.monotonic() - started
        really_elapsed = time.monotonic() - really_started
    if isinstance(err.value, RetriesExhausted):
        assert err.value.attempts == 4
        assert isinstance(err.value.__cause__, Unavailable)
        # 0.2 + 0.4 + 0.8 plus jitter of at most 3 × 0.1, slept on the client's clock
        assert 1.4 <= elapsed <= 1.4 + 0.3
        assert len(clock.slept) == 3
        for slept, base in zip(clock.slept, (0.2, 0.4, 0.8), strict=True):
            assert base <= slept <= base + 0.1
        assert really_elapsed < 1.4  # no real waiting
    else:  # the registrar already marked it degraded → routed but unavailable
        pytest.fail(f"expected RetriesExhausted, got {err.value!r}")
    assert b.calls == 0


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


async def test_the_retry_budget_is_charged_only_for_retries_made(
    nats_server: NatsServer, registrar: Registrar
) -> None:
    async def busy(req: Any) -> Any:
        raise Unavailable("pool exhausted")

    agent, _ = make_agent(nats_server.url, "a-1", handler=busy)
    # breakers out of the way: every attempt reaches the instance
    patient = BreakerConfig(min_calls=1000, consecutive_failures=1000)
    clock = _backoff_clock()
    async with (
        agent,
        ReachClient(
            servers=nats_server.url,
            max_retries=0,
            breaker=patient,
            retry_budget=RetryBudget(min_retries=100),
        ) as never,
        ReachClient(
            servers=nats_server.url,
            breaker=patient,
            retry_budget=RetryBudget(min_retries=100),
            clock=clock,
        ) as thrice,
    ):
        await wait_routable(never, "work", 1)
        await wait_routable(thrice, "work", 1)
        for _ in range(5):
            with pytest.raises(Unavailable):
                await never.call("work", {}, timeout=5)
        assert never.retry_budget.retries == 0
        assert never.retry_budget.calls == 5

        with pytest.raises(RetriesExhausted) as exhausted:
            await thrice.call("work", {}, timeout=5)
        assert exhausted.value.attempts == 4
        assert thrice.retry_budget.retries == 3
        assert len(clock.slept) == 3  # a backoff before each retry


# -- an answer met on a retry is the call's answer -------------------------------------


def _unavailable_then(error: Exception, ran: list[int]) -> Any:
    """A handler busy on the first attempt that answers ``error`` on the next one."""

    async def handler(req: Any) -> Any:
        call = current_call()
        assert call is not None
        ran.append(call.attempt)
        if call.attempt == 1:
            raise Unavailable("pool exhausted")
        raise error

    return handler


async def test_a_business_error_met_on_a_retry_is_raised_as_it_is_and_never_falls_back(
    nats_server: NatsServer, registrar: Registrar
) -> None:
    ran: list[int] = []
    handler = _unavailable_then(BusinessError("no data for 1999", code="no_data"), ran)
    agent, _ = make_agent(nats_server.url, "a-1", handler=handler)
    clock = _backoff_clock()
    async with agent, ReachClient(servers=nats_server.url, clock=clock) as client:
        await wait_routable(client, "work", 1)
        with pytest.raises(BusinessError) as plain:
            await client.call("work", {}, timeout=5)
        # "fallbacks cover reachability failures only": a default must not hide it
        with pytest.raises(BusinessError) as covered:
            await client.call("work", {}, timeout=5, fallback=Fallback(default={"fb": True}))
    for refused in (plain.value, covered.value):
        assert refused.code == "no_data"
        assert refused.agent_id == "a-1"
    assert ran == [1, 2, 1, 2]  # answered on the retry, not retried again
    assert len(clock.slept) == 2  # one backoff per call


async def test_a_contract_error_met_on_a_retry_is_raised_as_it_is(
    nats_server: NatsServer, registrar: Registrar
) -> None:
    ran: list[int] = []
    handler = _unavailable_then(ContractError("n: must be positive", path="n", rule="min"), ran)
    agent, _ = make_agent(nats_server.url, "a-1", handler=handler)
    async with agent, ReachClient(servers=nats_server.url, clock=_backoff_clock()) as client:
        await wait_routable(client, "work", 1)
        with pytest.raises(ContractError) as refused:
            await client.call("work", {}, timeout=5, fallback=Fallback(default={"fb": True}))
    assert "n: must be positive (at a-1)" in str(refused.value)
    assert ran == [1, 2]


# -- errors of a nested call A -> B -> C -----------------------------------------------


async def test_errors_of_a_nested_call_reach_the_caller_as_the_handlers_own(
    nats_server: NatsServer, registrar: Registrar
) -> None:
    """What B's call to C raised and B did not handle is B's failure ("dependency_failed",
    naming C), not A's: A's payload was fine (a contract error is B's bug) and A must not
    retry B for C's "unavailable" (retries would multiply per hop). A business refusal
    passes through; an Unavailable B raises itself is still retried."""
    counts = {"b": 0, "c": 0}

    async def c_handler(req: Any) -> Any:
        counts["c"] += 1
        if req["n"] == -1:
            raise Unavailable("c's pool exhausted")
        if req["n"] == -2:
            raise BusinessError("no such account", code="no_account")
        return {"c": req["n"]}

    # B's own client: one retry, so that C being down ends quickly in RetriesExhausted
    inner = ReachClient(
        servers=nats_server.url,
        max_retries=1,
        retry_budget=RetryBudget(min_retries=100),
        clock=_backoff_clock(),
    )

    async def b_handler(req: Any) -> Any:
        counts["b"] += 1
        mode = req["mode"]
        if mode == "busy_once":
            call = current_call()
            assert call is not None
            if call.attempt == 1:
                raise Unavailable("b's own pool exhausted")  # B's own: A retries it
            return {"b": "ok"}
        n = {"bug": "not-a-number", "down": -1, "refused": -2}[mode]
        return (await inner.call("step_c", {"n": n})).value

    c, _ = make_agent(
        nats_server.url,
        "c-1",
        capability("step_c", input_schema=N_SCHEMA, sla_ms=5000),
        handler=c_handler,
    )
    b, _ = make_agent(nats_server.url, "b-1", capability("step_b", sla_ms=5000), handler=b_handler)
    async with (
        c,
        b,
        inner,
        ReachClient(
            servers=nats_server.url,
            retry_budget=RetryBudget(min_retries=100),
            clock=_backoff_clock(),
        ) as client,
    ):
        await wait_routable(client, "step_b", 1)
        await wait_routable(inner, "step_c", 1)

        # B sends C a payload that breaks C's contract (refused by B's client, unsent)
        with pytest.raises(InternalError) as bug:
            await client.call("step_b", {"mode": "bug"}, timeout=10)
        assert (counts["b"], counts["c"]) == (1, 0)

        # C is down: B's call ends RetriesExhausted after two attempts; A does not retry B
        counts.update(b=0, c=0)
        with pytest.raises(InternalError) as down:
            await client.call("step_b", {"mode": "down"}, timeout=10)
        assert (counts["b"], counts["c"]) == (1, 2)

        # a business refusal of C is what A hears
        counts.update(b=0, c=0)
        with pytest.raises(BusinessError) as refused:
            await client.call("step_b", {"mode": "refused"}, timeout=10)
        assert (counts["b"], counts["c"]) == (1, 1)

        # none of it counted against B's health at A
        assert client.breakers.get("b-1").snapshot().failures == 0

        # B's own Unavailable: retried, and the retry succeeds
        counts.update(b=0, c=0)
        result = await client.call("step_b", {"mode": "busy_once"}, timeout=10)
        assert result.value == {"b": "ok"}
        assert result.attempts == 2
        assert counts["b"] == 2

    for failed, cause in ((bug.value, "ContractError"), (down.value, "RetriesExhausted")):
        assert failed.code == "dependency_failed"
        assert failed.agent_id == "b-1"
        assert "step_b: its call to step_c failed" in failed.description
        assert cause in failed.description
    assert refused.value.code == "no_account"
    assert refused.value.description == "no such account"


async def test_a_refusal_of_a_nested_call_is_not_the_callers_authentication_failure(
    fabric: Fabric,
) -> None:
    """B calls the vault with credentials of too low a clearance: A, whose credentials and
    clearance are fine, hears that B's call failed (naming NotAuthorized), not an
    AuthenticationFailed about its own credentials."""
    inner = ReachClient(servers=fabric.url, credentials=fabric.creds["analyst"])  # level 2 < 3
    ran: list[Any] = []

    async def relay(req: Any) -> Any:
        ran.append(req)
        return (await inner.call("customer_orders", req)).value

    b, _ = make_agent(fabric.url, "intruder-1", capability("step_b", level=1), handler=relay)
    b.credentials = fabric.creds["intruder"]
    vault = Behaviour()
    async with (
        vault_agent(fabric, vault),
        b,
        inner,
        ReachClient(servers=fabric.url, credentials=fabric.creds["auditor"]) as client,
    ):
        await wait_routable(client, "step_b", 1)
        await wait_routable(inner, "customer_orders", 1)
        with pytest.raises(InternalError) as failed:
            await client.call("step_b", {"user": 7}, timeout=10)
    assert failed.value.code == "dependency_failed"
    assert "its call to customer_orders failed: NotAuthorized" in failed.value.description
    assert len(ran) == 1  # not retried
    assert vault.calls == 0  # refused before the vault's handler


# -- breakers --------------------------------------------------------------------------


async def test_breaker_opens_at_threshold_then_half_open_trial_closes_it(
    nats_server: NatsServer, registrar: Registrar
) -> None:
    clock = ManualClock(wall=time.time())
    ready = {"ok": False}
    agent, _b = make_agent(nats_server.url, "flaky-1", readiness=lambda: ready["ok"])
    async with (
        agent,
        ReachClient(
            servers=nats_server.url,
            clock=clock,
            breaker=BreakerConfig(min_calls=20, consecutive_failures=20),
            retry_budget=RetryBudget(min_retries=0, ratio=0.0, min_per_sec=0),
        ) as client,
    ):
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


async def test_with_every_breaker_open_a_call_waits_for_the_trial_its_deadline_reaches(
    nats_server: NatsServer, registrar: Registrar
) -> None:
    """A call that finds every breaker open waits for the earliest half-open trial when
    its deadline reaches it (and is served once the instance is back); one whose deadline
    does not, or one with a fallback, is answered at once."""
    clock = ManualClock(wall=time.time())
    ready = {"ok": False}
    agent, _b = make_agent(nats_server.url, "flaky-1", readiness=lambda: ready["ok"])
    async with (
        agent,
        ReachClient(
            servers=nats_server.url,
            clock=clock,
            breaker=BreakerConfig(min_calls=20, consecutive_failures=20),
            retry_budget=RetryBudget(min_retries=0, ratio=0.0, min_per_sec=0),
        ) as client,
    ):
        await client.routes.wait_for(lambda c: c.get("flaky-1") is not None, timeout=5)
        for _ in range(20):
            with pytest.raises(Unavailable):
                await client.call("work", {})
        breaker = client.breakers.get("flaky-1")
        assert breaker.state == "open"
        retry_in = breaker.open_error().retry_in
        assert retry_in > 0
        slept = len(clock.slept)
        # a deadline short of the trial: the breaker's error at once, no wait
        with pytest.raises(CircuitOpen):
            await client.call("work", {}, timeout=retry_in / 2)
        # a fallback answers at once
        fallen = await client.call(
            "work", {}, timeout=retry_in * 4, fallback=Fallback(default={"stale": True})
        )
        assert fallen.value == {"stale": True}
        assert clock.slept[slept:] == []
        # the instance is back: a call whose deadline reaches the trial waits for it
        ready["ok"] = True
        await agent.current_readiness()
        served = await client.call("work", {}, timeout=retry_in * 4)
        assert served.agent_id == "flaky-1"
        assert clock.slept[slept:] == [pytest.approx(retry_in)]
        assert client.breakers.get("flaky-1").state != "open"


async def test_a_call_that_finds_the_trial_taken_waits_for_its_outcome(
    nats_server: NatsServer, registrar: Registrar
) -> None:
    """Every candidate half-open and its one trial slot taken by a call in flight: the
    next call does not fail with the slot's far-off timeout for an answer, it looks again
    until the trial closes the breaker, and is served."""
    agent, b = make_agent(nats_server.url, "trial-1")
    config = BreakerConfig(consecutive_failures=1, half_open_max_calls=1, half_open_successes=1)
    async with agent, ReachClient(servers=nats_server.url, breaker=config) as client:
        await wait_routable(client, "work", 1)
        breaker = client.breakers.get("trial-1")
        breaker.record_failure()  # a target that stopped answering, say
        assert breaker.state == "open"
        b.sleep = 0.5  # the trial call holds the slot this long
        trial = asyncio.create_task(client.call("work", {}, timeout=5))
        await until(lambda: breaker.snapshot().trials == 1, timeout=5, what="the trial sent")
        waiting = await client.call("work", {}, timeout=5)
        assert waiting.agent_id == "trial-1"
        assert (await trial).agent_id == "trial-1"
        assert breaker.state == "closed"


async def test_contract_and_business_errors_never_open_a_breaker(
    nats_server: NatsServer, registrar: Registrar
) -> None:
    agent, b = make_agent(
        nats_server.url, "strict-1", capability("report", input_schema=REPORT_INPUT)
    )
    b.fail = "business"
    # no check before sending: the agent's contract refuses the payload
    async with agent, ReachClient(servers=nats_server.url, validate=False) as client:
        await wait_routable(client, "report", 1)
        for _ in range(25):
            with pytest.raises(ContractError):
                await client.call("report", {"industry": 1})
            with pytest.raises(BusinessError):
                await client.call("report", {"industry": "a", "time_range": "b"})
        assert client.breakers.get("strict-1").state == "closed"


async def test_a_cancelled_half_open_trial_gives_its_slot_back(
    nats_server: NatsServer, registrar: Registrar
) -> None:
    mode = {"now": "busy"}
    entered = asyncio.Event()
    release = asyncio.Event()

    async def handler(req: Any) -> Any:
        if mode["now"] == "busy":
            raise Unavailable("pool exhausted")
        if mode["now"] == "slow":
            entered.set()
            await release.wait()
        return {"ok": True}

    agent, _ = make_agent(nats_server.url, "a-1", handler=handler)
    config = BreakerConfig(min_calls=2, open_base_sec=0.2, half_open_max_calls=3)
    async with agent, ReachClient(servers=nats_server.url, breaker=config, max_retries=0) as client:
        try:
            await wait_routable(client, "work", 1)
            breaker = client.breakers.get("a-1")
            for _ in range(2):
                with pytest.raises(Unavailable):
                    await client.call("work", {})
            assert breaker.state == "open"
            await until(
                lambda: breaker.state == "half_open", "the breaker half-opened", timeout=SETTLE
            )

            mode["now"] = "slow"
            # as many trials as there are slots, each given up by its caller
            for _ in range(config.half_open_max_calls):
                entered.clear()
                trial = asyncio.create_task(
                    asyncio.wait_for(client.call("work", {}, timeout=10), 0.3)
                )
                await asyncio.wait_for(entered.wait(), 5)
                assert breaker.snapshot().trials == 1  # this call holds a trial slot
                with pytest.raises(TimeoutError):
                    await trial
                assert breaker.snapshot().trials == 0  # and gave it back

            mode["now"] = "ok"
            for _ in range(config.half_open_successes):  # trials go through and close it
                assert (await client.call("work", {})).agent_id == "a-1"
            assert breaker.state == "closed"
        finally:
            release.set()


# -- an instance that stops, a lost connection, a closed client ------------------------


async def test_calls_reaching_a_stopping_instance_are_told_so_and_go_to_the_other(
    nats_server: NatsServer, registrar: Registrar
) -> None:
    """stop() stops accepting before its subscriptions are drained (one by one): a call
    that arrives in between is answered "unavailable" at once and retried on the other
    instance, rather than left without a reply to time out (a call that timed out is not
    retried: the capability is not idempotent)."""
    caps = [capability(f"work{i}", sla_ms=1000) for i in range(4)]  # attempt timeout 1.5 s
    a1, b1 = make_agent(nats_server.url, "a-1", *caps)
    a2, b2 = make_agent(nats_server.url, "a-2", *caps)
    async with (
        a1,
        a2,
        ReachClient(servers=nats_server.url) as client,
        ReachClient(servers=nats_server.url, max_retries=0) as single,
    ):
        for c in (client, single):
            await wait_routable(c, "work3", 2)
            _prefer(c, "a-1", "a-2")
        stopping = asyncio.create_task(a1.stop())
        await asyncio.sleep(0)  # stop() has begun: a-1 no longer accepts, work3 still subscribed
        started = time.monotonic()
        told, *results = await asyncio.wait_for(
            asyncio.gather(
                single.call("work3", {"n": -1}),
                *(client.call("work3", {"n": n}) for n in range(8)),
                return_exceptions=True,
            ),
            10,
        )
        elapsed = time.monotonic() - started
        await asyncio.wait_for(stopping, 10)
    # without retries, the caller hears why at once
    assert isinstance(told, Unavailable), repr(told)
    assert "a-1 is stopping" in str(told)
    for result in results:
        assert not isinstance(result, BaseException), repr(result)
        assert result.agent_id == "a-2"
        assert result.route[0][0] == "a-1"  # tried the stopping instance first
        assert result.route[0][2] in ("unavailable", "connect")
    assert any(r.route[0][2] == "unavailable" for r in results)  # type: ignore[union-attr]
    assert elapsed < 1.2  # nobody waited out the 1.5 s attempt timeout
    assert b1.calls == 0  # a-1's handler never ran
    assert b2.calls == len(results)


async def test_a_lost_connection_is_disconnected_and_leaves_the_instances_breaker_alone(
    nats_server: NatsServer, registrar: Registrar
) -> None:
    """Calls while the client's connection is down end as Disconnected (this side's
    trouble), not as timeouts of the instance: once NATS is back the instance is called,
    its breaker never opened."""
    agent, _ = make_agent(nats_server.url, "a-1", capability(sla_ms=200))
    async with agent, ReachClient(servers=nats_server.url, audit=False) as client:
        await wait_routable(client, "work", 1)
        await asyncio.to_thread(nats_server.stop_now)
        await until(
            lambda: not client.connection.is_connected, "the client saw NATS go", timeout=SETTLE
        )
        # more than the breaker's min_calls (20): as timeouts they would open it
        outcomes = await asyncio.wait_for(
            asyncio.gather(
                *(client.call("work", {"i": i}) for i in range(25)), return_exceptions=True
            ),
            SETTLE,
        )
        for outcome in outcomes:
            if isinstance(outcome, RetriesExhausted):
                outcome = outcome.last  # type: ignore[assignment]
            assert isinstance(outcome, Disconnected), repr(outcome)
        snapshot = client.breakers.get("a-1").snapshot()
        assert (snapshot.state, snapshot.failures) == ("closed", 0)

        await asyncio.to_thread(nats_server.start_now)
        await until(
            lambda: client.connection.is_connected and agent.connection.is_connected,
            "the client and the agent reconnected",
            timeout=SETTLE,
        )
        result = await client.call("work", {"back": True}, timeout=5)
    assert result.agent_id == "a-1"
    assert result.value == {"by": "a-1", "echo": {"back": True}}


async def test_a_call_in_flight_when_the_client_closes_fails_at_once_as_disconnected(
    nats_server: NatsServer, registrar: Registrar
) -> None:
    hold, entered, release = hold_until_released({"late": True})
    agent, _ = make_agent(nats_server.url, "a-1", capability(sla_ms=20000), handler=hold)
    async with agent, ReachClient(servers=nats_server.url) as client:
        try:
            await wait_routable(client, "work", 1)
            call = asyncio.create_task(client.call("work", {}, timeout=20))
            await asyncio.wait_for(entered.wait(), 5)
            await client.close()
            # well before its 20 s timeout, and not retried on the closed connection
            with pytest.raises(Disconnected):
                await asyncio.wait_for(call, 5)
        finally:
            release.set()  # before the agent stops: it waits for the calls it serves


#: an instance of ``work`` in a process of its own (the agent id and the server's URL as
#: arguments): killed, it leaves its record in the registry and nobody on its subject
_AGENT_PROCESS = """
import asyncio, sys
from reach import Agent

manifest = {
    "agent_id": sys.argv[1], "agent_name": "test", "version": "1.0.0",
    "capabilities": [{
        "name": "work", "tags": ["work"], "latency_sla_ms": 400, "idempotent": True,
        "input_schema": {"type": "object"}, "output_schema": {"type": "object"},
    }],
    "health": {"interval_sec": 0.5, "timeout_sec": 0.3, "failures_before_unhealthy": 2},
}
agent = Agent(manifest, servers=sys.argv[2])

@agent.capability("work")
async def work(req: dict) -> dict:
    return {"ok": True}

async def main() -> None:
    async with agent:
        print("serving", flush=True)
        await agent.serve_forever()

asyncio.run(main())
"""


async def _agent_process(agent_id: str, url: str, cwd: Path) -> asyncio.subprocess.Process:
    """The agent's process, once it serves (in ``cwd``, without the user's fabric)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("REACH_")}
    proc = await asyncio.create_subprocess_exec(
        *(sys.executable, "-c", _AGENT_PROCESS, agent_id, url),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=cwd,
        env=env,
    )
    assert proc.stdout is not None
    assert proc.stderr is not None
    line = await asyncio.wait_for(proc.stdout.readline(), SETTLE)
    if line != b"serving\n":
        await proc.wait()
        raise AssertionError((await proc.stderr.read()).decode()[-2000:])
    return proc


async def test_a_client_new_to_the_fabric_waits_for_an_agent_logging_in_again(
    nats_server: NatsServer, registrar: Registrar, tmp_path: Path
) -> None:
    """The server restarts while an agent cannot log in again yet (its process stopped
    meanwhile): its record stays in the registry, nobody listens on its subject, and the
    registrar's probes mark it unhealthy. A client started then, as a script run right
    after ``reach up``, is as new to the fabric as one that reconnected: its call waits
    within its deadline for the agent to log in again, and is served, instead of failing
    at once with NoHealthyInstance."""
    agent = await _agent_process("back-1", nats_server.url, tmp_path)
    try:
        agent.send_signal(signal.SIGSTOP)
        nats_server.restart()
        async with ReachClient(servers=nats_server.url) as client:
            # the registrar's probes found nobody: the record says unhealthy
            await until(
                lambda: [
                    i
                    for i in client.routes.find("work", include_unhealthy=True)
                    if i.status == "unhealthy"
                ],
                "the record marked unhealthy",
                timeout=3 * SETTLE,  # the registrar reconnects first, then probes
            )
            call = asyncio.create_task(client.call("work", {}, timeout=3 * SETTLE))
            await asyncio.sleep(0)  # the call is under way before the agent can log in
            agent.send_signal(signal.SIGCONT)
            served = await call
        assert served.agent_id == "back-1"
    finally:
        if agent.returncode is None:
            agent.send_signal(signal.SIGCONT)
            agent.kill()
            await agent.wait()
