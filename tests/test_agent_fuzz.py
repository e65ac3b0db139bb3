"""Arbitrary bytes and arbitrary nested values thrown at a live agent: only typed error
replies come back, and the agent keeps serving."""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reach.caller.client import ReachClient
from reach.testing import NatsServer
from reach.wire import envelope, subjects

from .calls_helpers import capability, make_agent, wait_routable

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "n": {"type": "integer", "minimum": 0}},
    "required": ["name"],
}

leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=20),
    st.binary(max_size=20),
)
values = st.recursive(
    leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5),
        st.dictionaries(
            st.one_of(st.text(max_size=8), st.integers(-1000, 1000)), inner, max_size=5
        ),
    ),
    max_leaves=30,
)

FUZZ = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.fixture
async def fuzz_agent(nats_server: NatsServer, client: ReachClient) -> AsyncIterator[str]:
    """One agent for all examples of a test (fixtures run once per test, not per example)."""
    # Hypothesis generates examples synchronously, on the thread of the event loop this
    # in-process agent heartbeats on: a slow first example (a cold start) stalls the loop
    # past two 0.5 s intervals and the registrar rightly marks the agent unhealthy (and
    # evicts it after three). These tests are about bad input, not health: give it room.
    agent, _ = make_agent(
        nats_server.url,
        "fuzz-1",
        capability("echo", input_schema=SCHEMA),
        health={"interval_sec": 3.0, "timeout_sec": 1.0, "failures_before_unhealthy": 3},
    )
    async with agent:
        await wait_routable(client, "echo", 1)
        yield subjects.capability_instance("echo", "fuzz-1")


def _assert_typed(reply_bytes: bytes) -> envelope.Reply:
    reply = envelope.unpack_reply(reply_bytes)  # raises CodecError if the agent sent junk
    if not reply.ok:
        assert reply.kind in envelope.ERROR_KINDS
        assert reply.description
    return reply


@FUZZ
@given(data=st.binary(max_size=300))
async def test_arbitrary_bytes_get_a_typed_error_and_the_agent_keeps_serving(
    fuzz_agent: str, client: ReachClient, data: bytes
) -> None:
    reply = _assert_typed(await client.connection.request(fuzz_agent, data, 2))
    assert not reply.ok
    assert (await client.call("echo", {"name": "still here"})).value["echo"]["name"]


@FUZZ
@given(value=values)
async def test_arbitrary_nested_values_are_answered_with_typed_replies(
    fuzz_agent: str, client: ReachClient, value: Any
) -> None:
    body = msgpack.packb(value, use_bin_type=True)
    request = envelope.pack_request(
        envelope.RequestMeta(
            call_id=secrets.token_hex(8), deadline_ms=int((time.time() + 2) * 1000)
        ),
        body,
    )
    reply = _assert_typed(await client.connection.request(fuzz_agent, request, 2))
    if not reply.ok:
        assert reply.kind == "contract"
    assert (await client.call("echo", {"name": "still here"})).agent_id == "fuzz-1"
