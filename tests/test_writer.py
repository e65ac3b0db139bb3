"""The call path's writer: messages written at once or at the end of the turn, in order.

Against a real nats-server: a plain nats-py subscription sees what went over the wire.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import nats
import nats.errors
import pytest

from reach.testing import NatsServer
from reach.transport import Connection, connect

from .poll_helpers import until


@pytest.fixture
async def conn(nats_server: NatsServer) -> AsyncIterator[Connection]:
    c = await connect([nats_server.url], name="writer-test")
    yield c
    await c.close()


async def _collect(url: str, subject: str, count: int) -> tuple[nats.NATS, list[bytes]]:
    nc = await nats.connect(url)
    got: list[bytes] = []

    async def on(msg: object) -> None:
        got.append(msg.data)  # type: ignore[attr-defined]

    await nc.subscribe(subject, cb=on)
    # twice: nats-py writes flush()'s PING ahead of the SUB still in its buffer, so one PONG
    # does not prove the subscription is in place (see Connection.flush). Under CPU load
    # the server read the SUB after this test's publishes from the other connection.
    await nc.flush()
    await nc.flush()
    return nc, got


async def test_one_turns_messages_arrive_in_the_order_they_were_published(
    nats_server: NatsServer, conn: Connection
) -> None:
    # the first goes to the socket at once, the rest of the turn after it; publishes made
    # through nats-py's own path in between keep their place
    watcher, got = await _collect(nats_server.url, "w.>", 300)
    try:
        writer = conn._writer
        expected = []
        for n in range(300):
            data = str(n).encode()
            expected.append(data)
            if n % 7 == 3:
                await conn.publish(f"w.{n}", data)  # nats-py's queue, flushed by its task
            else:
                writer.publish(f"w.{n}", data)
        await until(lambda: len(got) == 300, "all 300 messages", timeout=5.0)
        assert got == expected
    finally:
        await watcher.close()


async def test_messages_published_over_several_turns_all_arrive(
    nats_server: NatsServer, conn: Connection
) -> None:
    watcher, got = await _collect(nats_server.url, "t.>", 200)
    try:
        for n in range(200):
            conn._writer.publish(f"t.{n}", str(n).encode())
            if n % 10 == 0:
                await asyncio.sleep(0)  # a new turn: its first message goes at once
        await until(lambda: len(got) == 200, "all 200 messages", timeout=5.0)
        assert got == [str(n).encode() for n in range(200)]
    finally:
        await watcher.close()


async def test_a_message_over_max_payload_is_refused_by_name(conn: Connection) -> None:
    with pytest.raises(nats.errors.MaxPayloadError):
        conn._writer.publish("big", b"x" * (conn.max_payload + 1))


async def test_while_disconnected_messages_wait_for_the_reconnect(
    nats_server: NatsServer,
) -> None:
    # a stream records them, so no subscriber has to be there at the reconnect
    c = await connect([nats_server.url], name="writer-reconnect")
    try:
        stream = await c.stream("WRITER_TEST", ["r.>"], create=True)
        await nats_server.stop()
        await until(lambda: not c.is_connected, "the disconnect", timeout=5.0)
        # nats-py's path takes over: buffered, not lost, not raised
        for n in range(5):
            c._writer.publish(f"r.{n}", str(n).encode())
        await nats_server.start()
        await until(lambda: c.is_connected, "the reconnect", timeout=15)
        got: list[bytes] = []
        for _ in range(100):
            got = [m.data async for m in stream.read("r.>")]
            if len(got) == 5:
                break
            await asyncio.sleep(0.05)
        assert got == [str(n).encode() for n in range(5)]
    finally:
        await c.close()
