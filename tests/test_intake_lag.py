"""A registrar knows when it reads what agents send late: a round trip on its intake
connection comes back only after everything queued before it has been read."""

from __future__ import annotations

import time

import pytest

from reach.clock import system_clock
from reach.registry.intake import LAG_LIMIT_SEC, IntakeLag
from reach.testing import NatsServer
from reach.transport import Message, connect

#: messages queued for the intake, and what reading each one costs it (seconds)
QUEUED = 60_000
READ_COST = 30e-6


# a flood read slowly on purpose: beside other tests on a busy machine the server could
# cut the slow reader off (a slow consumer) and the count would not add up
@pytest.mark.serial
async def test_a_backlog_on_the_intake_is_trouble_until_it_is_read(nats_server: NatsServer) -> None:
    intake = await connect([nats_server.url], name="intake")
    sender = await connect([nats_server.url], name="flooder")
    read = 0

    def slow_read(msg: Message) -> None:  # a reader with work to do per message
        nonlocal read
        read += 1
        until = time.perf_counter() + READ_COST
        while time.perf_counter() < until:
            pass

    behind: list[float] = []
    lag = IntakeLag(intake, system_clock, lambda: behind.append(time.monotonic()))
    try:
        await intake.subscribe_inline("flood.x", slow_read)
        await intake.flush()
        # idle: a round trip is short and nobody is told of trouble
        assert await lag.measure() < LAG_LIMIT_SEC
        assert not behind
        for _ in range(QUEUED):
            await sender.publish("flood.x", b"x")
        await sender.flush()  # all of it is at the server, queued for the intake
        took = await lag.measure()
        assert read == QUEUED  # the round trip came back behind every queued message
        assert took >= LAG_LIMIT_SEC
        assert behind  # and the registrar was in trouble while it waited
        assert lag.worst == took
        # caught up: quiet again
        behind.clear()
        assert await lag.measure() < LAG_LIMIT_SEC
        assert not behind
    finally:
        await sender.close()
        await intake.close()
