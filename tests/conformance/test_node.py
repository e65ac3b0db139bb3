"""The Node.js examples (examples/node: nats.js, @msgpack/msgpack, ajv, jose) against a
fabric `reach up` started with tokens on: the Node caller calls a ``reach.Agent``, a
``ReachClient`` calls the Node agent, and the Node caller calls the Node agent.

Run when ``node`` and ``npm`` are on PATH (``npm ci`` installs the examples' packages
into examples/node/node_modules first if they are missing; ``make test`` does it too),
skipped otherwise.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from reach.caller.client import ReachClient
from reach.errors import ContractError, NotAuthorized

from ..attacks.conftest import UpFabric
from ..calls_helpers import make_agent, wait_routable
from ..poll_helpers import until
from .agents import NO_NODE, node_agent, node_call, node_modules
from .conftest import add, adder, audit_events, audited

pytestmark = [
    pytest.mark.long,
    pytest.mark.node,
    pytest.mark.skipif(NO_NODE is not None, reason=NO_NODE or ""),
]


@pytest.fixture(scope="module", autouse=True)
def _node_modules() -> None:
    node_modules()


async def test_the_node_caller_calls_a_reach_agent(up: UpFabric) -> None:
    _, agent_creds = await up.add_client(level=2, agent_id="py-plus-1", caps=("plus",))
    _, creds = await up.add_client(level=2)
    _, low = await up.add_client(level=1)
    agent, _ = make_agent(up.url, "py-plus-1", adder("plus", level=2), handler=add)
    agent.credentials = agent_creds
    async with agent:
        assert await node_call(creds, "plus", {"a": 20, "b": 22}) == {
            "ok": True,
            "result": {"sum": 42},
            "by": "py-plus-1",
        }
        contract = await node_call(creds, "plus", {"a": 1})
        assert (contract["kind"], contract["code"]) == ("contract", "required")
        denied = await node_call(low, "plus", {"a": 1, "b": 1})
        assert (denied["kind"], denied["code"]) == ("denied", "insufficient_level:2:1")


async def test_a_reach_client_calls_the_node_agent(up: UpFabric) -> None:
    _, creds = await up.add_client(level=2)
    _, low = await up.add_client(level=1)
    async with (
        node_agent(up, "node-sum-1", "nsum", level=2),
        ReachClient(servers=up.url, credentials=creds) as client,
        ReachClient(servers=up.url, credentials=low) as weak,
    ):
        await wait_routable(client, "nsum", 1)
        result = await client.call("nsum", {"a": 1.5, "b": 2})
        assert (result.value, result.agent_id) == ({"sum": 3.5}, "node-sum-1")
        with pytest.raises(ContractError) as contract:
            await client.call("nsum", {"a": 1, "b": 2, "c": 3})
        assert (contract.value.rule, contract.value.path) == ("additionalProperties", "c")
        await wait_routable(weak, "nsum", 1)
        with pytest.raises(NotAuthorized) as denied:
            await weak.call("nsum", {"a": 1, "b": 1})
        assert (denied.value.level_required, denied.value.level_held) == (2, 1)
        events = await audited(up, {result.call_id})
    # the client records its calls and says so (au): the agent records none of them
    assert {(e["side"], e["callee"], e["outcome"]) for e in events} == {
        ("caller", "node-sum-1", "ok")
    }


async def test_the_node_caller_calls_the_node_agent(up: UpFabric) -> None:
    _, creds = await up.add_client(level=1)
    async with node_agent(up, "node-add-1", "nadd"):
        answer = await node_call(creds, "nadd", {"a": 2, "b": 5})
        assert answer == {"ok": True, "result": {"sum": 7}, "by": "node-add-1"}
        contract = await node_call(creds, "nadd", {"a": "2", "b": 5})
        assert (contract["kind"], contract["code"]) == ("contract", "type")
        assert contract["desc"].startswith("a:")
        caller = json.loads(creds.read_text())["client_id"]

        async def callee_events() -> list[dict[str, Any]] | None:
            events = [e for e in await audit_events(up) if e["caller"] == caller]
            return events if len(events) >= 2 else None

        events = await until(callee_events, "both callee events audited", timeout=10, interval=0.2)
    assert sorted((e["side"], e["callee"], e["outcome"]) for e in events) == [
        ("callee", "node-add-1", "error"),
        ("callee", "node-add-1", "ok"),
    ]
