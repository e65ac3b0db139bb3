"""Route keys, as a caller holding a credential sees them with plain nats-py.

A caller may follow the route keys ``cap.<capability>.<agent_id>`` of the registry (a
subscription to their republished changes, direct gets filtered to a prefix), as it may
the instance records; it can write none: a forged route key never reaches an honest
caller's route cache.
"""

from __future__ import annotations

import asyncio
import json

import msgpack
import nats.js.errors
import pytest

from reach.caller.client import ReachClient
from reach.registry.store import route_key
from reach.wire import subjects

from ..calls_helpers import wait_routable
from .conftest import Refusals, UpFabric, attacker

REPUBLISHED = f"reach.v1.kv.{subjects.REGISTRY_BUCKET}"


async def test_a_caller_follows_a_capabilitys_route_keys_and_forges_none(
    up_fabric: UpFabric,
) -> None:
    _, creds = await up_fabric.add_client(level=1)
    refusals = Refusals()
    nc = await attacker(up_fabric, creds, error_cb=refusals.on_error)
    agent, _, _ = await up_fabric.add_agent("moon-1", "moon")
    try:
        changes: asyncio.Queue[str] = asyncio.Queue()

        async def heard(msg: nats.aio.msg.Msg) -> None:
            changes.put_nowait(msg.subject)

        await nc.subscribe(f"{REPUBLISHED}.{route_key('moon', '>')}", cb=heard)
        await nc.flush()
        async with agent:
            async with asyncio.timeout(10):
                assert await changes.get() == f"{REPUBLISHED}.{route_key('moon', 'moon-1')}"
            # a scan of the prefix by a batched direct get answers the record
            inbox = nc.new_inbox()
            answers: asyncio.Queue[nats.aio.msg.Msg] = asyncio.Queue()

            async def answered(msg: nats.aio.msg.Msg) -> None:
                answers.put_nowait(msg)

            await nc.subscribe(inbox, cb=answered)
            scan = {"seq": 0, "next_by_subj": f"$KV.{subjects.REGISTRY_BUCKET}.cap.moon.>"}
            scan["batch"] = 16
            await nc.publish(
                f"$JS.API.DIRECT.GET.KV_{subjects.REGISTRY_BUCKET}",
                json.dumps(scan).encode(),
                reply=inbox,
            )
            async with asyncio.timeout(10):
                first = await answers.get()
            assert (first.headers or {}).get("Nats-Subject") == (
                f"$KV.{subjects.REGISTRY_BUCKET}.{route_key('moon', 'moon-1')}"
            )

            # a forged route key: the caller's account has no JetStream, nothing stores it
            forged = msgpack.packb({"agent_id": "fake-1"}, use_bin_type=True)
            await nc.publish(
                f"$KV.{subjects.REGISTRY_BUCKET}.{route_key('moon', 'fake-1')}", forged
            )
            await nc.flush()
            async with ReachClient(servers=up_fabric.url, credentials=creds) as client:
                await wait_routable(client, "moon", 1)
                assert [i.agent_id for i in await client.discover("moon")] == ["moon-1"]
            admin = await attacker(up_fabric, up_fabric.admin)
            try:
                kv = await admin.jetstream().key_value(subjects.REGISTRY_BUCKET)
                with pytest.raises(nats.js.errors.KeyNotFoundError):
                    await kv.get(route_key("moon", "fake-1"))
            finally:
                await admin.close()
    finally:
        await nc.close()
