"""The call path while an instance or the server fails, with agents in their own OS
processes under an open-loop load of 200 calls/s: a paused instance gets its share back,
a hung one is cut off within a second and back within a second of recovering, the death
of a non-idempotent instance fails only the calls in flight on it, and a caller back
before the agents after a server restart waits for them instead of opening breakers."""

from __future__ import annotations

import asyncio
import signal
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from reach.client import CallResult, ReachClient
from reach.errors import ReachError, ReachTimeout
from reach.testing import NatsServer

from .conftest import manifest

RATE = 200.0
Spawn = Callable[..., Awaitable[Any]]


def _manifest(agent_id: str, *, sla_ms: float, idempotent: bool, interval: float) -> dict[str, Any]:
    m = manifest(agent_id, "echo", interval=interval, timeout=0.3)
    m["capabilities"][0]["idempotent"] = idempotent
    m["capabilities"][0]["latency_sla_ms"] = sla_ms
    return m


async def _three(
    client: ReachClient,
    spawn_agent: Spawn,
    *,
    sla_ms: float = 500.0,
    idempotent: bool = True,
    interval: float = 0.5,
) -> list[Any]:
    procs = [
        await spawn_agent(
            _manifest(f"echo-{i}", sla_ms=sla_ms, idempotent=idempotent, interval=interval)
        )
        for i in range(3)
    ]
    await client.routes.wait_for(
        lambda c: len([i for i in c.find("echo") if i.status == "healthy"]) == 3, timeout=10
    )
    return procs


@dataclass
class Load:
    """An open-loop load: call ``i`` starts at ``t0 + i / RATE`` whatever came before."""

    client: ReachClient
    timeout: float = 2.0
    t0: float = 0.0
    #: (start time, result) of calls served; (start time, error) of calls failed
    served: list[tuple[float, CallResult]] = field(default_factory=list)
    failed: list[tuple[float, ReachError]] = field(default_factory=list)

    async def run(self, seconds: float, at: dict[float, Callable[[], object]]) -> None:
        """Calls for ``seconds``; ``at[t]()`` runs once ``t`` seconds in."""
        self.t0 = time.monotonic()
        todo = sorted(at.items())
        tasks = []
        for i in range(int(RATE * seconds)):
            due = self.t0 + i / RATE
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            while todo and time.monotonic() - self.t0 >= todo[0][0]:
                todo.pop(0)[1]()
            tasks.append(asyncio.create_task(self._one(i)))
        await asyncio.gather(*tasks)

    async def _one(self, i: int) -> None:
        started = time.monotonic() - self.t0
        try:
            result = await self.client.call("echo", {"i": i}, timeout=self.timeout)
        except ReachError as exc:
            self.failed.append((started, exc))
        else:
            self.served.append((started, result))

    def attempts_to(self, agent_id: str, since: float, until: float) -> Counter[str]:
        """Outcomes of the attempts to ``agent_id`` of calls served that started in
        [since, until) (seconds after t0)."""
        out: Counter[str] = Counter()
        for started, result in self.served:
            if since <= started < until:
                out.update(a[2] for a in result.route if a[0] == agent_id)
        return out


async def _watch_state(client: ReachClient, agent_id: str, t0: Callable[[], float]) -> Any:
    """A task noting when (seconds after t0) the breaker of ``agent_id`` changes state."""
    seen: list[tuple[float, str]] = []

    async def watch() -> None:
        last = "closed"
        while True:
            breaker = client.breakers.peek(agent_id)
            state = "closed" if breaker is None else str(breaker.state)
            if state != last:
                seen.append((time.monotonic() - t0(), state))
                last = state
            await asyncio.sleep(0.005)

    return seen, asyncio.create_task(watch())


async def test_an_instance_paused_for_150_ms_gets_its_share_again_within_seconds(
    client: ReachClient, spawn_agent: Spawn
) -> None:
    procs = await _three(client, spawn_agent)
    load = Load(client)
    paused = procs[1]
    pause_at, seconds = 1.0, 7.0

    def resume() -> None:
        paused.signal(signal.SIGCONT)

    def pause() -> None:
        paused.signal(signal.SIGSTOP)
        asyncio.get_running_loop().call_later(0.15, resume)

    await load.run(seconds, {pause_at: pause})
    assert load.failed == []
    # each instance serves >= 20 % of the calls started from 3 s after the pause on
    late = Counter(r.agent_id for started, r in load.served if started >= pause_at + 3.0)
    assert set(late) == {"echo-0", "echo-1", "echo-2"}
    total = sum(late.values())
    assert min(late.values()) >= 0.2 * total, late


