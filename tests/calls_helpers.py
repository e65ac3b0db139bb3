"""Building blocks for call tests: in-process agents with controllable handlers, and a
report capability's input contract."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from reach.agent.agent import Agent, ReadinessCheck
from reach.caller.client import ReachClient
from reach.errors import BusinessError
from reach.telemetry import Telemetry


@dataclass
class Behaviour:
    """What a test agent's handler does; tests flip these while it runs."""

    sleep: float = 0.0
    fail: str | None = None  # "business" | "crash"
    calls: int = 0
    cancelled: int = 0
    finished: int = 0
    seen: list[Any] = field(default_factory=list)
    cancelled_event: asyncio.Event = field(default_factory=asyncio.Event)


def capability(
    name: str = "work",
    *,
    sla_ms: float = 400,
    idempotent: bool = False,
    qps: float | None = None,
    input_schema: dict[str, Any] | None = None,
    output_schema: dict[str, Any] | None = None,
    tags: tuple[str, ...] = ("work",),
    level: int = 1,
) -> dict[str, Any]:
    return {
        "name": name,
        "tags": list(tags),
        "latency_sla_ms": sla_ms,
        "idempotent": idempotent,
        "qps": qps,
        "security_level": level,
        "input_schema": input_schema or {},
        "output_schema": output_schema or {},
    }


def make_agent(
    url: str,
    agent_id: str,
    *caps: dict[str, Any],
    behaviour: Behaviour | None = None,
    version: str = "1.0.0",
    max_concurrency: int = 64,
    readiness: ReadinessCheck | None = None,
    handler: Callable[[Any], Awaitable[Any]] | None = None,
    telemetry: Telemetry | None = None,
    health: dict[str, Any] | None = None,
) -> tuple[Agent, Behaviour]:
    b = behaviour or Behaviour()
    manifest = {
        "agent_id": agent_id,
        "agent_name": "test",
        "version": version,
        "max_concurrency": max_concurrency,
        "capabilities": list(caps) or [capability()],
        "health": health
        or {"interval_sec": 0.5, "timeout_sec": 0.3, "failures_before_unhealthy": 2},
    }
    agent = Agent(manifest, servers=url, readiness=readiness, telemetry=telemetry)

    async def default(req: Any) -> Any:
        b.calls += 1
        b.seen.append(req)
        try:
            if b.sleep:
                await asyncio.sleep(b.sleep)
        except asyncio.CancelledError:
            b.cancelled += 1
            b.cancelled_event.set()
            raise
        if b.fail == "business":
            raise BusinessError("no data for that range", code="no_data")
        if b.fail == "crash":
            raise RuntimeError("boom")
        b.finished += 1
        return {"by": agent_id, "echo": req}

    for cap in agent.manifest.capabilities:
        agent.capability(cap.name)(handler or default)
    return agent, b


async def wait_routable(client: ReachClient, capability: str, count: int) -> None:
    await client.routes.wait_for(
        lambda c: len([i for i in c.find(capability) if i.status == "healthy"]) >= count,
        timeout=5,
    )


def hold_until_released(answer: Any) -> tuple[Callable[[Any], Any], asyncio.Event, asyncio.Event]:
    """A handler that says it ``entered``, then waits for ``release`` to answer."""
    entered = asyncio.Event()
    release = asyncio.Event()

    async def hold(req: Any) -> Any:
        entered.set()
        await release.wait()
        return answer

    return hold, entered, release


#: a report capability's input contract: industry and time range required
REPORT_INPUT = {
    "type": "object",
    "properties": {
        "industry": {"type": "string"},
        "time_range": {"type": "string"},
        "include_charts": {"type": "boolean"},
    },
    "required": ["industry", "time_range"],
}
