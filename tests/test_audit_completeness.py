"""No audit event is lost: 10,000 calls through an agent SIGKILL and a NATS restart leave
exactly one event per completed call."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from reach.audit import WriterConfig, read_events
from reach.caller.client import ReachClient
from reach.errors import ReachError
from reach.registry import Registrar
from reach.testing import NatsServer
from reach.transport import Connection

from .conftest import manifest

CALLS = 10_000
IN_FLIGHT = 32
KILL_AT = 2_000
RESTART_AT = 5_000


async def test_every_completed_call_has_exactly_one_audit_event(
    nats_server: NatsServer,
    registrar: Registrar,
    conn: Connection,
    spawn_agent: Callable[..., Any],
) -> None:
    agents = [await spawn_agent(manifest(f"aud-{n}", "work", interval=1.0)) for n in range(3)]
    client = ReachClient(
        servers=nats_server.url, audit_config=WriterConfig(flush_interval=0.05, retry_max=0.25)
    )
    await client.connect()
    try:
        await client.routes.wait_for(lambda c: len(c.find("work")) == 3, timeout=10)
        issued = 0
        completed = ok = 0
        restarted = asyncio.Event()
        back_at: list[int] = []

        def back(_: object) -> None:
            back_at.append(issued)
            restarted.set()

        async def worker() -> None:
            nonlocal issued, completed, ok
            while issued < CALLS:
                issued += 1
                n = issued
                if n == KILL_AT:
                    agents[0].kill()
                if n == RESTART_AT:
                    # the server goes away and comes back while calls keep being made
                    loop = asyncio.get_running_loop()
                    loop.run_in_executor(None, nats_server.restart).add_done_callback(back)
                try:
                    await client.call("work", {"n": n})
                    ok += 1
                except ReachError:
                    pass
                completed += 1

        await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(IN_FLIGHT))), 240)
        await asyncio.wait_for(restarted.wait(), 30)
        assert completed == CALLS
        assert back_at[0] < CALLS  # the server was back while calls were still being made
        assert ok > CALLS // 2  # the fabric kept serving around the faults
        assert client.audit is not None
        await asyncio.wait_for(client.audit.flush(), 60)
        assert client.audit.dropped == 0
    finally:
        await client.close()
    call_ids = [e.call_id async for e in read_events(conn) if e.side == "caller"]
    assert len(call_ids) == CALLS
    assert len(set(call_ids)) == CALLS  # none written twice (resends are deduplicated)
