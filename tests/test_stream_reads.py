"""An operator's read of a stream (``reach agents``, ``top``, ``audit``, ``alerts``, the
doctor, the console) asks again while the stream's server does not answer for a moment,
and names the stream only when it stays unreachable past the read's deadline."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

import pytest

from reach.caller.client import ReachClient
from reach.cli.agents import observed_p99
from reach.errors import ReachTimeout
from reach.testing import NatsServer
from reach.transport import Connection, connect
from reach.transport.streamreads import read_stream

from .calls_helpers import make_agent, wait_routable

#: a stall of the server longer than one JetStream request waits for its reply (5 s):
#: whatever the timing, the first try to start the read fails
STALL = 6.0


@pytest.fixture
async def operator(nats_server: NatsServer) -> AsyncIterator[Connection]:
    conn = await connect([nats_server.url], name="operator")
    try:
        yield conn
    finally:
        await conn.close()


@contextlib.asynccontextmanager
async def stalled(nats_server: NatsServer, seconds: float) -> AsyncIterator[None]:
    """The server stopped (SIGSTOP) from entering until ``seconds`` later (or leaving,
    if sooner), then going on."""
    await asyncio.to_thread(nats_server.pause)
    timer = asyncio.get_running_loop().call_later(seconds, nats_server.resume)
    try:
        yield
    finally:
        timer.cancel()
        nats_server.resume()


async def _read_all(conn: Connection, name: str, within: float = 10.0) -> list[bytes]:
    return [msg.data async for msg in read_stream(conn, name, within=within)]


@pytest.mark.serial
async def test_reach_agents_reads_the_p99_through_a_stall_of_the_streams_server(
    nats_server: NatsServer,
    client: ReachClient,
    operator: Connection,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The p99 column of ``reach agents``, read while its server stalls for a few
    seconds: asked again once it answers, shown, and no note."""
    caplog.set_level(logging.INFO, logger="reach.transport.streamreads")
    agent, _ = make_agent(nats_server.url, "p99-1")
    async with agent:
        await wait_routable(client, "work", 1)
        for n in range(5):
            await client.call("work", {"n": n})
        assert client.audit is not None
        await client.audit.flush()
        async with stalled(nats_server, STALL):
            p99 = await asyncio.wait_for(observed_p99(operator, time.time()), 30)
    assert "no observed p99" not in capsys.readouterr().err
    assert set(p99) == {"p99-1"}
    assert any("stream REACH_AUDIT did not answer" in r.getMessage() for r in caplog.records)


async def test_a_stream_that_stays_unreachable_is_named_after_the_reads_deadline(
    nats_server: NatsServer, operator: Connection
) -> None:
    stream = await operator.stream("OPS", ["ops.>"], create=True)
    await stream.publish("ops.one", b"1", msg_id="one", timeout=5)
    async with stalled(nats_server, 4.0):
        with pytest.raises(ReachTimeout, match=r"^stream OPS unreachable for 1\.5 s: "):
            await asyncio.wait_for(_read_all(operator, "OPS", within=1.5), 10)
    # once it answers again, the same read is served
    assert await asyncio.wait_for(_read_all(operator, "OPS"), 20) == [b"1"]
