"""Async-mode capabilities: the call returns a job at once; its result is durable."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from reach.agent import Agent
from reach.client import ReachClient
from reach.errors import BusinessError, ConfigurationError, ContractError, ReachTimeout
from reach.testing import NatsServer

from .calls_helpers import wait_routable

SCHEMA = {"type": "object", "properties": {"rows": {"type": "integer"}}, "required": ["rows"]}


def async_agent(url: str, gate: asyncio.Event) -> Agent:
    agent = Agent(
        {
            "agent_id": "export-1",
            "agent_name": "exporter",
            "version": "1.0.0",
            "mode": "async",
            "capabilities": [
                {
                    "name": "bulk_export",
                    "security_level": 1,
                    "input_schema": SCHEMA,
                    "latency_sla_ms": 200,
                }
            ],
        },
        servers=url,
    )

    @agent.capability("bulk_export")
    async def export(req: dict[str, Any]) -> dict[str, Any]:
        await gate.wait()
        if req["rows"] < 0:
            raise BusinessError("negative export", code="bad_rows")
        return {"file": f"export-{req['rows']}.csv"}

    return agent


async def test_async_call_returns_a_job_at_once_and_the_result_survives_a_caller_restart(
    nats_server: NatsServer, client: ReachClient
) -> None:
    gate = asyncio.Event()
    async with async_agent(nats_server.url, gate):
        await wait_routable(client, "bulk_export", 1)
        accepted = await client.call("bulk_export", {"rows": 5})
        assert accepted.job is not None
        job_id = accepted.job.job_id
        assert (await accepted.job.status()).status == "accepted"
        with pytest.raises(ReachTimeout):
            await accepted.job.result(timeout=0.2)
        gate.set()
        assert await accepted.job.result(timeout=5) == {"file": "export-5.csv"}
        # a new caller process (a new client) finds the job by id
        async with ReachClient(servers=nats_server.url) as later:
            handle = await later.job(job_id)
            assert await handle.result(timeout=5) == {"file": "export-5.csv"}
            record = await handle.status()
            assert record.status == "succeeded"
            assert record.agent_id == "export-1"


async def test_failed_job_raises_its_typed_error_and_bad_input_fails_at_once(
    nats_server: NatsServer, client: ReachClient
) -> None:
    gate = asyncio.Event()
    gate.set()
    async with async_agent(nats_server.url, gate):
        await wait_routable(client, "bulk_export", 1)
        job = await client.submit("bulk_export", {"rows": -1})
        with pytest.raises(BusinessError, match="negative export"):
            await job.result(timeout=5)
        client.validate = False
        with pytest.raises(ContractError, match="rows"):
            await client.submit("bulk_export", {"rows": "many"})


async def test_submit_to_a_sync_capability_is_refused_before_the_call_runs(
    nats_server: NatsServer, client: ReachClient
) -> None:
    agent = Agent(
        {
            "agent_id": "sync-1",
            "agent_name": "sync",
            "version": "1.0.0",
            "capabilities": [{"name": "quick", "security_level": 1}],
        },
        servers=nats_server.url,
    )
    ran: list[Any] = []

    @agent.capability("quick")
    async def quick(req: dict[str, Any]) -> dict[str, Any]:
        ran.append(req)
        return {}

    async with agent:
        await wait_routable(client, "quick", 1)
        with pytest.raises(ConfigurationError, match="not an async-mode capability"):
            await client.submit("quick", {"n": 1})
        assert ran == []  # nothing was done for nothing
