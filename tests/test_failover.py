"""Three agent processes under steady load; one is SIGKILLed mid-run: no call fails."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter

import pytest

from reach.caller.client import ReachClient
from reach.errors import ReachError
from reach.testing import NatsServer

from .conftest import manifest


# calls at a set rate while an instance dies: alone, so that the rate is the fabric's
@pytest.mark.serial
async def test_sigkill_of_one_of_three_instances_under_200_calls_per_second_fails_no_call(
    client: ReachClient, spawn_agent: object
) -> None:
    procs = []
    for i in range(3):
        m = manifest(f"echo-{i}", "echo", interval=0.5, timeout=0.3)
        m["capabilities"][0]["idempotent"] = True
        procs.append(await spawn_agent(m))  # type: ignore[operator]
    await client.routes.wait_for(
        lambda c: len([i for i in c.find("echo") if i.status == "healthy"]) == 3, timeout=10
    )
    served: Counter[str] = Counter()
    failures: list[BaseException] = []
    rate, duration = 200, 10.0

    async def one(i: int) -> None:
        try:
            result = await client.call("echo", {"i": i}, timeout=2.0)
            served[result.agent_id] += 1
        except ReachError as exc:
            failures.append(exc)

    tasks = []
    start = time.monotonic()
    killed = False
    for i in range(int(rate * duration)):
        target = start + i / rate
        delay = target - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        if not killed and time.monotonic() - start >= duration / 2:
            procs[1].kill()
            killed = True
        tasks.append(asyncio.create_task(one(i)))
    await asyncio.gather(*tasks)
    assert failures == []
    assert sum(served.values()) == rate * duration
    assert set(served) == {"echo-0", "echo-1", "echo-2"}
    # after the kill the survivors carried the load
    assert served["echo-0"] + served["echo-2"] > served["echo-1"]


async def test_a_call_that_reached_nobody_is_rerouted_at_once(
    nats_server: NatsServer, client: ReachClient
) -> None:
    from .calls_helpers import make_agent, wait_routable

    live, _ = make_agent(nats_server.url, "live-1")
    dead, _ = make_agent(nats_server.url, "dead-1")
    async with live:
        await dead.start()
        try:
            await wait_routable(client, "work", 2)
            # gone without a goodbye: the route cache still lists it for a while
            await dead.connection.close()
            for _ in range(50):
                result = await client.call("work", {})
                if result.attempts == 2:
                    break
            else:
                raise AssertionError("no call was routed to the dead instance")
        finally:
            with contextlib.suppress(Exception):
                await dead.stop()
    (first, second) = result.route
    assert (first[0], first[2]) == ("dead-1", "connect")
    assert (second[0], second[2]) == ("live-1", "ok")
    # no 200 ms back-off before the second attempt: the first reached nobody
    assert result.latency_ms < 200
