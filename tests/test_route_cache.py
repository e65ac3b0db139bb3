"""The route cache: a caller's copy of the registry (reach.caller.routecache).

Its per-capability and per-tag lists stay in step with its index under any sequence of
registrations, updates and removals, so sampling picks only live instances; a new revision
of a record (a heartbeat) updates the lists a call already holds in place; and what a
caller keeps of an instance (its breaker, latency average, calls in flight) goes with the
instance's record."""

from __future__ import annotations

import asyncio
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from reach.caller.client import ReachClient
from reach.caller.routecache import NAMED_CANDIDATES, RouteCache
from reach.registry import Registrar
from reach.testing import NatsServer
from reach.wire.models import Instance, Manifest

from .calls_helpers import capability as capability_spec
from .calls_helpers import hold_until_released, make_agent, wait_routable
from .routing_helpers import instance

#: a bound on waits for the fabric to settle (a record leaving the registry)
SETTLE = 10.0

OPS = st.lists(
    st.tuples(st.sampled_from(["put", "remove"]), st.integers(0, 30), st.booleans()),
    max_size=200,
)


@settings(max_examples=100, deadline=None)
@given(ops=OPS)
def test_samples_come_from_exactly_the_indexed_instances(ops: list[Any]) -> None:
    cache = RouteCache(store=None)  # type: ignore[arg-type]  # _apply needs no store
    for revision, (op, n, both) in enumerate(ops, 1):
        agent_id = f"a-{n}"
        if op == "put":
            caps = ("echo", "other") if both else ("echo",)
            cache._apply(agent_id, instance(agent_id, capabilities=caps), revision)
        else:
            cache._apply(agent_id, None, revision)
    for capability in ("echo", "other"):
        indexed = {i.agent_id for i in cache.for_capability(capability)}
        assert {i.agent_id for i in cache.sample(capability, 10_000)} == indexed
        picked = cache.sample(capability, 3)
        assert len(picked) == min(3, len(indexed))
        assert len({i.agent_id for i in picked}) == len(picked)
        assert {i.agent_id for i in picked} <= indexed


TAGS = ("emea", "amer", "gpu")
TAGGED_OPS = st.lists(
    st.tuples(
        st.sampled_from(["put", "remove"]),
        st.integers(0, 30),
        st.sets(st.sampled_from(TAGS)),
        st.sets(st.sampled_from(TAGS)),
    ),
    max_size=200,
)


def tagged(agent_id: str, echo_tags: set[str], other_tags: set[str]) -> Any:
    from reach.wire.models import Instance, Manifest

    manifest = Manifest.model_validate(
        {
            "agent_id": agent_id,
            "agent_name": "echo_agent",
            "version": "1.0.0",
            "capabilities": [
                {"name": "echo", "tags": sorted(echo_tags)},
                {"name": "other", "tags": sorted(other_tags)},
            ],
        }
    )
    return Instance.model_validate(
        {"manifest": manifest, "instance_id": f"{agent_id}-i", "status": "healthy",
         "registered_at": 1.0, "last_heartbeat_at": 1.0}
    )  # fmt: skip


@settings(max_examples=100, deadline=None)
@given(ops=TAGGED_OPS)
def test_lookups_by_tag_find_exactly_the_instances_whose_capability_carries_them(
    ops: list[Any],
) -> None:
    """The (capability, tag) index against a walk over every instance: tags are per
    capability, so an agent tagged ``gpu`` on ``other`` is not a ``gpu`` instance of
    ``echo``; updates that change an instance's tags move it between indexes."""
    cache = RouteCache(store=None)  # type: ignore[arg-type]  # _apply needs no store
    for revision, (op, n, echo_tags, other_tags) in enumerate(ops, 1):
        agent_id = f"a-{n}"
        instance_ = tagged(agent_id, echo_tags, other_tags) if op == "put" else None
        cache._apply(agent_id, instance_, revision)
    for capability in ("echo", "other"):
        for wanted in [(), *((t,) for t in TAGS), ("emea", "gpu"), TAGS]:
            expected = {
                i.agent_id
                for i in cache.all()
                if (cap := i.manifest.capability(capability)) is not None
                and set(wanted) <= set(cap.tags)
            }
            found = [i.agent_id for i in cache.for_capability(capability, wanted)]
            assert sorted(found) == sorted(expected)
            # the routes a choice reads: the same instances, each as the latest record has it
            routes = cache.entries(capability, wanted)
            assert sorted(e.agent_id for e in routes) == sorted(expected)
            # the names an audit event gives them: kept with the index, never stale
            named = cache.first_names(capability, wanted, routes)
            assert named == tuple(e.agent_id for e in routes[:NAMED_CANDIDATES])
            for e in routes:
                assert e.instance is cache.get(e.agent_id)
                assert e.spec is e.instance.manifest.capability(capability)
                assert e.per_sla_ms == 1 / e.spec.latency_sla_ms
            assert {i.agent_id for i in cache.sample(capability, 10_000, wanted)} == expected
            picked = {i.agent_id for i in cache.sample(capability, 2, wanted)}
            assert len(picked) == min(2, len(expected))
            assert picked <= expected
            listed = cache.find(capability, tags=wanted, include_unhealthy=True)
            assert [i.agent_id for i in listed] == sorted(expected)


