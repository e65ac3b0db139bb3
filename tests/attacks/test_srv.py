"""NATS micro discovery (`$SRV`) must not let an agent speak for another, nor write into
the rest of anyone's inbox.

Every agent answers `$SRV.PING|INFO|STATS`; an agent credential may subscribe there, but
at the instance level (`$SRV.<verb>.<name>.<id>`) only under its own agent id, and may
publish its answers only to the discovery space of inboxes (`_INBOX.<client>.srv.…`).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import nats.errors
from nats.aio.client import Client as NatsClient

from ..srv_helpers import gather
from .conftest import Refusals, UpFabric, attacker


async def answers(nc: NatsClient, subject: str, within: float) -> list[dict[str, Any]]:
    """Every answer to one request on ``subject`` that arrives ``within`` seconds."""
    return await gather(nc, subject, timeout=within)


async def test_an_agent_cannot_listen_or_answer_for_another_agents_id(
    up_fabric: UpFabric, refusals: Refusals
) -> None:
    victim, _, _ = await up_fabric.add_agent("victim-1", "srv_victim")
    _, rogue_creds = await up_fabric.add_client(agent_id="rogue-1", caps=("srv_rogue",))
    caller_id, caller_creds = await up_fabric.add_client(level=1)
    rogue = await attacker(up_fabric, rogue_creds, error_cb=refusals.on_error)
    operator = await attacker(up_fabric, caller_creds, inbox=f"_INBOX.{caller_id}.srv")
    heard: list[str] = []

    async def listen(msg: Any) -> None:
        heard.append(msg.subject)

    try:
        async with victim:
            for subject in ("$SRV.PING.test.victim-1", "$SRV.INFO.*.victim-1", "$SRV.>"):
                await rogue.subscribe(subject, cb=listen)
                await refusals.wait_for(f'subscription to "{subject}"')
            # the victim alone answers what is asked of it
            got = await answers(operator, "$SRV.PING.test.victim-1", within=1.0)
            assert [a["id"] for a in got] == ["victim-1"]
            assert heard == []
    finally:
        await rogue.close()
        await operator.close()


async def test_an_agents_answers_go_only_to_the_discovery_space_of_inboxes(
    up_fabric: UpFabric, refusals: Refusals
) -> None:
    _, rogue_creds = await up_fabric.add_client(agent_id="rogue-2", caps=("srv_rogue",))
    caller_id, caller_creds = await up_fabric.add_client(level=1)
    rogue = await attacker(up_fabric, rogue_creds, error_cb=refusals.on_error)
    # a client asking from the ordinary part of its inbox, where nats-py's own requests
    # (JetStream API answers) arrive under names that can be guessed
    caller = await attacker(up_fabric, caller_creds)
    answered: list[str] = []
    heard = asyncio.Event()
    live = asyncio.Event()

    async def answer(msg: Any) -> None:
        if not msg.reply:  # its own ping, below
            live.set()
            return
        answered.append(msg.reply)
        heard.set()
        await rogue.publish(msg.reply, b'{"type":"io.nats.micro.v1.ping_response"}')

    try:
        await rogue.subscribe("$SRV.PING", cb=answer)  # allowed: every agent answers here
        await rogue.flush()
        # in a fabric's first seconds the server may deliver a ping sent right after the
        # subscription's PONG to no one: the rogue pings itself (no reply subject) until
        # it hears itself, so the caller's single ping below finds it listening
        async with asyncio.timeout(10.0):
            while not live.is_set():
                await rogue.publish("$SRV.PING", b"")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(live.wait(), 0.1)
        inbox = caller.new_inbox()
        sub = await caller.subscribe(inbox)
        await caller.publish("$SRV.PING", b"", reply=inbox)
        # the rogue hears the request and answers; the server refuses its answer, so
        # once the refusal is reported nothing of it can still reach the caller
        await asyncio.wait_for(heard.wait(), 10.0)
        assert len(answered) == 1
        assert answered[0].startswith(f"_INBOX.{caller_id}.")
        await refusals.wait_for(f'publish to "{answered[0]}"')
        await caller.flush()
        got = [m.data for m in await drained(sub) if not (m.headers and m.headers.get("Status"))]
        assert got == []
    finally:
        await rogue.close()
        await caller.close()


async def drained(sub: Any) -> list[Any]:
    """The messages a subscription holds (its connection flushed: every message the
    server sent before is read), without waiting for more."""
    msgs = []
    while True:
        try:
            msgs.append(await sub.next_msg(timeout=0.05))
        except nats.errors.TimeoutError:
            return msgs


async def test_a_caller_cannot_pose_as_a_micro_service(
    up_fabric: UpFabric, refusals: Refusals
) -> None:
    _, creds = await up_fabric.add_client(level=4)
    nc = await attacker(up_fabric, creds, error_cb=refusals.on_error)
    try:
        await nc.subscribe("$SRV.PING")
        await refusals.wait_for('subscription to "$SRV.PING"')
    finally:
        await nc.close()
