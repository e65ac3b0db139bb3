"""Process-wide settings: the garbage collector of a process that follows a registry.

Full collections are counted while none is ever due on its own, so a count is exactly
what the code under test ran."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import AsyncIterator, Iterator

import pytest

from reach.caller.routecache import RouteCache
from reach.errors import ReachError
from reach.registry.instances import RecordView
from reach.registry.ownership import Ownership
from reach.registry.store import RecordChange, RegistryStore
from reach.registry.watch import RegistryWatch
from reach.runtime import REGISTRY_GC_THRESHOLD, SETTLE_AFTER_RECORDS, settle_after_load, tune_gc
from reach.testing import NatsServer
from reach.transport import connect
from reach.wire.models import Instance

from .routing_helpers import instance


@pytest.fixture
def thresholds() -> Iterator[None]:
    saved = gc.get_threshold()
    try:
        yield
    finally:
        gc.set_threshold(*saved)


@pytest.mark.usefixtures("thresholds")
def test_full_collections_become_rare_and_younger_ones_stay_as_they_were() -> None:
    gc.set_threshold(700, 10, 10)  # Python's defaults
    tune_gc()
    assert gc.get_threshold() == (700, 10, REGISTRY_GC_THRESHOLD)


@pytest.mark.usefixtures("thresholds")
def test_a_higher_threshold_set_by_the_application_is_kept() -> None:
    gc.set_threshold(5000, 20, 50_000)
    tune_gc()
    assert gc.get_threshold() == (5000, 20, 50_000)


@pytest.mark.usefixtures("thresholds")
def test_cycles_are_still_collected_by_the_young_generation() -> None:
    tune_gc()

    class Node:
        other: object = None

    a, b = Node(), Node()
    a.other, b.other = b, a
    alive = weakref.ref(a)
    del a, b
    gc.collect(0)  # the youngest generation only: no full collection needed
    assert alive() is None


@pytest.fixture
def full_collections(thresholds: None) -> Iterator[list[int]]:
    """The full collections run while the test runs, with automatic collection on but
    never due (a youngest generation that never fills): only those something asked for
    are counted."""
    seen: list[int] = []

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "stop" and info["generation"] == 2:
            seen.append(1)

    assert gc.isenabled()
    gc.set_threshold(1 << 30, 10, 10)
    gc.callbacks.append(count)
    try:
        yield seen
    finally:
        gc.callbacks.remove(count)


def test_a_large_load_is_followed_by_one_full_collection(full_collections: list[int]) -> None:
    settle_after_load(SETTLE_AFTER_RECORDS - 1)
    assert full_collections == []
    settle_after_load(SETTLE_AFTER_RECORDS)
    assert full_collections == [1]


def test_an_application_that_turned_collection_off_is_left_to_run_its_own(
    full_collections: list[int],
) -> None:
    gc.disable()
    try:
        settle_after_load(10 * SETTLE_AFTER_RECORDS)
    finally:
        gc.enable()
    assert full_collections == []


async def test_a_route_cache_takes_the_collection_its_first_load_of_the_registry_made_due(
    nats_server: NatsServer, full_collections: list[int]
) -> None:
    """A cache that loads a large registry collects once before it says it is caught up,
    instead of leaving a full collection (a pause that grows with the registry) due for
    the first changes it applies; a small load, the changes after a load and a cache that
    follows capabilities only do not collect."""
    writer = await connect([nats_server.url], name="writer")
    reader = await connect([nats_server.url], name="reader")
    caches: list[RouteCache] = []
    try:
        store = await RegistryStore.open(writer)

        async def add(first: int, last: int) -> None:
            names = [f"rt-{i}" for i in range(first, last)]
            await asyncio.gather(
                *(store.create(instance(n, capabilities=("echo",))) for n in names)
            )

        async def cache(follow_all: bool) -> RouteCache:
            caches.append(
                RouteCache(await RegistryStore.open(reader, create=False), follow_all=follow_all)
            )
            await caches[-1].start(60.0)
            return caches[-1]

        await add(0, 50)
        small = await cache(True)
        assert full_collections == []
        caught_up = asyncio.Event()

        def on_change(_agent_id: str, _inst: Instance | None) -> None:
            if len(small.all()) >= SETTLE_AFTER_RECORDS:
                caught_up.set()

        small.on_change(on_change)
        await add(50, SETTLE_AFTER_RECORDS)
        await asyncio.wait_for(caught_up.wait(), 60.0)
        assert full_collections == []  # changes, not a load
        some = await cache(False)
        await some.follow("echo", 60.0)
        assert len(list(some.for_capability("echo"))) == SETTLE_AFTER_RECORDS
        assert full_collections == []  # a capability's instances: not the registry
        large = await cache(True)
        assert len(large.all()) == SETTLE_AFTER_RECORDS
        assert full_collections == [1]
    finally:
        for each in caches:
            await each.stop()
        await reader.close()
        await writer.close()


def test_a_registrar_takes_the_collection_its_first_load_of_the_registry_made_due(
    full_collections: list[int],
) -> None:
    """The registrar's watch collects once when its first load of a large registry is
    done, not when it catches up again after a restart of the watch."""
    view = RecordView()
    watch = RegistryWatch(
        view, Ownership("reg-1"), alerts=None, on_trouble=lambda: None, running=lambda: True
    )
    for n in range(SETTLE_AFTER_RECORDS):
        watch.apply(RecordChange(f"agent.rt-{n}", n + 1, instance(f"rt-{n}")))
    watch.apply(None)
    assert watch.synced.is_set()
    assert full_collections == [1]
    watch.apply(None)  # caught up again after a restart of the watch
    assert full_collections == [1]


class _WatchFailingOnce(RegistryStore):
    """The registry, whose first whole-registry watch fails right after catching up (as
    one does when its consumer is lost); ``again`` is set once the next has caught up."""

    failed = False
    again: asyncio.Event | None = None

    async def watch(self, keys: str = ">") -> AsyncIterator[RecordChange | None]:
        async for change in super().watch(keys):
            yield change
            if change is None and not self.failed:
                self.failed = True
                raise ReachError("the watch's consumer is gone")
            if change is None and self.again is not None:
                self.again.set()


async def test_a_route_cache_whose_watch_starts_again_does_not_collect_again(
    nats_server: NatsServer, full_collections: list[int]
) -> None:
    writer = await connect([nats_server.url], name="writer")
    reader = await connect([nats_server.url], name="reader")
    try:
        store = await RegistryStore.open(writer)
        names = [f"rt-{i}" for i in range(SETTLE_AFTER_RECORDS)]
        await asyncio.gather(*(store.create(instance(n)) for n in names))
        failing = await _WatchFailingOnce.open(reader, create=False)
        assert isinstance(failing, _WatchFailingOnce)
        failing.again = asyncio.Event()
        cache = RouteCache(failing, follow_all=True)
        try:
            await cache.start(60.0)
            assert full_collections == [1]
            await asyncio.wait_for(failing.again.wait(), 60.0)
            assert failing.failed
            assert len(cache.all()) == SETTLE_AFTER_RECORDS
            assert full_collections == [1]
        finally:
            await cache.stop()
    finally:
        await reader.close()
        await writer.close()


async def test_a_route_cache_that_comes_through_a_server_restart_does_not_collect_again(
    nats_server: NatsServer, full_collections: list[int]
) -> None:
    """The nats-server is stopped and started again under a cache that loaded a large
    registry: the cache follows the registry again (a record written after the restart
    reaches it), and its load's collection is not run a second time."""
    writer = await connect([nats_server.url], name="writer")
    reader = await connect([nats_server.url], name="reader")
    try:
        store = await RegistryStore.open(writer)
        names = [f"rt-{i}" for i in range(SETTLE_AFTER_RECORDS)]
        await asyncio.gather(*(store.create(instance(n)) for n in names))
        cache = RouteCache(await RegistryStore.open(reader, create=False), follow_all=True)
        arrived = asyncio.Event()

        def on_change(agent_id: str, _inst: Instance | None) -> None:
            if agent_id == "late-1":
                arrived.set()

        cache.on_change(on_change)
        try:
            await cache.start(60.0)
            assert full_collections == [1]
            back = asyncio.Event()
            writer.on_reconnect(back.set)
            nats_server.restart()
            await asyncio.wait_for(back.wait(), 30.0)
            await store.create(instance("late-1"))
            await asyncio.wait_for(arrived.wait(), 30.0)
            assert len(cache.all()) == SETTLE_AFTER_RECORDS + 1
            assert full_collections == [1]
        finally:
            await cache.stop()
    finally:
        await reader.close()
        await writer.close()
