"""Regressions found in review, on the resilience of calls: an instance that stops while
calls come in, errors met on a retry or in a nested call, a lost NATS connection, a
cancelled half-open trial, a payload the server cannot carry, a fallback's time, a client
closed under a call, the retry budget's accounting, and what a client keeps of instances
that left."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest

from reach.client import ReachClient
from reach.context import current_call
from reach.errors import (
    BusinessError,
    ContractError,
    Disconnected,
    InternalError,
    RetriesExhausted,
    Unavailable,
)
from reach.fallback import Fallback
from reach.registry import Registrar
from reach.resilience import BreakerConfig, RetryBudget
from reach.testing import NatsServer

from .calls_helpers import Behaviour, capability, make_agent, wait_routable
from .conftest import Fabric, vault_agent

#: a bound on waits for the fabric to settle (a restart, a record leaving the registry)
SETTLE = 10.0
#: the nested calls' contract: C takes an integer n
N_SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


async def _until(condition: Callable[[], bool], what: str, timeout: float = SETTLE) -> None:
    """Poll ``condition`` every 20 ms until it holds; fail naming ``what`` after ``timeout``."""
    give_up = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > give_up:
            pytest.fail(f"not within {timeout} s: {what}")
        await asyncio.sleep(0.02)


def _held(answer: Any) -> tuple[Callable[[Any], Any], asyncio.Event, asyncio.Event]:
    """A handler that says it ``entered``, then waits for ``release`` to answer."""
    entered = asyncio.Event()
    release = asyncio.Event()

    async def hold(req: Any) -> Any:
        entered.set()
        await release.wait()
        return answer

    return hold, entered, release


def _prefer(client: ReachClient, first: str, second: str) -> None:
    """Make ``client`` route to ``first`` before ``second`` (far better measured latency)."""
    client.peers.observe(first, 1)
    client.peers.observe(second, 990)


# -- 1. an instance that stops while calls come in ------------------------------------


async def test_calls_reaching_a_stopping_instance_are_told_so_and_go_to_the_other(
    nats_server: NatsServer, registrar: Registrar
) -> None:
    """stop() stops accepting before its subscriptions are drained (one by one): a call
    that arrives in between used to get no reply at all and time out (not retried: the
    capability is not idempotent). It is now answered "unavailable" at once."""
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


# -- 2. an answer met on a retry -------------------------------------------------------


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
    async with agent, ReachClient(servers=nats_server.url) as client:
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


async def test_a_contract_error_met_on_a_retry_is_raised_as_it_is(
    nats_server: NatsServer, registrar: Registrar
) -> None:
    ran: list[int] = []
    handler = _unavailable_then(ContractError("n: must be positive", path="n", rule="min"), ran)
    agent, _ = make_agent(nats_server.url, "a-1", handler=handler)
    async with agent, ReachClient(servers=nats_server.url) as client:
        await wait_routable(client, "work", 1)
        with pytest.raises(ContractError) as refused:
            await client.call("work", {}, timeout=5, fallback=Fallback(default={"fb": True}))
    assert "n: must be positive (at a-1)" in str(refused.value)
    assert ran == [1, 2]


# -- 3. errors of a nested call A -> B -> C --------------------------------------------


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
        servers=nats_server.url, max_retries=1, retry_budget=RetryBudget(min_retries=100)
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
        ReachClient(servers=nats_server.url, retry_budget=RetryBudget(min_retries=100)) as client,
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
    clearance are fine, used to get AuthenticationFailed (about its own credentials)."""
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


# -- 4. a lost NATS connection ---------------------------------------------------------


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
        await _until(lambda: not client.connection.is_connected, "the client saw NATS go")
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
        await _until(
            lambda: client.connection.is_connected and agent.connection.is_connected,
            "the client and the agent reconnected",
        )
        result = await client.call("work", {"back": True}, timeout=5)
    assert result.agent_id == "a-1"
    assert result.value == {"by": "a-1", "echo": {"back": True}}


# -- 5. a cancelled half-open trial ----------------------------------------------------


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
            await _until(lambda: breaker.state == "half_open", "the breaker half-opened")

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


# -- 6. a payload the server cannot carry ----------------------------------------------


async def test_a_payload_over_the_servers_max_payload_is_refused_before_it_is_sent(
    nats_server: NatsServer, registrar: Registrar
) -> None:
    agent, b = make_agent(nats_server.url, "a-1")
    async with agent, ReachClient(servers=nats_server.url) as client:
        await wait_routable(client, "work", 1)
        # within the codec's limits, too large for the server once the envelope is added
        big = {"blob": "x" * (client.connection.max_payload - 100)}
        for _ in range(25):  # more than the breaker's min_calls
            with pytest.raises(ContractError) as refused:
                await client.call("work", big)
        assert refused.value.rule == "max_bytes"
        snapshot = client.breakers.get("a-1").snapshot()
        assert (snapshot.state, snapshot.calls, snapshot.failures) == ("closed", 0, 0)
        assert (await client.call("work", {"small": 1})).agent_id == "a-1"
    assert b.calls == 1


# -- 7. a backup fallback has what is left of the call's time --------------------------


