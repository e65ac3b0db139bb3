"""A herd of calls released at once: an instance takes what its max concurrency admits and
holds the rest briefly, within their deadlines, instead of refusing them; a sustained
overload is still refused at once with ``over_capacity``."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import pytest

from reach.agent.agent import Agent
from reach.agent.serving import CallServer, endpoint_for
from reach.caller.client import ReachClient
from reach.clock import system_clock
from reach.registry import Registrar
from reach.testing import NatsServer
from reach.wire import codec, envelope, subjects
from reach.wire.models import Capability

from .calls_helpers import capability, make_agent, wait_routable
from .poll_helpers import until

#: a bound on waits for the fabric to settle (a restart, a herd served)
SETTLE = 15.0


@dataclass
class Gauge:
    """How many calls a handler runs at once, and the most it ever ran."""

    running: int = 0
    most: int = 0
    served: int = 0


def gauged(gauge: Gauge, agent: list[Agent], hold: float) -> Any:
    """A handler that takes ``hold`` seconds and records its own concurrency and the
    instance's in-flight count (``agent[0]``, set once the agent exists)."""

    async def handler(req: Any) -> Any:
        gauge.running += 1
        gauge.most = max(gauge.most, gauge.running, agent[0].in_flight)
        try:
            await asyncio.sleep(hold)
        finally:
            gauge.running -= 1
        gauge.served += 1
        return req

    return handler


def herd_agent(url: str, gauge: Gauge, *, max_concurrency: int, hold: float) -> Agent:
    box: list[Agent] = []
    agent, _ = make_agent(
        url,
        "herd-1",
        capability(sla_ms=400, idempotent=True),
        max_concurrency=max_concurrency,
        handler=gauged(gauge, box, hold),
    )
    box.append(agent)
    return agent


async def _warm(client: ReachClient, n: int) -> None:
    """Calls one after the other: the instance learns how long its calls take."""
    for i in range(n):
        await client.call("work", {"warm": i})


async def test_a_burst_released_at_once_is_served_within_max_concurrency(
    nats_server: NatsServer, registrar: Registrar
) -> None:
    gauge = Gauge()
    agent = herd_agent(nats_server.url, gauge, max_concurrency=4, hold=0.005)
    async with agent, ReachClient(servers=nats_server.url, audit=False) as client:
        await wait_routable(client, "work", 1)
        await _warm(client, 10)
        go = asyncio.Event()

        async def one(i: int) -> Any:
            await go.wait()
            return await client.call("work", {"i": i}, timeout=10)

        calls = [asyncio.create_task(one(i)) for i in range(40)]
        await asyncio.sleep(0)  # every call waits on the event
        go.set()
        outcomes = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), SETTLE)
    failed = [o for o in outcomes if isinstance(o, BaseException)]
    assert failed == []
    assert [o.value for o in outcomes] == [{"i": i} for i in range(40)]
    assert gauge.most <= 4


@pytest.mark.serial
async def test_calls_held_while_the_server_restarts_are_served_within_max_concurrency(
    nats_server: NatsServer, registrar: Registrar
) -> None:
    """Calls started while the server is down wait for the connection; when it comes back
    they are released together, onto an instance that takes 4 at a time."""
    gauge = Gauge()
    agent = herd_agent(nats_server.url, gauge, max_concurrency=4, hold=0.005)
    async with agent, ReachClient(servers=nats_server.url, audit=False) as client:
        await wait_routable(client, "work", 1)
        await _warm(client, 10)
        await asyncio.to_thread(nats_server.stop_now)
        await until(lambda: not client.connection.is_connected, "the client saw NATS go")
        calls = [asyncio.create_task(client.call("work", {"i": i}, timeout=10)) for i in range(40)]
        await asyncio.to_thread(nats_server.start_now)
        outcomes = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), SETTLE)
    failed = [f"{type(o).__name__}: {o}" for o in outcomes if isinstance(o, BaseException)]
    assert failed == []
    assert gauge.most <= 4


