"""An agent credential must not borrow the fabric's rights through NATS responses.

NATS lets a client with response permissions publish to the reply subject of any message
it received, whatever its publish permissions say (deny lists included). An agent that
sends itself a message whose reply subject names a KV key or a JetStream API subject, and
"answers" it, would publish there: a credential written into REACH_CREDENTIALS, a signing
key planted in REACH_KEYS, the audit stream deleted. Every such publish must be refused.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import nats.errors

from reach.wire import subjects

from .conftest import Refusals, UpFabric, attacker, fabric_state

#: reply subjects an attacker would like the fabric to publish to
TARGETS = (
    "$KV.REACH_CREDENTIALS.client.pwned",
    "$KV.REACH_KEYS.pub.pwned",
    "$KV.REACH_REGISTRY.agent.victim-1",
    "$JS.API.STREAM.DELETE.REACH_AUDIT",
    "$JS.API.STREAM.PURGE.KV_REACH_CREDENTIALS",
    "$JS.API.STREAM.MSG.GET.KV_REACH_CREDENTIALS",
    "$SYS.REQ.SERVER.PING",
    "_INBOX.someone-else.r",
)


async def test_an_agent_cannot_publish_with_the_fabrics_rights_by_answering_itself(
    up_fabric: UpFabric, refusals: Refusals
) -> None:
    _, creds = await up_fabric.add_client(agent_id="rogue-1", caps=("echo",))
    before = await fabric_state(up_fabric)
    nc = await attacker(up_fabric, creds, error_cb=refusals.on_error)
    answered: list[str] = []

    async def answer(msg: Any) -> None:
        answered.append(msg.reply)
        await nc.publish(msg.reply, b'{"client_id":"pwned","level":4,"roles":["admin"]}')

    try:
        await nc.subscribe(subjects.capability_instance("echo", "rogue-1"), cb=answer)
        await nc.flush()
        for target in TARGETS:
            await nc.publish(subjects.capability_instance("echo", "rogue-1"), b"x", reply=target)
        await nc.flush()
        for target in TARGETS:
            await refusals.wait_for(target)
    finally:
        await nc.close()
    assert sorted(answered) == sorted(TARGETS)  # it did receive them, and did answer
    assert await fabric_state(up_fabric) == before


async def test_a_caller_cannot_answer_a_message_it_sent_itself_either(
    up_fabric: UpFabric, refusals: Refusals
) -> None:
    client_id, creds = await up_fabric.add_client(level=1)
    before = await fabric_state(up_fabric)
    nc = await attacker(up_fabric, creds, error_cb=refusals.on_error)
    try:
        inbox = f"_INBOX.{client_id}.x"
        got = asyncio.Event()

        async def answer(msg: Any) -> None:
            got.set()
            with contextlib.suppress(nats.errors.Error):
                await nc.publish(msg.reply, b"x")

        await nc.subscribe(inbox, cb=answer)
        await nc.publish(inbox, b"x", reply="$KV.REACH_CREDENTIALS.client.pwned")
        await nc.flush()
        await refusals.wait_for(inbox)  # it may not even publish to its own inbox
    finally:
        await nc.close()
    assert not got.is_set()
    assert await fabric_state(up_fabric) == before
