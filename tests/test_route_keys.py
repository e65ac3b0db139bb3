"""Route keys and the caches that follow only the capabilities they use.

Every instance record ``agent.<id>`` has a route key ``cap.<capability>.<id>`` per
capability it serves (reach.registry.store); a caller's route cache follows the route
keys of the capabilities it calls or asks about, never the rest of the registry
(reach.caller.routecache). What is in the bucket is read with plain nats-py, as any
NATS client would see it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import nats
import pytest

from reach.caller.client import ReachClient
from reach.caller.routecache import RouteCache
from reach.registry.store import RegistryStore, route_key
from reach.tasks import cancel_and_wait
from reach.testing import NatsServer
from reach.transport import Connection, connect
from reach.wire import subjects
from reach.wire.modelcodec import encode_model
from reach.wire.models import Instance

from .calls_helpers import capability as capability_spec
from .calls_helpers import make_agent
from .routing_helpers import instance

#: a bound on waits for a change to arrive
SETTLE = 5.0


@pytest.fixture
async def store(nats_server: NatsServer) -> AsyncIterator[RegistryStore]:
    """The registry as a registrar writes it (creating the bucket)."""
    conn = await connect([nats_server.url], name="writer")
    try:
        yield await RegistryStore.open(conn)
    finally:
        await conn.close()


@pytest.fixture
async def reader(nats_server: NatsServer) -> AsyncIterator[Connection]:
    conn = await connect([nats_server.url], name="reader")
    try:
        yield conn
    finally:
        await conn.close()


async def _keys(url: str) -> set[str]:
    """The live keys of the registry, as a plain NATS client lists them."""
    nc = await nats.connect(url)
    try:
        kv = await nc.jetstream().key_value(subjects.REGISTRY_BUCKET)
        try:
            return set(await kv.keys())
        except nats.js.errors.NoKeysError:
            return set()
    finally:
        await nc.close()


def _with_status(inst: Instance, status: str) -> Instance:
    return inst.model_copy(update={"status": status})


async def _cache(conn: Connection) -> RouteCache:
    cache = RouteCache(await RegistryStore.open(conn, create=False), follow_all=False)
    await cache.start()
    return cache


async def test_each_capability_of_a_record_has_a_route_key_and_it_goes_with_the_record(
    store: RegistryStore, nats_server: NatsServer
) -> None:
    both = instance("both-1", capabilities=("alpha", "beta"))
    rev = await store.create(both)
    assert await _keys(nats_server.url) == {
        "agent.both-1",
        route_key("alpha", "both-1"),
        route_key("beta", "both-1"),
    }
    # the new version no longer serves beta: its route key goes
    rev = await store.update(instance("both-1", capabilities=("alpha",)), rev)
    assert await _keys(nats_server.url) == {"agent.both-1", route_key("alpha", "both-1")}
    await store.delete("both-1", last=rev)
    assert await _keys(nats_server.url) == set()


async def test_a_store_that_did_not_see_the_record_still_removes_its_route_keys(
    store: RegistryStore, nats_server: NatsServer, reader: Connection
) -> None:
    """Another registrar (a store that never wrote nor read the record) updates and
    deletes it: it reads which route keys the record has."""
    rev = await store.create(instance("other-1", capabilities=("alpha", "beta")))
    other = RegistryStore(
        (await RegistryStore.open(reader, create=False)).bucket
    )  # remembers nothing
    rev = await other.update(instance("other-1", capabilities=("beta",)), rev)
    assert await _keys(nats_server.url) == {"agent.other-1", route_key("beta", "other-1")}
    await RegistryStore(other.bucket).delete("other-1", last=rev)
    assert await _keys(nats_server.url) == set()


async def test_a_cache_following_one_capability_receives_nothing_of_another(
    store: RegistryStore, reader: Connection
) -> None:
    revs = {}
    for i in range(5):
        revs[f"a-{i}"] = await store.create(instance(f"a-{i}", capabilities=("alpha",)))
        revs[f"b-{i}"] = await store.create(instance(f"b-{i}", capabilities=("beta",)))
    cache = await _cache(reader)
    try:
        assert cache.records == 0  # nothing is followed before it is used
        await cache.follow("alpha")
        assert {i.agent_id for i in cache.find("alpha")} == {f"a-{i}" for i in range(5)}
        assert cache.records == 5
        # heartbeats of beta's instances: many writes, none reaches this cache
        for _ in range(10):
            for i in range(5):
                b = f"b-{i}"
                revs[b] = await store.update(instance(b, capabilities=("beta",)), revs[b])
        revs["a-0"] = await store.update(
            _with_status(instance("a-0", capabilities=("alpha",)), "degraded"), revs["a-0"]
        )
        await cache.wait_for(lambda c: c.find("alpha")[0].status == "degraded", SETTLE)
        assert cache.records == 6
        assert cache.followed() == ["alpha"]
        assert cache.find("beta") == []  # asked about now: followed from now on
        subscribed = {s.subject for s in reader._nc._subs.values()}
        prefix = f"reach.v1.kv.{subjects.REGISTRY_BUCKET}"
        assert f"{prefix}.{route_key('alpha', '>')}" in subscribed
        assert not any(
            s.startswith(prefix) and ".beta." not in s and ".alpha." not in s for s in subscribed
        )
    finally:
        await cache.stop()


async def test_a_followed_capability_shows_its_announces_health_changes_and_evictions(
    store: RegistryStore, reader: Connection
) -> None:
    cache = await _cache(reader)
    try:
        await cache.follow("alpha")
        assert cache.find("alpha") == []
        rev = await store.create(instance("new-1", capabilities=("alpha", "beta")))
        await cache.wait_for(lambda c: c.find("alpha"), SETTLE)
        rev = await store.update(
            _with_status(instance("new-1", capabilities=("alpha", "beta")), "unhealthy"), rev
        )
        await cache.wait_for(lambda c: not c.find("alpha"), SETTLE)
        assert [i.status for i in c_find(cache)] == ["unhealthy"]
        # it stops serving alpha but stays registered (for beta): gone from alpha's routes
        rev = await store.update(instance("new-1", capabilities=("beta",)), rev)
        await cache.wait_for(lambda c: not c_find(c), SETTLE)
        rev = await store.update(instance("new-1", capabilities=("alpha",)), rev)
        await cache.wait_for(lambda c: c.find("alpha"), SETTLE)
        await store.delete("new-1", last=rev)
        await cache.wait_for(lambda c: not c_find(c), SETTLE)
    finally:
        await cache.stop()


def c_find(cache: RouteCache) -> list[Instance]:
    return cache.find("alpha", include_unhealthy=True)


async def test_past_the_bound_the_capability_used_least_recently_is_no_longer_followed(
    store: RegistryStore, reader: Connection
) -> None:
    for name in ("c0", "c1", "c2"):
        await store.create(instance(f"{name}-1", capabilities=(name,)))
    cache = await _cache(reader)
    cache.max_followed = 2
    try:
        await cache.follow("c0")
        await cache.follow("c1")
        assert cache.ready("c0")  # c0 used again: c1 is the least recently used
        await cache.follow("c2")
        assert sorted(cache.followed()) == ["c0", "c2"]
        assert [i.agent_id for i in cache.find("c2")] == ["c2-1"]
        assert cache.entries("c1") == []  # what it indexed went with it
        await cache.follow("c1")  # back within one scan
        assert [i.agent_id for i in cache.find("c1")] == ["c1-1"]
    finally:
        await cache.stop()


async def test_a_lookup_of_the_whole_registry_follows_all_of_it(
    store: RegistryStore, reader: Connection
) -> None:
    await store.create(instance("x-1", capabilities=("alpha",)))
    await store.create(instance("y-1", capabilities=("beta",)))
    cache = await _cache(reader)
    try:
        assert cache.all() == []  # not followed yet: it is, from now on
        await cache.wait_for(lambda c: len(c.all()) == 2, SETTLE)
        assert cache.follow_all
        await store.create(instance("z-1", capabilities=("gamma",)))
        await cache.wait_for(lambda c: c.get("z-1") is not None, SETTLE)
    finally:
        await cache.stop()


async def test_route_keys_left_out_of_step_by_a_dead_writer_are_repaired(
    store: RegistryStore, nats_server: NatsServer
) -> None:
    """A registrar that died between an instance record and its route keys: a route key
    missing, one stale, one of a record that is gone. A registrar's watch puts them back
    in step; a caller following the capability then sees the record as it is."""
    bucket = store.bucket
    fresh = instance("half-1", capabilities=("alpha",))
    await bucket.create("agent.half-1", encode_model(fresh))  # no route key
    rev = await store.create(instance("old-1", capabilities=("alpha",)))
    await bucket.update(
        "agent.old-1",
        encode_model(_with_status(instance("old-1", capabilities=("alpha",)), "degraded")),
        rev,
    )
    await bucket.put(route_key("alpha", "gone-1"), encode_model(instance("gone-1")))

    watcher = RegistryStore(bucket, repair=True)
    assert watcher.repair is not None
    watcher.repair.after = 0.2

    async def watch() -> None:
        async for _ in watcher.watch():
            pass

    task = asyncio.create_task(watch())
    try:
        conn = await connect([nats_server.url], name="caller")
        cache = await _cache(conn)
        try:
            await cache.follow("alpha")
            await cache.wait_for(
                lambda c: (
                    {i.agent_id: i.status for i in c.find("alpha", include_unhealthy=True)}
                    == {"half-1": "healthy", "old-1": "degraded"}
                ),
                SETTLE,
            )
        finally:
            await cache.stop()
            await conn.close()
        assert await _keys(nats_server.url) == {
            "agent.half-1",
            "agent.old-1",
            route_key("alpha", "half-1"),
            route_key("alpha", "old-1"),
        }
    finally:
        await cancel_and_wait([task])
        await watcher.repair.stop()


async def test_a_client_learns_a_capability_on_its_first_call(
    client: ReachClient, nats_server: NatsServer
) -> None:
    agent, _ = make_agent(nats_server.url, "first-1", capability_spec("echo"))
    await agent.start()
    try:
        assert client.routes.followed() == []
        result = await client.call("echo", {"text": "hi"})
        assert result.agent_id == "first-1"
        assert client.routes.followed() == ["echo"]
        assert [i.agent_id for i in await client.discover("echo")] == ["first-1"]
        assert client.routes.records >= 1
    finally:
        await agent.stop()


async def test_a_followed_capability_survives_a_server_restart_and_loses_no_change(
    nats_server: NatsServer,
) -> None:
    """The server under a following cache is restarted (its JetStream kept on disk);
    changes made while the cache's connection was away (a record deleted, another one
    written) are all in the cache once it is back, and nothing else is."""
    writer = await connect([nats_server.url], name="writer")
    reader = await connect([nats_server.url], name="reader")
    try:
        store = await RegistryStore.open(writer)
        rev = await store.create(instance("keep-1", capabilities=("alpha",)))
        doomed = await store.create(instance("doomed-1", capabilities=("alpha",)))
        cache = await _cache(reader)
        try:
            await cache.follow("alpha")
            assert {i.agent_id for i in cache.find("alpha")} == {"keep-1", "doomed-1"}
            reconnected = asyncio.Event()
            reader.on_reconnect(reconnected.set)
            writer_back = asyncio.Event()
            writer.on_reconnect(writer_back.set)
            await asyncio.to_thread(nats_server.restart)
            async with asyncio.timeout(20):
                await writer_back.wait()
            # written as soon as the writer is back: the reader may still be away
            await store.delete("doomed-1", last=doomed)
            await store.create(instance("new-1", capabilities=("alpha",)))
            await store.update(
                _with_status(instance("keep-1", capabilities=("alpha",)), "degraded"), rev
            )
            async with asyncio.timeout(20):
                await reconnected.wait()
            await cache.wait_for(
                lambda c: (
                    {i.agent_id: i.status for i in c.find("alpha")}
                    == {"keep-1": "degraded", "new-1": "healthy"}
                ),
                20,
            )
        finally:
            await cache.stop()
    finally:
        await reader.close()
        await writer.close()
