"""A registrar evicts instances that went silent, never ones whose heartbeats it missed.

Against a real nats-server; the registrar's clock is a ManualClock so that "silent for 3
intervals" is reached by advancing it, not by waiting.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from typing import Any

import pytest

from reach.agent.agent import Agent
from reach.clock import ManualClock
from reach.errors import ReachTimeout
from reach.registry import Registrar, RegistrarConfig
from reach.registry.store import RegistryStore
from reach.tasks import cancel_and_wait
from reach.testing import NatsServer
from reach.transport import Connection, KVConflict, connect
from reach.wire.models import Instance, Manifest, Readiness

from .conftest import manifest
from .poll_helpers import until

INTERVAL = 1.0


@pytest.fixture
async def clock_registrar(
    nats_server: NatsServer,
) -> AsyncIterator[tuple[Registrar, ManualClock, Connection]]:
    clock = ManualClock(wall=1_700_000_000.0)
    conn = await connect([nats_server.url], name="test-registrar")
    other = await connect([nats_server.url], name="test-other-writer")
    reg = Registrar(conn, RegistrarConfig(clock=clock, liveness_interval_sec=3600.0))
    await reg.start()
    yield reg, clock, other
    await reg.stop()
    await other.close()
    await conn.close()


def _record(agent_id: str, heard_at: float) -> Instance:
    return Instance(
        manifest=Manifest.model_validate(manifest(agent_id, interval=INTERVAL)),
        instance_id=f"{agent_id}-i",
        registered_at=heard_at,
        last_heartbeat_at=heard_at,
    )


async def test_an_eviction_is_checked_again_on_the_record_as_it_is_now(
    clock_registrar: tuple[Registrar, ManualClock, Connection],
) -> None:
    """A heartbeat another registrar recorded, which this one's registry watch has not
    shown yet, keeps the instance: the eviction's compare-and-set fails, and the fresh
    record is not silent."""
    reg, clock, other = clock_registrar
    store = await RegistryStore.open(other, create=False)
    revision = await store.create(_record("quiet-1", clock.time()))
    await until(lambda: "quiet-1" in reg._records, "the registrar sees the record")
    # this registrar's view stops here (its watch lags behind, as after a reconnect) ...
    watch = reg._loops[0]
    await cancel_and_wait([watch])
    clock.advance(5 * INTERVAL)
    # ... while another registrar records a heartbeat
    heard = _record("quiet-1", clock.time()).model_copy(update={"registered_at": 0.0})
    await store.update(heard, revision)
    await reg._sweep()
    kept = await store.get("quiet-1")
    assert kept is not None
    assert kept[0].last_heartbeat_at == clock.time()
    # really silent now: evicted
    clock.advance(5 * INTERVAL)
    await reg._sweep()
    assert await store.get("quiet-1") is None


async def test_heartbeats_heard_and_not_written_do_not_count_as_silence(
    clock_registrar: tuple[Registrar, ManualClock, Connection],
    nats_server: NatsServer,
) -> None:
    """A heartbeat that changes nothing routing reads is not written, and one the
    registry cannot take (a JetStream leader election in a cluster) is not either: both
    arrived, so the instance is not evicted for the silence of its record. A silent one
    beside it still is."""
    reg, clock, _ = clock_registrar
    agent = Agent(manifest("steady-1", interval=INTERVAL), servers=[nats_server.url])

    @agent.capability("echo")
    async def echo(request: Any) -> Any:
        return request

    await agent.start()
    try:
        await until(lambda: "steady-1" in reg._records, "announced")
        store = reg.store
        await store.create(_record("gone-1", clock.time()))  # never heard from again
        await until(lambda: "gone-1" in reg._records, "the silent record seen")
        write = store.update

        async def leaderless(instance: Instance, last: int) -> int:
            # only steady-1's writes fail: gone-1's record may be marked unhealthy (a
            # failed sweep would count as trouble, which holds every eviction back)
            if instance.agent_id != "steady-1":
                return await write(instance, last)
            raise ReachTimeout("no reply from the registry in time (no stream leader)")

        store.update = leaderless  # type: ignore[method-assign]
        written = reg._records["steady-1"][0].last_heartbeat_at
        # The record's heartbeat grows 5 intervals old, one interval at a time, each step
        # only once a heartbeat arrived after it: the registrar's own sweeps, which run
        # meanwhile, never see the instance silent for more than one interval.
        for _ in range(5):
            clock.advance(INTERVAL)
            now = clock.time()
            await until(
                lambda now=now: reg._policy.heard_at("steady-1") == now, "a heartbeat heard"
            )
        await reg._sweep()
        store.update = write  # type: ignore[method-assign]
        assert "steady-1" in reg._records
        kept = await store.get("steady-1")
        assert kept is not None
        assert kept[0].last_heartbeat_at == written  # never rewritten for a heartbeat
        assert await store.get("gone-1") is None
    finally:
        await agent.stop()


async def test_a_registrar_behind_on_its_messages_evicts_nobody(nats_server: NatsServer) -> None:
    """Overloaded (heartbeats waiting to be handled), a registrar must not read the
    records those heartbeats would refresh as silence: no eviction until it catches up."""
    clock = ManualClock(wall=1_700_000_000.0)
    conn = await connect([nats_server.url], name="test-registrar")
    reg = Registrar(conn, RegistrarConfig(clock=clock, liveness_interval_sec=3600.0, max_backlog=2))
    await reg.start()
    interval = 0.2
    beats = itertools.count()
    # every heartbeat changes what it reports of its readiness: each is written
    agent = Agent(
        manifest("busy-1", interval=interval),
        servers=[nats_server.url],
        readiness=lambda: Readiness(reason=f"beat {next(beats)}"),
    )

    @agent.capability("echo")
    async def echo(request: Any) -> Any:
        return request

    await agent.start()
    gate = asyncio.Event()
    try:
        await until(lambda: "busy-1" in reg._records, "announced")
        store = reg.store
        write = store.update

        async def slow(instance: Instance, last: int) -> int:
            await gate.wait()  # a registry that answers late: heartbeats pile up
            return await write(instance, last)

        store.update = slow  # type: ignore[method-assign]
        await until(lambda: reg._handling > 2, "heartbeats waiting to be handled")
        clock.advance(10 * interval)  # the record now looks silent for 10 intervals
        await reg._sweep()
        assert "busy-1" in reg._records
        assert await store.get("busy-1") is not None
    finally:
        gate.set()
        await agent.stop()
        await reg.stop()
        await conn.close()


async def test_time_a_registrar_spends_disconnected_is_not_silence(nats_server: NatsServer) -> None:
    """Cut off from NATS it hears no heartbeats: once back, instances get their full
    eviction window from then (the connection tells it when it is back)."""
    clock = ManualClock(wall=1_700_000_000.0)
    conn = await connect([nats_server.url], name="test-registrar")
    reg = Registrar(conn, RegistrarConfig(clock=clock, liveness_interval_sec=3600.0))
    await reg.start()
    other = await connect([nats_server.url], name="test-other-writer")
    try:
        store = await RegistryStore.open(other, create=False)
        await store.create(_record("quiet-1", clock.time()))
        await until(lambda: "quiet-1" in reg._records, "the registrar sees the record")
        await asyncio.to_thread(nats_server.stop_now)
        clock.advance(5 * INTERVAL)  # away for 5 intervals
        await asyncio.to_thread(nats_server.start_now)
        await until(lambda: conn.is_connected and reg._trouble_at == clock.time(), "back")
        await reg._sweep()
        assert await store.get("quiet-1") is not None
        clock.advance(5 * INTERVAL)  # now really silent since it is back
        await reg._sweep()
        assert await store.get("quiet-1") is None
    finally:
        await reg.stop()
        await other.close()
        await conn.close()


async def test_reconnect_listeners_run_each_time_and_a_failing_one_harms_none(
    nats_server: NatsServer,
) -> None:
    conn = await connect([nats_server.url], name="test-listener")
    calls: list[str] = []

    def broken() -> None:
        calls.append("broken")
        raise RuntimeError("a bug in a listener")

    conn.on_reconnect(broken)
    conn.on_reconnect(lambda: calls.append("ok"))
    try:
        for n in (1, 2):
            await asyncio.to_thread(nats_server.restart)
            await until(lambda n=n: calls.count("ok") == n, f"reconnect {n}")  # type: ignore[misc]
            assert conn.is_connected
        assert calls == ["broken", "ok", "broken", "ok"]
    finally:
        await conn.close()


async def test_a_sweep_looks_again_at_a_record_that_changed_before_its_time_was_due(
    clock_registrar: tuple[Registrar, ManualClock, Connection],
) -> None:
    """The sweep passes over a record until something may be due about it; a record
    written meanwhile (a silent instance made healthy again by another writer) is looked
    at again at the next sweep: still silent, it is marked unhealthy again at once."""
    reg, clock, other = clock_registrar
    store = await RegistryStore.open(other, create=False)
    await store.create(_record("remarked-1", clock.time()))
    await until(lambda: "remarked-1" in reg._records, "the registrar sees the record")
    await reg._sweep()
    assert reg._records["remarked-1"][0].status == "healthy"
    clock.advance(2.5 * INTERVAL)  # missed two heartbeats: marked
    await reg._sweep()
    assert reg._records["remarked-1"][0].status == "unhealthy"
    for _ in range(5):  # its probes (nobody answers) write the record too
        found = await store.get("remarked-1")
        assert found is not None
        healed = found[0].model_copy(update={"status": "healthy", "status_reason": "by hand"})
        try:
            await store.update(healed, found[1])
            break
        except KVConflict:
            continue
    await until(lambda: reg._records["remarked-1"][0].status == "healthy", "the watch")
    clock.advance(0.01)  # well before its eviction, the next thing due
    await reg._sweep()
    again = reg._records["remarked-1"][0]
    assert again.status == "unhealthy"
    assert again.status_reason.startswith("missed 2 heartbeats"), again.status_reason
    clock.advance(1.0 * INTERVAL)  # three intervals silent: evicted
    await reg._sweep()
    assert "remarked-1" not in reg._records