async def test_a_backup_fallback_gets_only_what_is_left_of_the_calls_timeout(
    nats_server: NatsServer, registrar: Registrar
) -> None:
    told: list[float] = []

    async def lite(req: Any) -> Any:
        call = current_call()
        assert call is not None
        assert call.deadline_ms is not None
        told.append(call.deadline_ms / 1000)
        await asyncio.sleep(0.9)  # more than is left once the primary timed out
        return {"lite": True}

    # the primary's attempt times out after 0.3 s (1.5 x its SLA); not idempotent: no retry
    main, slow = make_agent(nats_server.url, "main-1", capability("work", sla_ms=200))
    slow.sleep = 5
    backup, _ = make_agent(nats_server.url, "lite-1", capability("lite", sla_ms=5000), handler=lite)
    fb = Fallback(backup_capability="lite", default={"fallback": True})
    async with main, backup, ReachClient(servers=nats_server.url) as client:
        await wait_routable(client, "work", 1)
        await wait_routable(client, "lite", 1)
        t0 = time.time()
        result = await asyncio.wait_for(client.call("work", {}, timeout=1.0, fallback=fb), 10)
        elapsed = time.time() - t0
    assert result.fallback is not None
    assert result.fallback.source == "default"  # the backup ran out of the call's time
    assert "backup lite failed: ReachTimeout" in result.fallback.reason
    assert result.value == {"fallback": True}
    assert elapsed < 1.5  # not 0.3 s + a second of its own
    (deadline,) = told
    assert deadline <= t0 + 1.05  # the backup's callee was told the call's deadline


# -- 8. a call in flight when the client closes ----------------------------------------


async def test_a_call_in_flight_when_the_client_closes_fails_at_once_as_disconnected(
    nats_server: NatsServer, registrar: Registrar
) -> None:
    hold, entered, release = _held({"late": True})
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


# -- 9. the retry budget pays for retries made -----------------------------------------


async def test_the_retry_budget_is_charged_only_for_retries_made(
    nats_server: NatsServer, registrar: Registrar
) -> None:
    async def busy(req: Any) -> Any:
        raise Unavailable("pool exhausted")

    agent, _ = make_agent(nats_server.url, "a-1", handler=busy)
    # breakers out of the way: every attempt reaches the instance
    patient = BreakerConfig(min_calls=1000, consecutive_failures=1000)
    async with (
        agent,
        ReachClient(
            servers=nats_server.url,
            max_retries=0,
            breaker=patient,
            retry_budget=RetryBudget(min_retries=100),
        ) as never,
        ReachClient(
            servers=nats_server.url, breaker=patient, retry_budget=RetryBudget(min_retries=100)
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


# -- 10. what a client keeps of instances that left ------------------------------------


async def test_a_client_forgets_what_it_kept_of_an_instance_that_left(
    nats_server: NatsServer, registrar: Registrar
) -> None:
    stay, _ = make_agent(nats_server.url, "stay-1")
    async with stay, ReachClient(servers=nats_server.url) as client:
        await wait_routable(client, "work", 1)
        await client.call("work", {})
        for i in range(3):
            gone, _ = make_agent(nats_server.url, f"gone-{i}")
            async with gone:
                await client.routes.wait_for(
                    lambda c, i=i: c.get(f"gone-{i}") is not None, timeout=5
                )
                # calls until one went to it (its breaker, latency and in-flight count)
                for _ in range(50):
                    if client.peers.latency(f"gone-{i}") is not None:
                        break
                    await client.call("work", {}, timeout=2)
                assert f"gone-{i}" in client.breakers
                assert f"gone-{i}" in client.peers
            await client.routes.wait_for(lambda c, i=i: c.get(f"gone-{i}") is None, timeout=5)
        for i in range(3):
            assert f"gone-{i}" not in client.breakers
            assert client.peers.latency(f"gone-{i}") is None
            assert f"gone-{i}" not in client.peers
        # what it keeps of the instance still there stays
        assert "stay-1" in client.breakers
        assert client.peers.latency("stay-1") is not None


async def test_a_call_that_ends_after_its_instance_left_brings_none_of_it_back(
    nats_server: NatsServer, registrar: Registrar
) -> None:
    """The record goes while a call to it is in flight; the call then succeeds. What it
    reports (latency, calls in flight, breaker) lands on what the call held, which goes
    with it: the client keeps nothing of the instance that left."""
    from reach.registry.store import RegistryStore
    from reach.transport import connect

    held, entered, release = _held({"ok": True})
    # no heartbeat or probe during the test would bring the record back
    slow = {"interval_sec": 30, "timeout_sec": 3, "failures_before_unhealthy": 2}
    agent, _ = make_agent(nats_server.url, "late-1", handler=held, health=slow)
    conn = await connect([nats_server.url], name="test-deleter")
    try:
        async with agent, ReachClient(servers=nats_server.url) as client:
            await wait_routable(client, "work", 1)
            call = asyncio.create_task(client.call("work", {}, timeout=10))
            await asyncio.wait_for(entered.wait(), SETTLE)
            assert "late-1" in client.peers
            assert client.peers.peer("late-1").outstanding == 1
            await (await RegistryStore.open(conn, create=False)).delete("late-1")
            await client.routes.wait_for(lambda c: c.get("late-1") is None, timeout=5)
            assert "late-1" not in client.peers
            assert "late-1" not in client.breakers
            release.set()
            result = await call
            assert result.agent_id == "late-1"
            assert "late-1" not in client.peers
            assert client.peers.latency("late-1") is None
            assert "late-1" not in client.breakers
    finally:
        await conn.close()
