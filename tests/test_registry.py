"""Registration, discovery and health, against a real nats-server with agents as processes
(and in-process agents where the test drives their heartbeats or readiness)."""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from reach.agent.agent import Agent
from reach.caller.client import ReachClient
from reach.caller.routecache import RouteCache
from reach.errors import DiscoveryError, RegistrationRefused
from reach.registry import Registrar, RegistrarConfig
from reach.registry.store import decode_instance
from reach.testing import NatsServer
from reach.transport import Connection, connect
from reach.wire import subjects
from reach.wire.models import Instance, Readiness

from .calls_helpers import capability, make_agent, wait_routable
from .conftest import manifest
from .poll_helpers import until


def _status(client: ReachClient, agent_id: str) -> str | None:
    inst = client.routes.get(agent_id)
    return inst.status if inst else None


async def test_registered_agent_is_found_by_capability_and_by_tag(
    client: ReachClient, nats_server: NatsServer
) -> None:
    agent = Agent(
        manifest("search-1", "web_search", tags=("search", "web")), servers=nats_server.url
    )
    other = Agent(
        manifest("report-1", "make_report", tags=("report-generate",)), servers=nats_server.url
    )
    for a in (agent, other):
        for cap in a.manifest.capabilities:

            @a.capability(cap.name)
            async def handle(req: dict[str, object]) -> dict[str, object]:
                return req

    async with agent, other:
        await client.routes.wait_for(lambda c: len(c.all()) == 2, timeout=5)
        by_cap = await client.discover(capability="web_search")
        assert [i.agent_id for i in by_cap] == ["search-1"]
        by_tag = await client.discover(tags=["report-generate"])
        assert [i.agent_id for i in by_tag] == ["report-1"]
        assert [i.agent_id for i in await client.discover(tags=["search", "web"])] == ["search-1"]
        assert await client.discover(tags=["search", "report-generate"]) == []
        assert [i.agent_id for i in await client.discover(version="1")] == ["report-1", "search-1"]
        assert await client.discover(version="2") == []
        inst = by_cap[0]
        assert inst.status == "healthy"
        assert inst.manifest.capabilities[0].tags == ["search", "web"]
    # leaving the context deregisters at once
    await client.routes.wait_for(lambda c: not c.all(), timeout=5)


async def test_sigkilled_agent_leaves_the_routing_view_within_three_heartbeats(
    client: ReachClient, spawn_agent: object
) -> None:
    interval = 0.5
    proc = await spawn_agent(manifest("doomed-1", interval=interval))  # type: ignore[operator]
    await client.routes.wait_for(lambda c: _status(client, "doomed-1") == "healthy", timeout=5)
    proc.kill()
    killed_at = time.monotonic()
    await client.routes.wait_for(
        lambda c: not c.find(capability="echo"), timeout=3 * interval + 1.0
    )
    assert time.monotonic() - killed_at <= 3 * interval + 0.5
    # and it is evicted from the registry altogether
    await client.routes.wait_for(lambda c: c.get("doomed-1") is None, timeout=3 * interval + 2)


async def test_hung_agent_is_marked_unhealthy_within_two_probes_and_recovers_after_sigcont(
    client: ReachClient, spawn_agent: object
) -> None:
    interval = 1.0
    proc = await spawn_agent(  # type: ignore[operator]
        manifest("hung-1", interval=interval, timeout=0.3, failures=2)
    )
    await client.routes.wait_for(lambda c: _status(client, "hung-1") == "healthy", timeout=5)
    proc.signal(signal.SIGSTOP)
    stopped_at = time.monotonic()
    # new agents are probed every interval/2: two failed probes take about one interval
    await client.routes.wait_for(lambda c: _status(client, "hung-1") == "unhealthy", timeout=3)
    assert time.monotonic() - stopped_at <= 2 * interval + 0.5
    inst = client.routes.get("hung-1")
    assert inst is not None
    assert "probe" in inst.status_reason or "heartbeat" in inst.status_reason
    proc.signal(signal.SIGCONT)
    await client.routes.wait_for(lambda c: _status(client, "hung-1") == "healthy", timeout=5)


