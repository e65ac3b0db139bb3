"""A registrar that stalled (SIGSTOP: its process keeps its sockets open) draws no verdict
from the time it did not run. On SIGCONT its timers fire before it has read what waits
in its socket (the heartbeats of the stall, the probes' replies): without care it would
mark unhealthy, or evict, the instances that served every call meanwhile."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator

import pytest

from reach.caller.client import ReachClient
from reach.fabric.embedded import wait_stopped
from reach.testing import NatsServer

from .calls_helpers import make_agent, wait_routable
from .registrar_helpers import RegistrarProcess

pytestmark = pytest.mark.timeout(120)

AGENTS = ("steady-1", "steady-2", "steady-3")
#: the agents' heartbeat interval (make_agent's health: 0.5 s, probes time out at 0.3 s,
#: unhealthy after 2 missed): the stall is many of these
INTERVAL = 0.5
STALL = 4.0
#: how long after SIGCONT the instances are watched
AFTER = 3.0


@pytest.fixture
def registrar_process(mapped_server: NatsServer) -> Iterator[RegistrarProcess]:
    registrar = RegistrarProcess(mapped_server.url, "reg-stall", 1.0)
    try:
        assert registrar.ready.wait(30), f"the registrar did not start: {registrar.lines}"
        yield registrar
    finally:
        registrar.stop()


async def test_a_registrar_stalled_for_many_intervals_marks_nobody_down(
    mapped_server: NatsServer, registrar_process: RegistrarProcess
) -> None:
    agents = [make_agent(mapped_server.url, agent_id)[0] for agent_id in AGENTS]
    calls = failed = 0
    try:
        for agent in agents:
            await agent.start()
        async with ReachClient(servers=mapped_server.url) as client:
            await wait_routable(client, "work", len(AGENTS))
            pid = registrar_process.proc.pid
            os.kill(pid, signal.SIGSTOP)
            wait_stopped(pid)
            loop = asyncio.get_running_loop()
            resumed_at: float | None = None
            end = loop.time() + STALL + AFTER
            while loop.time() < end:  # bounded: the calls flow through stall and resume
                if resumed_at is None and loop.time() >= end - AFTER:
                    os.kill(pid, signal.SIGCONT)
                    resumed_at = loop.time()
                calls += 1
                try:
                    await client.call("work", {"n": calls})
                except Exception:
                    failed += 1
                await asyncio.sleep(0.02)
            routed = {i.agent_id for i in client.routes.find("work")}
            marked = list(registrar_process.marks)  # before the agents say goodbye
    finally:
        for agent in agents:
            await agent.stop()
    err = registrar_process.stop()
    assert marked == [], marked
    assert "registrar stalled for" in err, err  # it noticed, and said so
    assert routed == set(AGENTS)
    assert calls > 50
    assert failed == 0