@pytest.mark.serial
async def test_a_sustained_overload_is_refused_at_once_with_over_capacity(
    nats_server: NatsServer, registrar: Registrar
) -> None:
    """Requests arriving far faster than the instance serves them, for a while: it runs
    at most its max concurrency, holds no more than it can serve in time, and refuses
    the rest at once (``over_capacity``), not after a wait."""
    gauge = Gauge()
    agent = herd_agent(nats_server.url, gauge, max_concurrency=2, hold=0.05)
    async with agent, ReachClient(servers=nats_server.url, audit=False) as client:
        await wait_routable(client, "work", 1)
        await _warm(client, 5)
        # about 200 requests a second for a second, against 40 a second served, each
        # with the deadline a caller gives its attempts (1.5 × the SLA)
        sent: list[asyncio.Task[envelope.Reply]] = []
        for i in range(200):
            sent.append(asyncio.create_task(_raw_call(client, "herd-1", i, 0.6)))
            await asyncio.sleep(0.005)
        replies = await asyncio.wait_for(asyncio.gather(*sent), SETTLE)
    served = [r for r in replies if r.ok]
    refused = [r for r in replies if not r.ok]
    assert gauge.most <= 2
    assert {(r.kind, r.code) for r in refused} == {("unavailable", "over_capacity")}
    assert len(refused) > len(served)
    # refused as they came: not held first and refused after waiting
    waited = [r for r in refused if "waited" in r.description]
    assert len(waited) < len(refused) // 10


async def _raw_call(client: ReachClient, agent_id: str, i: int, within: float) -> envelope.Reply:
    """One request straight to an instance, not retried: its reply as it came."""
    meta = envelope.RequestMeta(call_id=f"raw-{i}")
    meta.deadline_ms = int((time.time() + within) * 1000)
    subject = subjects.capability_instance("work", agent_id)
    data = await client.connection.request(subject, envelope.pack_request(meta, b"\x80"), 5)
    return envelope.unpack_reply(data)


async def test_calls_waiting_for_a_slot_are_told_at_once_when_the_instance_stops(
    nats_server: NatsServer, registrar: Registrar
) -> None:
    """An instance that stops answers the calls waiting for a slot ``shutting_down`` at
    once (their callers go elsewhere now), while the call it runs finishes."""
    release = asyncio.Event()
    entered = asyncio.Event()

    async def handler(req: Any) -> Any:
        if req.get("hold"):
            entered.set()
            await release.wait()
        return req

    agent, _ = make_agent(
        nats_server.url,
        "stop-1",
        capability(sla_ms=2000, idempotent=True),
        max_concurrency=1,
        handler=handler,
    )
    async with ReachClient(servers=nats_server.url, audit=False) as client:
        await agent.start()
        stopping: asyncio.Task[None] | None = None
        try:
            await wait_routable(client, "work", 1)
            await _warm(client, 5)
            running = asyncio.create_task(client.call("work", {"hold": True}, timeout=20))
            await asyncio.wait_for(entered.wait(), 5)
            waiting = [asyncio.create_task(_raw_call(client, "stop-1", i, 5)) for i in range(3)]
            await until(lambda: agent._server.waiting == 3, "three calls waiting for a slot")
            stopping = asyncio.create_task(agent.stop())
            replies = await asyncio.wait_for(asyncio.gather(*waiting), 5)
            assert not running.done()  # told while the call it runs still runs
        finally:
            release.set()
            if stopping is None:
                await agent.stop()
            else:
                await asyncio.wait_for(stopping, 10)
        assert (await running).value == {"hold": True}
    assert {(r.kind, r.code) for r in replies} == {("unavailable", "shutting_down")}


async def test_a_waiting_call_that_is_cancelled_passes_its_turn_on() -> None:
    """Served straight from a ``CallServer`` (no messaging involved): a call cancelled
    while it waits for a slot leaves the queue, and the next one gets the slot."""
    capability_ = Capability.model_validate({"name": "work", "latency_sla_ms": 2000})
    release = asyncio.Event()

    async def handler(req: Any) -> Any:
        if req["i"]:
            await release.wait()
        return req

    endpoint = endpoint_for(capability_, handler)
    server = CallServer("q-1", max_concurrency=1, clock=system_clock, is_ready=lambda: (True, ""))

    def serve(i: int) -> asyncio.Task[bytes]:
        meta = envelope.RequestMeta(call_id=f"q-{i}")
        meta.deadline_ms = int((time.time() + 10) * 1000)
        request = envelope.pack_request(meta, codec.encode({"i": i}))
        return asyncio.create_task(server.handle(endpoint, request))

    await serve(0)  # the server learns how long its calls take
    first = serve(1)
    await until(lambda: server.in_flight == 1, "the first call running")
    second, third = serve(2), serve(3)
    await until(lambda: server.waiting == 2, "two calls waiting")
    second.cancel()
    await until(lambda: server.waiting == 1, "the cancelled call gone from the queue")
    release.set()
    replies = [envelope.unpack_reply(r) for r in await asyncio.gather(first, third)]
    assert [codec.decode(r.body) for r in replies] == [{"i": 1}, {"i": 3}]
    assert second.cancelled()
    assert (server.in_flight, server.waiting) == (0, 0)
