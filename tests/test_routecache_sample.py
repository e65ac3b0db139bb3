"""The route cache's per-capability lists stay in step with its index under any sequence
of registrations, updates and removals, so sampling picks only live instances."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from reach.registry.routecache import NAMED_CANDIDATES, RouteCache
from tests.test_routing import instance

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
    from reach.models import Instance, Manifest

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
    from reach.models import Instance, Manifest

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