def test_a_tag_listed_twice_leaves_one_route_and_none_once_gone() -> None:
    from reach.wire.models import Instance, Manifest

    def record(n: int) -> Instance:
        manifest = Manifest.model_validate(
            {
                "agent_id": "a",
                "agent_name": "a",
                "version": "1.0.0",
                "capabilities": [{"name": "echo", "tags": ["t", "t"], "latency_sla_ms": 100}],
            }
        )
        return Instance(
            manifest=manifest,
            instance_id="a-i",
            registered_at=1.0,
            last_heartbeat_at=float(n),
            in_flight=n,
        )

    cache = RouteCache(store=None)  # type: ignore[arg-type]  # _apply needs no store
    for revision in range(1, 6):  # announced, then four heartbeats
        cache._apply("a", record(revision), revision)
        routes = cache.entries("echo", ["t"])
        assert [(e.agent_id, e.in_flight) for e in routes] == [("a", revision)]
    cache._apply("a", None, 6)
    assert list(cache.entries("echo", ["t"])) == []
    assert list(cache.for_capability("echo", ["t"])) == []


@settings(max_examples=100, deadline=None)
@given(ops=TAGGED_OPS)
def test_the_names_an_audit_event_gives_the_candidates_follow_every_change(
    ops: list[Any],
) -> None:
    """``first_names`` keeps the first names with the index; asked after every change
    (a removal moves the last route into the hole, an addition appends), it never
    answers with names of a list that has changed since."""
    cache = RouteCache(store=None)  # type: ignore[arg-type]  # _apply needs no store
    for revision, (op, n, echo_tags, other_tags) in enumerate(ops, 1):
        agent_id = f"a-{n % 20}"
        instance_ = tagged(agent_id, echo_tags, other_tags) if op == "put" else None
        cache._apply(agent_id, instance_, revision)
        for capability in ("echo", "other"):
            for wanted in [(), ("gpu",), ("emea", "gpu")]:
                routes = cache.entries(capability, wanted)
                expected = tuple(e.agent_id for e in routes[:NAMED_CANDIDATES])
                assert cache.first_names(capability, wanted, routes) == expected


# -- a heartbeat updates the lists a call holds ----------------------------------------


def _instance(heartbeat_at: float, caps: list[dict[str, Any]], agent_id: str = "one-1") -> Instance:
    manifest = Manifest.model_validate(
        {"agent_id": agent_id, "agent_name": "one", "version": "1.0.0", "capabilities": caps}
    )
    return Instance.model_validate(
        {
            "manifest": manifest,
            "instance_id": f"{agent_id}-i",
            "registered_at": 1.0,
            "last_heartbeat_at": heartbeat_at,
        }
    )


