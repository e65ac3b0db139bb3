"""The route cache's per-capability lists stay in step with its index under any sequence
of registrations, updates and removals, so sampling picks only live instances."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from reach.registry.routecache import RouteCache
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
