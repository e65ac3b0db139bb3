"""The fabric on nats-py's public API alone (``REACH_NATS_INTERNALS=off``): calls, batches,
no responders, flush and a secured fabric's tokens work the same, against a real
nats-server, and no nats-py internal is replaced."""

from __future__ import annotations

import asyncio

import pytest

from reach.caller.client import ReachClient
from reach.errors import NoResponders
from reach.testing import NatsServer
from reach.transport import Connection, Message, connect, internals
from reach.wire import envelope, subjects

from .calls_helpers import Behaviour, make_agent, wait_routable
from .conftest import Fabric, vault_agent


@pytest.fixture(autouse=True)
def _public_api(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every connection of the test, the fixtures' included, without the internals."""
    monkeypatch.setenv(internals.ENV, "off")


def _runs_on_the_public_api(conn: Connection) -> None:
    assert not conn.uses_internals
    # every subscription's messages go through nats-py's own queue and task
    for sub in conn._nc._subs.values():
        assert isinstance(sub._pending_queue, asyncio.Queue)
        assert sub._wait_for_msgs_task is not None


async def test_calls_alone_and_in_batches_work_on_the_public_api(
    nats_server: NatsServer, client: ReachClient, conn: Connection
) -> None:
    agent, behaviour = make_agent(nats_server.url, "worker-1")
    sent: list[bytes] = []

    async def record(msg: Message) -> None:
        sent.append(msg.data)

    await conn.subscribe(subjects.capability_instance("work", "worker-1"), record)
    await conn.flush()
    async with agent:
        await wait_routable(client, "work", 1)
        result = await client.call("work", {"x": 1})
        assert result.value == {"by": "worker-1", "echo": {"x": 1}}
        # many in flight: requests to one instance travel in batches through the mux
        results = await asyncio.gather(*(client.call("work", {"n": n}) for n in range(64)))
        assert [r.value["echo"] for r in results] == [{"n": n} for n in range(64)]
        _runs_on_the_public_api(client.connection)
        _runs_on_the_public_api(agent.connection)
    assert behaviour.calls == 65
    assert any(envelope.is_batch(data) for data in sent)


async def test_no_responders_and_flush_work_on_the_public_api(nats_server: NatsServer) -> None:
    a = await connect([nats_server.url], name="a")
    b = await connect([nats_server.url], name="b")
    try:
        with pytest.raises(NoResponders):
            await a.request("nobody.here", b"?", 2)
        got = asyncio.Event()

        async def on(msg: Message) -> None:
            got.set()

        await a.subscribe("ping.a", on)
        await a.flush()  # the subscription is in place once this returns
        await b.publish("ping.a", b"!")
        await asyncio.wait_for(got.wait(), 1)
        _runs_on_the_public_api(a)
    finally:
        await a.close()
        await b.close()


async def test_a_secured_fabrics_calls_carry_and_check_tokens_on_the_public_api(
    fabric: Fabric,
) -> None:
    behaviour = Behaviour()
    async with (
        vault_agent(fabric, behaviour) as agent,
        ReachClient(servers=fabric.url, credentials=fabric.creds["auditor"]) as auditor,
    ):
        await wait_routable(auditor, "customer_orders", 1)
        assert (await auditor.call("customer_orders", {"user": 7})).agent_id == "vault-1"
        _runs_on_the_public_api(auditor.connection)
        _runs_on_the_public_api(agent.connection)
    assert behaviour.calls == 1