async def test_not_ready_agent_is_degraded_and_healthy_again_when_ready(
    client: ReachClient, spawn_agent: object, tmp_path: Path
) -> None:
    flag = tmp_path / "pool-saturated"
    await spawn_agent(manifest("pool-1"), not_ready_file=flag)  # type: ignore[operator]
    await client.routes.wait_for(lambda c: _status(client, "pool-1") == "healthy", timeout=5)
    flag.touch()
    await client.routes.wait_for(lambda c: _status(client, "pool-1") == "degraded", timeout=5)
    inst = client.routes.get("pool-1")
    assert inst is not None
    assert "connection pool 85% used" in inst.status_reason
    assert inst.readiness.details == {"pool": 0.85}
    flag.unlink()
    await client.routes.wait_for(lambda c: _status(client, "pool-1") == "healthy", timeout=5)


async def test_duplicate_live_agent_id_is_refused_and_a_dead_one_is_replaced(
    client: ReachClient, spawn_agent: object, nats_server: NatsServer
) -> None:
    first = await spawn_agent(manifest("dup-1", interval=5.0, timeout=0.5))  # type: ignore[operator]
    await client.routes.wait_for(lambda c: c.get("dup-1") is not None, timeout=5)
    original = client.routes.get("dup-1")
    assert original is not None

    twin = Agent(manifest("dup-1", interval=5.0, timeout=0.5), servers=nats_server.url)
    twin.capability("echo")(_echo)
    await asyncio_sleep_past_grace()
    with pytest.raises(RegistrationRefused, match="already live") as refused:
        async with twin:
            pass
    assert "dup-1" in str(refused.value)
    still = client.routes.get("dup-1")
    assert still is not None
    assert still.instance_id == original.instance_id

    first.kill()
    replacement = Agent(manifest("dup-1", interval=5.0, timeout=0.5), servers=nats_server.url)
    replacement.capability("echo")(_echo)
    async with replacement:
        await client.routes.wait_for(
            lambda c: (
                (i := c.get("dup-1")) is not None and i.instance_id == replacement.instance_id
            ),
            timeout=5,
        )
        inst = client.routes.get("dup-1")
        assert inst is not None
        assert any("replaced dead instance" in t.reason for t in inst.transitions)


async def _echo(req: object) -> object:
    return req


async def asyncio_sleep_past_grace() -> None:
    import asyncio

    await asyncio.sleep(RegistrarConfig().duplicate_grace_sec)


async def test_registrar_restart_keeps_every_record(nats_server: NatsServer) -> None:
    conn = await connect([nats_server.url], name="r1")
    reg = Registrar(conn, RegistrarConfig())
    await reg.start()
    agents = [Agent(manifest(f"keep-{i}", interval=1.0), servers=nats_server.url) for i in range(5)]
    for a in agents:
        a.capability("echo")(_echo)
        await a.start()
    await reg.stop()
    await conn.close()

    conn2 = await connect([nats_server.url], name="r2")
    reg2 = Registrar(conn2, RegistrarConfig())
    await reg2.start()
    try:
        assert sorted(i.agent_id for i in reg2.instances()) == [f"keep-{i}" for i in range(5)]
    finally:
        for a in agents:
            await a.stop()
        await reg2.stop()
        await conn2.close()


