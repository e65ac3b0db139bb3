"""Callers and agents read the registry without JetStream consumers, and may create none.

A consumer is server state its creator points anywhere: its deliver subject is not held
to the creator's permissions, and a durable one outlives it. A level-1 caller created a
thousand durables in 1.5 s, and one kept pushing registry records into an agent's
instance subject after its creator left. Now no caller or agent may create a consumer
at all; they read public buckets by direct gets and republished changes.
"""

from __future__ import annotations

import json

from reach.caller.client import ReachClient
from reach.wire import subjects

from ..calls_helpers import wait_routable
from .conftest import Refusals, UpFabric, attacker

STREAMS = ("KV_REACH_REGISTRY", "KV_REACH_KEYS", "KV_REACH_JOBS", "REACH_AUDIT")


async def consumer_counts(fabric: UpFabric) -> dict[str, int]:
    admin = await attacker(fabric, fabric.admin)
    try:
        js = admin.jetstream()
        counts = {}
        for stream in STREAMS:
            try:
                counts[stream] = (await js.stream_info(stream)).state.consumer_count
            except Exception:  # a bucket not created on this fabric
                counts[stream] = -1
        return counts
    finally:
        await admin.close()


async def test_a_caller_or_an_agent_can_create_no_consumer(
    up_fabric: UpFabric, refusals: Refusals
) -> None:
    _, caller = await up_fabric.add_client(level=1, roles=("jobs",))
    _, agent = await up_fabric.add_client(level=1, agent_id="eve-1", caps=("weather",))
    before = await consumer_counts(up_fabric)
    for creds in (caller, agent):
        nc = await attacker(up_fabric, creds, error_cb=refusals.on_error)
        try:
            config = {"deliver_subject": subjects.capability_instance("weather", "victim-1")}
            for stream in STREAMS:
                for api in (
                    f"$JS.API.CONSUMER.CREATE.{stream}",
                    f"$JS.API.CONSUMER.CREATE.{stream}.d1",
                    f"$JS.API.CONSUMER.CREATE.{stream}.d1.$KV.REACH_REGISTRY.>",
                    f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.d1",
                ):
                    body = {"stream_name": stream, "config": {**config, "durable_name": "d1"}}
                    await nc.publish(api, json.dumps(body).encode(), reply=nc.new_inbox())
                    await refusals.wait_for(api)
        finally:
            await nc.close()
    assert await consumer_counts(up_fabric) == before


async def test_an_honest_caller_follows_the_registry_and_leaves_no_consumer_behind(
    up_fabric: UpFabric,
) -> None:
    _, caller = await up_fabric.add_client(level=1)
    agent, served, _ = await up_fabric.add_agent("sun-1", "sun")
    before = await consumer_counts(up_fabric)
    async with agent, ReachClient(servers=up_fabric.url, credentials=caller) as client:
        await wait_routable(client, "sun", 1)
        assert (await client.call("sun", {"i": 1})).agent_id == "sun-1"
        during = await consumer_counts(up_fabric)
    assert served.calls == 1
    # no consumer of a caller or an agent, while they run (the registrar's own, if any,
    # were there before)
    assert during == before
