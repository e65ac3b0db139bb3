"""Registration, discovery and health, against a real nats-server with agents as processes."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from reach.agent import Agent
from reach.client import ReachClient
from reach.errors import RegistrationRefused
from reach.registry import Registrar, RegistrarConfig
from reach.registry.routecache import RouteCache
from reach.testing import NatsServer
from reach.transport import connect

from .conftest import manifest


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
            # both registrars handle heartbeats (queue group) and both write with CAS
            first = {i.agent_id: i.completed for i in cache.all()}
            for a in agents:
                a._server.completed = 7
            await cache.wait_for(
                lambda c: all(i.completed == 7 for i in c.all()) and len(c.all()) == 20,
                timeout=5,
            )
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


async def test_probe_latency_is_recorded_and_kept_fresh_by_heartbeats_alone(
    client: ReachClient, registrar: Registrar, nats_server: NatsServer
) -> None:
    """A successful probe that changes nothing is not a KV write of its own, but what it
    measured reaches the record with the next heartbeat (what `reach agents` shows in its
    probe column)."""
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
        # probes every 0.15 s (a new agent), heartbeats every 0.3 s: newer probes arrive
        await client.routes.wait_for(
            lambda c: (
                (i := c.get("probed-1")) is not None
                and (i.last_probe_at or 0) > (first.last_probe_at or 0)
            ),
            timeout=5,
        )
        later = client.routes.get("probed-1")
        assert later is not None
        assert later.status == "healthy"
        assert later.last_heartbeat_at > first.last_heartbeat_at