async def test_two_registrars_at_once_lose_no_update(nats_server: NatsServer) -> None:
    conns = [await connect([nats_server.url], name=f"r{i}") for i in range(2)]
    regs = [Registrar(c, RegistrarConfig(liveness_interval_sec=0.2)) for c in conns]
    for r in regs:
        await r.start()
    agents = [
        Agent(manifest(f"many-{i}", interval=0.3), servers=nats_server.url) for i in range(20)
    ]
    try:
        for a in agents:
            a.capability("echo")(_echo)
        import asyncio

        await asyncio.gather(*(a.start() for a in agents))
        watcher_conn = await connect([nats_server.url], name="watch")
        from reach.registry.store import RegistryStore

        cache = RouteCache(await RegistryStore.open(watcher_conn, create=False))
        await cache.start()
        try:
            await cache.wait_for(lambda c: len(c.all()) == 20, timeout=5)
            # the registrars split the heartbeats (by partition) and write with CAS: a
            # change every heartbeat reports (load at saturation) reaches every record
            first = {i.agent_id: i.in_flight for i in cache.all()}
            for a in agents:
                a._server.in_flight = 1
            await cache.wait_for(
                lambda c: all(i.in_flight == 1 for i in c.all()) and len(c.all()) == 20,
                timeout=5,
            )
            for a in agents:
                a._server.in_flight = 0
            assert set(first) == {f"many-{i}" for i in range(20)}
            assert all(i.status == "healthy" for i in cache.all())
        finally:
            await cache.stop()
            await watcher_conn.close()
    finally:
        for a in agents:
            await a.stop()
        for r in regs:
            await r.stop()
        for c in conns:
            await c.close()


async def test_probe_latency_is_recorded_and_rides_along_with_the_next_change(
    client: ReachClient, registrar: Registrar, nats_server: NatsServer
) -> None:
    """An instance's first probe latency is written (what `reach agents` shows in its
    probe column); a later successful probe that changes nothing is not a KV write of its
    own, but reaches the record with the next change a heartbeat brings."""
    agent = Agent(manifest("probed-1", interval=0.3), servers=nats_server.url)

    @agent.capability("echo")
    async def handle(req: dict[str, object]) -> dict[str, object]:
        return req

    async with agent:
        await client.routes.wait_for(
            lambda c: (i := c.get("probed-1")) is not None and i.last_probe_ms is not None,
            timeout=5,
        )
        first = client.routes.get("probed-1")
        assert first is not None
        assert first.last_probe_at is not None
        assert first.last_probe_ms is not None
        assert first.last_probe_ms >= 0
        # probes every 0.15 s (a new agent), heartbeats every 0.3 s: once a newer probe
        # waits unwritten and a heartbeat brings a change (saturation), it rides along
        policy = registrar._policy
        await until(
            lambda: (
                (p := policy.unwritten_probe("probed-1")) is not None
                and p[0] > (first.last_probe_at or 0)
            ),
            "a newer probe waiting unwritten",
        )
        agent._server.in_flight = agent.manifest.max_concurrency
        await client.routes.wait_for(
            lambda c: (
                (i := c.get("probed-1")) is not None
                and (i.last_probe_at or 0) > (first.last_probe_at or 0)
            ),
            timeout=5,
        )
        later = client.routes.get("probed-1")
        agent._server.in_flight = 0
        assert later is not None
        assert later.last_heartbeat_at > first.last_heartbeat_at


# -- an agent with no registrar --------------------------------------------------------


async def test_an_agent_without_a_registrar_fails_to_start_with_a_discovery_error(
    nats_server: NatsServer,
) -> None:
    """With no registrar to answer its announce, ``start()`` raises the documented
    DiscoveryError, compiled as in pure Python (in a compiled coroutine, an await inside
    an except block can let nats-py's own NoRespondersError escape instead)."""
    agent = Agent(
        {
            "agent_id": "lonely-1",
            "agent_name": "lonely",
            "version": "1.0.0",
            "capabilities": [{"name": "echo", "security_level": 1}],
        },
        servers=nats_server.url,
        announce_timeout=1.0,
    )

    @agent.capability("echo")
    async def echo(req: Any) -> Any:
        return req

    # awaited directly (announce_timeout bounds it): inside a wait_for task, compiled
    # code can raise the right error where a direct await does not
    with pytest.raises(DiscoveryError, match="no registrar answered") as caught:
        await agent.start()
    assert "reach up" in str(caught.value)
    # handled is handled: nothing is left behind as the current exception (compiled, an
    # await in the clean-up's except block would leave it there for the next error to
    # chain to)
    assert sys.exc_info() == (None, None, None)


# -- a huge readiness reason -----------------------------------------------------------