async def test_a_hung_instance_is_cut_off_within_a_second_and_back_within_a_second(
    client: ReachClient, spawn_agent: Spawn
) -> None:
    # one attempt waits 1.5 × 200 ms: a hung instance's first failures come 0.3 s in
    procs = await _three(client, spawn_agent, sla_ms=200.0)
    load = Load(client)
    hung = procs[1]
    hang_at, hang_for, seconds = 1.0, 3.0, 6.0
    seen, watcher = await _watch_state(client, hung.agent_id, lambda: load.t0)
    try:
        await load.run(
            seconds,
            {
                hang_at: lambda: hung.signal(signal.SIGSTOP),
                hang_at + hang_for: lambda: hung.signal(signal.SIGCONT),
            },
        )
    finally:
        watcher.cancel()
    assert load.failed == []  # idempotent: every attempt that hung was retried elsewhere
    opened = [t for t, state in seen if state == "open"]
    assert opened, f"the breaker of the hung instance never opened: {seen}"
    assert hang_at < opened[0] <= hang_at + 1.0, seen
    # back in rotation: calls that started within 1 s of recovery were served by it
    recovered = hang_at + hang_for
    back = load.attempts_to(hung.agent_id, recovered, recovered + 1.0)
    assert back["ok"] > 0, (back, seen)
    # and it has its share again soon after
    late = Counter(r.agent_id for started, r in load.served if started >= recovered + 1.5)
    assert late[hung.agent_id] >= 0.2 * sum(late.values()), late


async def test_sigkill_of_a_non_idempotent_instance_fails_only_the_calls_in_flight_on_it(
    client: ReachClient, spawn_agent: Spawn
) -> None:
    """A young caller (its minute holds 200 calls when the instance dies): calls that
    reach nobody afterwards are retried elsewhere, only those it was running fail."""
    procs = await _three(client, spawn_agent, idempotent=False)
    load = Load(client)
    killed = procs[1]
    kill_at, seconds = 1.0, 4.0
    await load.run(seconds, {kill_at: killed.kill})
    for started, exc in load.failed:
        # a timeout of a request it had (not retried: the call may have run)
        assert isinstance(exc, ReachTimeout), exc
        assert kill_at - 1.0 <= started <= kill_at + 0.05, (started, exc)
    # no more than were in flight on it: its share of the calls of one attempt timeout
    assert len(load.failed) <= RATE * 0.75 / 2
    served_after = Counter(r.agent_id for s, r in load.served if s >= kill_at + 0.05)
    assert killed.agent_id not in served_after
    assert sum(served_after.values()) == len([1 for s, _ in load.served if s >= kill_at + 0.05])
    assert len(load.served) + len(load.failed) == int(RATE * seconds)


async def test_a_caller_back_before_the_agents_waits_for_them_and_opens_no_breaker(
    nats_server: NatsServer, client: ReachClient, spawn_agent: Spawn
) -> None:
    """The server restarts; the agents are held (SIGSTOP) so they reconnect a second after
    the caller: meanwhile their subjects have nobody listening."""
    procs = await _three(client, spawn_agent, interval=5.0)  # no probe in the gap
    for p in procs:
        p.signal(signal.SIGSTOP)
    await asyncio.to_thread(nats_server.restart)
    reconnects = client.connection.reconnects
    give_up = time.monotonic() + 10
    while client.connection.reconnects == reconnects or not client.connection.is_connected:
        assert time.monotonic() < give_up, "the caller did not reconnect"
        await asyncio.sleep(0.02)

    async def release() -> None:
        await asyncio.sleep(1.0)
        for p in procs:
            p.signal(signal.SIGCONT)

    releasing = asyncio.create_task(release())
    started = time.monotonic()
    results = await asyncio.gather(*(client.call("echo", {"i": i}, timeout=8.0) for i in range(20)))
    await releasing
    assert {r.agent_id for r in results} <= {"echo-0", "echo-1", "echo-2"}
    assert time.monotonic() - started >= 0.9  # they did wait for the agents
    # nobody's breaker opened on "no responders" while the fabric settled
    assert all(s.state == "closed" for s in client.breakers.snapshot().values())
    assert all(s.failures == 0 for s in client.breakers.snapshot().values())
