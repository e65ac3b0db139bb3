"""A PONG that comes after its flush timed out (a server that stalled for a moment)
leaves the connection reading: nats-py alone would set the late answer on the flush's
cancelled future, and the error would end its read loop for good."""

from __future__ import annotations

import nats
from nats.aio.msg import Msg

from reach.errors import ReachError
from reach.testing import NatsServer
from reach.transport import connect


async def test_a_pong_after_its_flush_timed_out_leaves_the_connection_reading(
    nats_server: NatsServer,
) -> None:
    conn = await connect([nats_server.url], name="test-late-pong")
    answerer = await nats.connect(nats_server.url)
    try:

        async def answer(msg: Msg) -> None:
            await msg.respond(b"pong:" + msg.data)

        await answerer.subscribe("late.pong", cb=answer)
        await answerer.flush()
        nats_server.pause()
        try:
            try:
                await conn.flush(timeout=1)
            except ReachError:
                pass
            else:
                raise AssertionError("a flush to a paused server returned")
        finally:
            nats_server.resume()
        # the PONG of the flush that timed out arrives now; the connection reads on
        for n in range(3):
            reply = await conn.request("late.pong", str(n).encode(), timeout=5)
            assert reply == f"pong:{n}".encode()
    finally:
        await answerer.close()
        await conn.close()