def test_an_updated_record_keeps_the_list_a_call_holds() -> None:
    """A call holds ``entries()``'s own list (the index's); a new revision of the same
    instance (a heartbeat) must update it in place, not empty it and index a new one."""
    cache = RouteCache(store=None)  # type: ignore[arg-type]  # _apply needs no store
    caps = [{"name": "slow", "tags": ["t"]}]
    cache._apply("one-1", _instance(1.0, caps), 1)
    held = cache.entries("slow")
    held_tagged = cache.entries("slow", ["t"])
    assert [e.agent_id for e in held] == ["one-1"]
    assert [e.agent_id for e in held_tagged] == ["one-1"]

    cache._apply("one-1", _instance(2.0, caps), 2)  # the heartbeat
    for now, before in ((cache.entries("slow"), held), (cache.entries("slow", ["t"]), held_tagged)):
        assert now is before  # still the index's list
        assert [e.agent_id for e in before] == ["one-1"]
        assert before[0].instance.last_heartbeat_at == 2.0  # with the new record
    assert [i.last_heartbeat_at for i in cache.for_capability("slow", ["t"])] == [2.0]
    assert cache.find(tags=["t"])[0].last_heartbeat_at == 2.0


def test_an_updated_record_still_leaves_what_it_no_longer_offers() -> None:
    cache = RouteCache(store=None)  # type: ignore[arg-type]  # _apply needs no store
    cache._apply(
        "one-1", _instance(1.0, [{"name": "slow", "tags": ["t", "u"]}, {"name": "other"}]), 1
    )
    cache._apply("one-1", _instance(2.0, [{"name": "slow", "tags": ["u"]}]), 2)
    assert [e.agent_id for e in cache.entries("slow")] == ["one-1"]
    assert [e.agent_id for e in cache.entries("slow", ["u"])] == ["one-1"]
    assert list(cache.entries("slow", ["t"])) == []
    assert list(cache.entries("other")) == []
    assert cache.find(tags=["t"]) == []
    assert [i.agent_id for i in cache.find(tags=["u"])] == ["one-1"]
    cache._apply("one-1", None, 3)  # deregistered: gone from every index
    assert list(cache.entries("slow")) == []
    assert list(cache.entries("slow", ["u"])) == []


async def test_a_call_retried_across_heartbeats_still_finds_its_instance(
    nats_server: NatsServer, registrar: Registrar
) -> None:
    """One instance taking one call at a time, heartbeating every 50 ms: a second call
    is refused (over capacity) while the first runs, and its retry must find the
    instance again, not an emptied candidate list (NotFound: a call by tag cannot fall
    back on the capability's queue subject)."""
    tags = ("t",)
    busy = asyncio.Event()

    async def slow(req: dict[str, float]) -> dict[str, bool]:
        if req["s"]:
            busy.set()
        await asyncio.sleep(req["s"])
        return {"ok": True}

    agent, _ = make_agent(
        nats_server.url,
        "one-1",
        capability_spec("slow", sla_ms=3000, tags=("t",)),
        max_concurrency=1,
        handler=slow,
        health={"interval_sec": 0.05, "timeout_sec": 1.0, "failures_before_unhealthy": 5},
    )
    async with agent, ReachClient(servers=nats_server.url) as client:
        await wait_routable(client, "slow", 1)
        first = asyncio.create_task(client.call("slow", {"s": 0.5}, tags=tags))
        try:
            await asyncio.wait_for(busy.wait(), 5)  # the first call holds the only slot
            changes = client.routes.changes
            second = await client.call("slow", {"s": 0.0}, tags=tags, timeout=5)
            assert client.routes.changes > changes  # heartbeats did arrive meanwhile
            assert second.value == {"ok": True}
            assert second.agent_id == "one-1"
            assert second.attempts >= 2  # it was refused once at least, then retried
        finally:
            assert (await first).value == {"ok": True}


# -- what a caller keeps of an instance goes with its record ---------------------------


def test_a_route_cache_forgets_the_peer_of_an_instance_that_left() -> None:
    """Whoever owns the cache (a client, `reach top`, a tool): the caller's view of an
    instance goes with its record, and does not pile up over the instances ever seen."""
    cache = RouteCache(store=None)  # type: ignore[arg-type]  # _apply needs no store
    for n in range(50):
        cache._apply(f"gone-{n}", _instance(1.0, [{"name": "slow"}], f"gone-{n}"), n + 1)
    assert len(cache.peers) == 50
    for n in range(50):
        cache._apply(f"gone-{n}", None, 100 + n)
    assert len(cache.peers) == 0


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

    held, entered, release = hold_until_released({"ok": True})
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
