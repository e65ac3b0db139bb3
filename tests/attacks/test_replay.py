"""A call's bytes, sent again, are never served twice: not by the instance that received
them, not by another instance of the capability, and not past their deadline.

The attacker runs an instance of the capability (its credential lists it): it sees the
calls routed to it, token included, and sends copies of them with plain nats-py.
"""

from __future__ import annotations

import asyncio
import secrets
import time

import msgpack

from reach.caller.client import ReachClient
from reach.wire import subjects

from ..calls_helpers import wait_routable
from .conftest import UpFabric, ask, code_of, spy_on


async def test_a_callee_cannot_replay_a_call_it_received_anywhere(up_fabric: UpFabric) -> None:
    _, victim = await up_fabric.add_client(level=3)
    honest, served, _ = await up_fabric.add_agent("honest-1", "weather", level=3)
    rogue, _, rogue_creds = await up_fabric.add_agent("rogue-1", "weather", level=3)
    spy, captured = await spy_on(
        up_fabric, rogue_creds, subjects.capability_instance("weather", "rogue-1")
    )
    try:
        async with rogue, ReachClient(servers=up_fabric.url, credentials=victim) as client:
            await wait_routable(client, "weather", 1)
            await client.call("weather", {"city": "x"})
            stolen = await asyncio.wait_for(captured.get(), 5)
            async with honest:
                await wait_routable(client, "weather", 2)
                # the copy, to the other instance: its token is for rogue-1 alone
                other = await ask(spy, subjects.capability_instance("weather", "honest-1"), stolen)
                assert code_of(other) == "authentication_failed", other
                assert "audience" in other["err"]["desc"]
                # the copy, to the instance that served it: seen already
                again = await ask(spy, subjects.capability_instance("weather", "rogue-1"), stolen)
                assert code_of(again) == "replayed", again
                # and the token alone, in a call of its own making, to the other instance
                env = msgpack.unpackb(stolen)
                forged = {**env, "id": secrets.token_hex(8), "dl": int(time.time() * 1000) + 5000}
                made = await ask(
                    spy,
                    subjects.capability_instance("weather", "honest-1"),
                    msgpack.packb(forged),
                )
                assert code_of(made) == "authentication_failed", made
        assert served.calls == 0
    finally:
        await spy.close()


async def test_every_call_has_a_deadline_and_none_lies_too_far_ahead(up_fabric: UpFabric) -> None:
    _, caller = await up_fabric.add_client(level=1)
    agent, served, agent_creds = await up_fabric.add_agent("sun-1", "sun")
    spy, captured = await spy_on(
        up_fabric, agent_creds, subjects.capability_instance("sun", "sun-1")
    )
    try:
        async with agent, ReachClient(servers=up_fabric.url, credentials=caller) as client:
            await wait_routable(client, "sun", 1)
            await client.call("sun", {"i": 0})
            env = msgpack.unpackb(await asyncio.wait_for(captured.get(), 5))
            target = subjects.capability_instance("sun", "sun-1")
            # no deadline: served once, under the callee's own deadline
            bare = {k: v for k, v in env.items() if k != "dl"} | {"id": secrets.token_hex(8)}
            assert code_of(await ask(spy, target, msgpack.packb(bare))) == "ok"
            assert code_of(await ask(spy, target, msgpack.packb(bare))) == "replayed"
            # a deadline a day and more ahead: refused before anything runs
            far = {**env, "id": secrets.token_hex(8), "dl": int((time.time() + 90_000) * 1000)}
            assert code_of(await ask(spy, target, msgpack.packb(far))) == "deadline_too_far"
        assert served.calls == 2
    finally:
        await spy.close()
