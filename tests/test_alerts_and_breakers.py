"""Alerts raised by the registrar's watcher from real calls, and `reach doctor` on a
capability whose instance sits behind an open breaker."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any

from reach.agent.context import current_call
from reach.audit.alerts import Alert, decode_alert
from reach.caller.client import ReachClient
from reach.errors import CircuitOpen, ReachError, Unavailable
from reach.registry import Registrar
from reach.resilience import BreakerConfig, RetryBudget
from reach.testing import NatsServer
from reach.transport import Connection
from reach.wire import subjects

from .audit_helpers import event, write
from .calls_helpers import make_agent, wait_routable
from .cli_helpers import run_reach


async def alerts_in_stream(conn: Connection, rule: str) -> list[Alert]:
    stream = await conn.stream(subjects.ALERTS_STREAM)
    found = [decode_alert(m.data) async for m in stream.read(subjects.alert(rule))]
    return [a for a in found if a is not None]


async def busy_on_first_attempt(req: Any) -> Any:
    call = current_call()
    assert call is not None
    if call.attempt == 1:
        raise Unavailable("pool full")
    return {"ok": True}


async def test_the_retry_alert_fires_at_the_eleventh_retry_in_a_minute(
    nats_server: NatsServer, registrar: Registrar, conn: Connection
) -> None:
    agent, _ = make_agent(nats_server.url, "flaky-1", handler=busy_on_first_attempt)
    # half of the attempts fail: the breaker would open (rightly) before the 11th call
    patient = BreakerConfig(min_calls=100, consecutive_failures=100)
    async with (
        agent,
        ReachClient(
            servers=nats_server.url, retry_budget=RetryBudget(min_retries=100), breaker=patient
        ) as client,
    ):
        await wait_routable(client, "work", 1)
        # one retry per call, all within the minute
        for _ in range(11):
            assert (await client.call("work", {})).attempts == 2
        assert client.audit is not None
        await client.audit.flush()
        for _ in range(100):
            storms = await alerts_in_stream(conn, "retry_storm")
            if storms:
                break
            await asyncio.sleep(0.05)
    # one alert, and it counted 11: it did not fire at 10 (a 10-retry alert would have
    # come first and suppressed this one)
    (storm,) = storms
    assert storm.details["retries"] == 11
    assert storm.details["callee"] == "flaky-1"
    assert storm.key == "reach-client→flaky-1"  # open fabric: the client's name


async def test_an_instance_turning_unhealthy_raises_an_alert(
    nats_server: NatsServer, registrar: Registrar, conn: Connection
) -> None:
    agent, _ = make_agent(nats_server.url, "doomed-1")
    await agent.start()
    async with ReachClient(servers=nats_server.url) as client:
        await wait_routable(client, "work", 1)
        # stop heartbeating without saying goodbye: missed heartbeats → unhealthy
        assert agent._heartbeat_task is not None
        agent._heartbeat_task.cancel()
        await agent._conn.close()  # type: ignore[union-attr]
        for _ in range(200):
            found = await alerts_in_stream(conn, "unhealthy")
            if found:
                break
            await asyncio.sleep(0.05)
    (alert,) = found
    assert alert.key == "doomed-1"
    assert alert.severity == "critical"
    code, out, err = await run_reach("alerts", "--servers", nats_server.url)
    assert code == 0, err
    assert "unhealthy" in out
    assert "doomed-1" in out


async def test_doctor_blames_an_open_breaker(nats_server: NatsServer, registrar: Registrar) -> None:
    async def always_busy(req: Any) -> Any:
        raise Unavailable("pool exhausted")

    agent, _ = make_agent(nats_server.url, "tripped-1", handler=always_busy)
    # open for longer than any call here waits: every call after the trip is refused
    breaker = BreakerConfig(min_calls=5, open_base_sec=30.0, healthy_open_sec=30.0)
    async with (
        agent,
        ReachClient(servers=nats_server.url, breaker=breaker, max_retries=0) as client,
    ):
        await wait_routable(client, "work", 1)
        for _ in range(5):
            with contextlib.suppress(ReachError):
                await client.call("work", {})
        rejected = 0
        for _ in range(3):
            try:
                await client.call("work", {})
            except CircuitOpen:
                rejected += 1
        assert rejected == 3
        assert client.audit is not None
        await client.audit.flush()
        code, out, err = await run_reach("doctor", "work", "--json", "--servers", nats_server.url)
    assert code == 0, err
    result = json.loads(out)
    assert result["layer"] == "fabric", result
    assert "circuit breaker open for tripped-1" in result["conclusion"]
    fabric_step = result["steps"][5]
    assert any("breaker OPEN for tripped-1" in f for f in fabric_step["findings"])


async def test_the_registrar_alerts_on_calls_that_skip_an_open_breaker(
    nats_server: NatsServer, registrar: Registrar, conn: Connection
) -> None:
    now = time.time()
    served = [{"agent_id": "u-2", "outcome": "ok", "latency_ms": 1.0}]
    rows = [event(n, capability="unav", ts=now, callee="u-2", attempts=served) for n in range(20)]
    rows += [
        event(100 + n, capability="unav", ts=now, callee="u-2", skipped=("u-1",), attempts=served)
        for n in range(5)
    ]
    await write(conn, *rows)
    stream = await conn.stream(subjects.ALERTS_STREAM)
    found: list[Any] = []
    for _ in range(100):  # the registrar's watcher reads the notable batch in the background
        messages = [m async for m in stream.read(subjects.alert("breaker_rejections"))]
        found = [a for a in (decode_alert(m.data) for m in messages) if a is not None]
        if found:
            break
        await asyncio.sleep(0.05)
    (alert,) = found
    assert alert.key == "unav"
    assert alert.details["rejected"] >= 3