#: the longest reason a record keeps (reach.wire.models.MAX_REASON)
MAX_REASON = 500


async def test_flips_with_a_huge_readiness_reason_keep_the_record_small_and_current(
    nats_server: NatsServer, registrar: Registrar, client: ReachClient, conn: Connection
) -> None:
    state = {"ready": True}

    def readiness() -> Readiness:
        if state["ready"]:
            return Readiness(ready=True)
        return Readiness(ready=False, reason="pool exhausted: " + "x" * 250_000)

    # heartbeats are sent by the test (a long interval: none of the agent's own), no more
    # than the registrar takes at once from one agent id (reach.registry.controlbudget.BURST)
    agent, _ = make_agent(
        nats_server.url,
        "bloat-1",
        capability("work"),
        readiness=readiness,
        health={"interval_sec": 60, "timeout_sec": 2, "failures_before_unhealthy": 2},
    )
    bucket = await conn.key_value(subjects.REGISTRY_BUCKET)
    async with agent:
        await wait_routable(client, "work", 1)
        for flip in range(2):
            state["ready"] = flip % 2 == 1  # not ready, ready
            await agent._presence.send_heartbeat()  # answered (it raises on no answer)
        state["ready"] = False
        await agent._presence.send_heartbeat()
        entry = await bucket.get(subjects.agent_key("bloat-1"))
        assert entry is not None
        assert len(entry.value) < 64 * 1024
        record = decode_instance(entry.value)
        assert record.status == "degraded"
        assert record.readiness.reason.startswith("pool exhausted: ")
        assert len(record.readiness.reason) == MAX_REASON
        assert len(record.status_reason) <= MAX_REASON
        assert all(len(t.reason) <= MAX_REASON for t in record.transitions)
        # callers' route caches follow it
        await client.routes.wait_for(
            lambda c: (i := c.get("bloat-1")) is not None and i.status == "degraded", timeout=5
        )
        # and back
        state["ready"] = True
        await agent._presence.send_heartbeat()
        await client.routes.wait_for(
            lambda c: (i := c.get("bloat-1")) is not None and i.status == "healthy", timeout=5
        )


# -- a heartbeat does not clear failing probes -----------------------------------------


async def test_an_instance_whose_probes_fail_stays_unhealthy_while_it_heartbeats(
    nats_server: NatsServer, registrar: Registrar
) -> None:
    async def slow_readiness() -> Readiness:
        await asyncio.sleep(0.35)  # longer than the probe timeout: every probe times out
        return Readiness()

    # heartbeats come every ~1.1 s (0.8 s + the check), never 2 intervals apart: never
    # "missed"; new agents are probed every 0.4 s, so two probes fail between heartbeats
    health = {"interval_sec": 0.8, "timeout_sec": 0.2, "failures_before_unhealthy": 2}
    agent, _ = make_agent(
        nats_server.url, "flap-1", capability("flap_cap"), readiness=slow_readiness, health=health
    )

    async def status() -> Instance:
        record = await registrar.store.get("flap-1")
        assert record is not None, "evicted: heartbeats did not arrive"
        return record[0]

    async def unhealthy() -> bool:
        return (await status()).status == "unhealthy"

    async with agent:
        await until(unhealthy, "probe failures marked it unhealthy", timeout=5, interval=0.05)
        marked = len((await status()).transitions)
        # three heartbeat intervals: each heartbeat arrives, none makes it healthy again
        seen: set[str] = set()
        heartbeats: set[float] = set()
        deadline = time.monotonic() + 2.5
        while time.monotonic() < deadline:
            inst = await status()
            seen.add(inst.status)
            heartbeats.add(registrar._policy.heard_at("flap-1") or 0.0)
            await asyncio.sleep(0.05)
    assert seen == {"unhealthy"}
    assert len(heartbeats) >= 2  # heartbeats did arrive (heard, not written) meanwhile
    assert inst.consecutive_failures >= 2
    assert "probe failures" in inst.status_reason
    later = inst.transitions[marked:]
    assert [t.status for t in later] == [], later
