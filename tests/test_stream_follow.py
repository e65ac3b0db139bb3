"""Following a stream (``reach top``, ``reach audit tail -f``, ``reach alerts -f``, the
console) across the loss of its nats-server.

A follower reads through an ordered consumer, state that lives on one server: a server
that restarted, or another node of a cluster, has none and sends nothing, without an
error. The follower must notice that its connection came back and go on after the last
message it read: every message once, in order.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from reach.errors import ReachError
from reach.tasks import cancel_and_wait
from reach.testing import NatsServer
from reach.transport import Connection, StreamMessage, connect
from tests.poll_helpers import until


async def _publish(conn: Connection, stream_name: str, n: int) -> None:
    """Store message ``n`` once (its id makes a resend harmless), trying again while the
    server's JetStream comes back."""
    stream = await conn.stream(stream_name, check=False)
    async with asyncio.timeout(30):
        while True:
            try:
                await stream.publish(f"follow.{n}", b"%d" % n, msg_id=f"m-{n}", timeout=2.0)
                return
            except ReachError:
                await asyncio.sleep(0.2)


@pytest.mark.parametrize("how", ["read", "follow"])
async def test_a_follower_goes_on_after_its_server_restarts_with_every_message_once(
    nats_server: NatsServer, how: str
) -> None:
    """``Stream.read(follow=True)``, each message awaited, or ``Stream.follow``, each one
    handed to a function as it arrives."""
    conn = await connect([nats_server.url], name="follower")
    got: list[StreamMessage] = []
    try:
        stream = await conn.stream("FOLLOW", ["follow.>"], create=True)
        for n in range(3):
            await _publish(conn, "FOLLOW", n)

        async def follow() -> None:
            if how == "follow":
                await stream.follow(">", got.append)
            else:
                async for msg in stream.read(follow=True):
                    got.append(msg)

        reader = asyncio.create_task(follow())
        try:
            await until(lambda: len(got) == 3, "the first three messages")
            await asyncio.to_thread(nats_server.stop_now)
            await asyncio.to_thread(nats_server.start_now)
            await until(
                lambda: conn.reconnects >= 1 and conn.is_connected, "a reconnect", timeout=30
            )
            for n in range(3, 6):
                await _publish(conn, "FOLLOW", n)
            await until(lambda: len(got) >= 6, "the next three messages", timeout=15)
        finally:
            await cancel_and_wait([reader])
            with contextlib.suppress(asyncio.CancelledError):
                await reader  # done: raises what it failed with, if anything
        assert [m.seq for m in got] == [1, 2, 3, 4, 5, 6]
        assert [m.data for m in got] == [b"%d" % n for n in range(6)]
    finally:
        await conn.close()


async def test_what_a_handed_message_raises_ends_the_follow_with_it(
    nats_server: NatsServer,
) -> None:
    conn = await connect([nats_server.url], name="follower")
    try:
        stream = await conn.stream("FOLLOW", ["follow.>"], create=True)
        for n in range(3):
            await _publish(conn, "FOLLOW", n)
        got: list[int] = []

        def handle(msg: StreamMessage) -> None:
            got.append(msg.seq)
            if msg.seq == 2:
                raise ValueError("the handler's own bug")

        async with asyncio.timeout(10):
            with pytest.raises(ValueError, match="the handler's own bug"):
                await stream.follow(">", handle)
        assert got == [1, 2]  # nothing handed after it
    finally:
        await conn.close()


async def test_a_reader_told_to_stop_while_messages_flow_stops(nats_server: NatsServer) -> None:
    """A reader cancelled (Ctrl-C on ``reach audit tail --follow``) as a message arrives
    stops: the cancellation is not lost to the message. Messages flow steadily while
    readers are started and cancelled at slightly different moments, many times over."""
    conn = await connect([nats_server.url], name="reader")
    writer = await connect([nats_server.url], name="writer")
    stop = asyncio.Event()

    async def flow() -> None:
        n = 0
        while not stop.is_set():
            await writer.publish(f"flow.{n % 3}", b"x")
            n += 1
            await asyncio.sleep(0.0005)

    publishing = asyncio.create_task(flow())
    lost = 0
    try:
        stream = await conn.stream("FLOW", ["flow.>"], create=True)
        for n in range(100):
            messages = await stream.start_read(">", follow=True, new_only=True)

            async def read(messages: AsyncIterator[StreamMessage] = messages) -> None:
                async for _ in messages:
                    pass

            reader = asyncio.create_task(read())
            await asyncio.sleep(0.01 + 0.0003 * (n % 13))
            reader.cancel()
            done, _ = await asyncio.wait({reader}, timeout=2.0)
            if not done:
                lost += 1
                await cancel_and_wait([reader])
    finally:
        stop.set()
        await publishing
        await writer.close()
        await conn.close()
    assert lost == 0, f"{lost} of 100 readers read on after being cancelled"
