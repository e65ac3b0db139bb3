"""The conformance kit: a caller and an agent written from the protocol spec with raw
nats-py (raw_caller.py, raw_agent.py: no ``reach`` import), each against the library's
own counterpart and against each other, on a fabric `reach up` started with tokens on.

Each checks the results, the uniform errors (contract failures name the rule, a
clearance too low says both levels) and that the calls reach REACH_AUDIT.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from reach.caller.client import ReachClient
from reach.errors import ContractError, NotAuthorized

from ..attacks.conftest import UpFabric
from ..calls_helpers import make_agent, wait_routable
from ..poll_helpers import until
from .conftest import add, adder, audited
from .raw_agent import RawAgent
from .raw_caller import RawCaller
from .wire import Creds, WireError, ask, body_of, request

#: an end-to-end run of whole programs: `make test-long` (CI runs it after `make test`)
pytestmark = pytest.mark.long


async def raw_agent(up: UpFabric, agent_id: str, capability: str, level: int = 1) -> RawAgent:
    _, creds = await up.add_client(level=level, agent_id=agent_id, caps=(capability,))
    agent = RawAgent(Creds.load(creds), agent_id, adder(capability, level), add)
    await agent.start()
    return agent


async def raw_caller(up: UpFabric, level: int = 1) -> RawCaller:
    _, creds = await up.add_client(level=level)
    caller = RawCaller(Creds.load(creds))
    await caller.start()
    return caller


async def routable(caller: RawCaller, capability: str, timeout: float = 10.0) -> None:
    """Wait until the registry lists a ready instance of ``capability``."""
    what = f"a ready instance of {capability} listed"
    await until(lambda: caller.instances(capability), what, timeout=timeout, interval=0.1)


@pytest.fixture
async def py_agent(up: UpFabric) -> AsyncIterator[str]:
    """A ``reach.Agent`` serving ``add`` (level 2) as ``py-add-1``."""
    _, creds = await up.add_client(level=2, agent_id="py-add-1", caps=("add",))
    agent, _ = make_agent(up.url, "py-add-1", adder("add", level=2), handler=add)
    agent.credentials = creds
    async with agent:
        yield "py-add-1"


async def test_a_reach_client_calls_the_raw_agent(up: UpFabric) -> None:
    agent = await raw_agent(up, "raw-sum-1", "sum", level=2)
    _, creds = await up.add_client(level=2)
    _, low = await up.add_client(level=1)
    try:
        async with (
            ReachClient(servers=up.url, credentials=creds) as client,
            ReachClient(servers=up.url, credentials=low) as weak,
        ):
            await wait_routable(client, "sum", 1)
            result = await client.call("sum", {"a": 2, "b": 3})
            assert (result.value, result.agent_id) == ({"sum": 5}, "raw-sum-1")
            with pytest.raises(ContractError) as contract:
                await client.call("sum", {"a": "two", "b": 3})
            assert (contract.value.rule, contract.value.path) == ("type", "a")
            await wait_routable(weak, "sum", 1)
            with pytest.raises(NotAuthorized) as denied:
                await weak.call("sum", {"a": 1, "b": 1})
            assert (denied.value.level_required, denied.value.level_held) == (2, 1)
        events = await audited(up, {result.call_id})
    finally:
        await agent.stop()
    assert agent.served == 1
    # the client records its calls and says so (au): the agent records none of them
    assert {(e["side"], e["callee"], e["outcome"]) for e in events} == {
        ("caller", "raw-sum-1", "ok")
    }


async def test_the_raw_caller_calls_a_reach_agent(up: UpFabric, py_agent: str) -> None:
    caller = await raw_caller(up, level=2)
    weak = await raw_caller(up, level=1)
    try:
        await routable(caller, "add")
        assert await caller.call("add", {"a": 1, "b": 41}) == ({"sum": 42}, py_agent)
        with pytest.raises(WireError) as contract:
            await caller.call("add", {"a": 1})
        assert (contract.value.kind, contract.value.code) == ("contract", "required")
        assert contract.value.desc.startswith("b:")
        with pytest.raises(WireError) as denied:
            await weak.call("add", {"a": 1, "b": 1})
        assert (denied.value.kind, denied.value.code) == ("denied", "insufficient_level:2:1")
    finally:
        await caller.stop()
        await weak.stop()


async def test_the_raw_callers_calls_to_a_reach_agent_are_audited(
    up: UpFabric, py_agent: str
) -> None:
    caller = await raw_caller(up, level=2)
    try:
        await routable(caller, "add")
        await caller.call("add", {"a": 1, "b": 2})
    finally:
        await caller.stop()
    events = await audited(up, set(caller.call_ids), timeout=5)
    assert {(e["side"], e["callee"]) for e in events} == {("callee", py_agent)}


async def test_the_raw_caller_calls_the_raw_agent(up: UpFabric) -> None:
    agent = await raw_agent(up, "raw-total-1", "total", level=2)
    caller = await raw_caller(up, level=2)
    weak = await raw_caller(up, level=1)
    try:
        await routable(caller, "total")
        assert await caller.call("total", {"a": 0.5, "b": 2}) == ({"sum": 2.5}, "raw-total-1")
        with pytest.raises(WireError) as contract:
            await caller.call("total", {"a": 1, "b": 2, "c": 3})
        assert (contract.value.kind, contract.value.code) == ("contract", "additionalProperties")
        with pytest.raises(WireError) as denied:
            await weak.call("total", {"a": 1, "b": 1})
        assert (denied.value.kind, denied.value.code) == ("denied", "insufficient_level:2:1")
        events = await audited(up, {*caller.call_ids, *weak.call_ids})
    finally:
        await caller.stop()
        await weak.stop()
        await agent.stop()
    outcomes = {e["call_id"]: (e["side"], e["caller"], e["outcome"]) for e in events}
    ok_call, contract_call = caller.call_ids
    assert outcomes[ok_call] == ("callee", caller.creds.client_id, "ok")
    assert outcomes[contract_call] == ("callee", caller.creds.client_id, "error")
    assert outcomes[weak.call_ids[0]] == ("callee", weak.creds.client_id, "denied")


async def test_the_raw_agent_answers_a_retried_call_from_memory(up: UpFabric) -> None:
    """A call id seen before (a retry: the same id, the next attempt number) gets the
    same reply, and the handler runs once."""
    agent = await raw_agent(up, "raw-once-1", "once")
    caller = await raw_caller(up)
    try:
        await routable(caller, "once")
        token = await caller._token("once", "raw-once-1")
        assert caller.nc is not None
        replies: list[Any] = []
        for attempt in (1, 2):  # the same call id twice, as a retry sends it
            data = request({"a": 1, "b": 2}, id="retried-1", tok=token, at=attempt)
            reply = await ask(
                caller.nc, caller.creds.client_id, "reach.v1.cap.once.raw-once-1", data, 5
            )
            replies.append(body_of(reply))
    finally:
        await caller.stop()
        await agent.stop()
    assert replies == [{"sum": 3}, {"sum": 3}]
    assert agent.served == 1
