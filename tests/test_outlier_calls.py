"""Outlier detection on a real fabric: of three instances that all pass their probes, one
whose handler fails every call, or one that answers far over its SLA, loses its share of
the calls once the caller has seen a run of them, and is tried again after a while."""

from __future__ import annotations

import time
from typing import Any

import pytest

from reach.caller.client import ReachClient
from reach.errors import InternalError
from reach.testing import NatsServer

from .calls_helpers import capability, make_agent, wait_routable


async def _calls(client: ReachClient, n: int, **options: Any) -> tuple[list[str], int]:
    """``n`` calls one after the other: who answered each, and how many failed in the
    handler."""
    served: list[str] = []
    crashed = 0
    for _ in range(n):
        try:
            result = await client.call("work", {}, **options)
        except InternalError as exc:
            crashed += 1
            served.append(exc.agent_id)
        else:
            served.append(result.agent_id)
    return served, crashed


async def test_an_instance_whose_handler_fails_every_call_is_set_aside(
    nats_server: NatsServer, client: ReachClient
) -> None:
    work = capability("work", idempotent=True)
    good, _ = make_agent(nats_server.url, "good-1", work)
    other, _ = make_agent(nats_server.url, "good-2", work)
    bad, b = make_agent(nats_server.url, "crashing", work)
    b.fail = "crash"
    async with good, other, bad:
        await wait_routable(client, "work", 3)
        # the caller sees five failures in a row from it, and no more
        served, crashed = await _calls(client, 200)
        assert crashed == client.outliers.config.consecutive_errors
        assert served.count("crashing") == crashed
        ejected = client.peers.peer("crashing").outlier
        assert ejected.reason == "errors"
        assert ejected.ejected(time.monotonic())
        # set aside: the others take every call while it is
        served, crashed = await _calls(client, 300)
        assert crashed == 0
        assert set(served) == {"good-1", "good-2"}
        # its time up, it is tried again: one failure ejects it for twice as long
        ejected.until = time.monotonic()
        served, crashed = await _calls(client, 200)
        assert crashed == 1
        assert ejected.ejections == 2


@pytest.mark.parametrize(
    "sleep", [pytest.param(0.2, id="5x-sla-timing-out"), pytest.param(0.05, id="late-answers")]
)
async def test_an_instance_answering_far_over_its_sla_is_set_aside(
    nats_server: NatsServer, client: ReachClient, sleep: float
) -> None:
    """At five times its SLA every attempt sent to it times out (after 1.5 × SLA) and the
    call is retried on another; at 1.25 times it answers, late, far behind the others."""
    work = capability("work", sla_ms=40, idempotent=True)
    fast, _ = make_agent(nats_server.url, "fast-1", work)
    other, _ = make_agent(nats_server.url, "fast-2", work)
    slow, b = make_agent(nats_server.url, "crawling", work)
    b.sleep = sleep
    async with fast, other, slow:
        await wait_routable(client, "work", 3)
        slow_state = client.peers.peer("crawling").outlier
        sent = 0
        while not slow_state.ejected(time.monotonic()):
            assert sent < 20_000, "the crawling instance was never set aside"
            await _calls(client, 50, timeout=2.0)
            sent += 50
        assert slow_state.reason == "slow"
        before = b.calls
        served, _ = await _calls(client, 300, timeout=2.0)
        assert "crawling" not in served
        assert b.calls == before


async def test_a_capability_slow_everywhere_ejects_nobody(
    nats_server: NatsServer, client: ReachClient
) -> None:
    """Every instance answers over its SLA, within the attempt's 1.5 × SLA: being over
    the SLA is no reason on its own. (An attempt that waits longer than it should, on a
    busy machine, still reads at most 1.5 × the SLA, well short of the slow factor times
    what the others answer in.)"""
    work = capability("work", sla_ms=100, idempotent=True)
    agents = [make_agent(nats_server.url, f"slow-{n}", work) for n in range(3)]
    for _, b in agents:
        b.sleep = 0.12
    async with agents[0][0], agents[1][0], agents[2][0]:
        await wait_routable(client, "work", 3)
        served, _ = await _calls(client, 45, timeout=2.0)
        assert set(served) == {"slow-0", "slow-1", "slow-2"}
        now = time.monotonic()
        assert not any(client.peers.peer(f"slow-{n}").outlier.ejected(now) for n in range(3))
