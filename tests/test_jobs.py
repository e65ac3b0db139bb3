"""Async-mode capabilities: the call returns a job at once; its result is durable, kept
as msgpack carries it (bytes, NaN), and a result that cannot be stored fails the job."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
from typing import Any

import pytest

from reach.agent.agent import Agent
from reach.caller.client import ReachClient
from reach.errors import BusinessError, ConfigurationError, ContractError, ReachTimeout
from reach.testing import NatsServer

from .calls_helpers import capability, wait_routable

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
        # with no check before sending, the agent's contract refuses it
        async with ReachClient(servers=nats_server.url, validate=False) as unchecked:
            await wait_routable(unchecked, "bulk_export", 1)
            with pytest.raises(ContractError, match="rows"):
                await unchecked.submit("bulk_export", {"rows": "many"})


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


# -- results that JSON cannot carry ----------------------------------------------------


def _async_agent(url: str, output: dict[str, Any]) -> Agent:
    agent = Agent(
        {
            "agent_id": "job-1",
            "agent_name": "job",
            "version": "1.0.0",
            "mode": "async",
            "capabilities": [capability("work")],
            "health": {"interval_sec": 0.5, "timeout_sec": 0.3},
        },
        servers=url,
    )

    @agent.capability("work")
    async def work(req: Any) -> Any:
        return output["value"]

    return agent


async def test_an_async_job_keeps_bytes_and_nan_in_its_result(
    nats_server: NatsServer, client: ReachClient
) -> None:
    output: dict[str, Any] = {}
    async with _async_agent(nats_server.url, output):
        await wait_routable(client, "work", 1)
        output["value"] = {"blob": b"\xff\xfe\x00", "n": 1}  # not UTF-8
        job = await client.submit("work", {})
        assert await job.result(timeout=5) == {"blob": b"\xff\xfe\x00", "n": 1}
        assert (await job.status()).status == "succeeded"
        output["value"] = {"x": math.nan, "y": math.inf}
        job = await client.submit("work", {})
        result = await job.result(timeout=5)
        assert math.isnan(result["x"])
        assert result["y"] == math.inf
        output["value"] = {"x": 1}
        assert await (await client.submit("work", {})).result(timeout=5) == {"x": 1}


async def test_an_async_job_whose_result_cannot_be_stored_fails_and_says_why(
    nats_server: NatsServer, client: ReachClient
) -> None:
    """A result just under the codec's limit (packed: 8 bytes around the string): the job
    record around it is over it. The job is failed (a contract error), not left
    "accepted" for ever."""
    output: dict[str, Any] = {"value": {"s": "a" * (1024 * 1024 - 8 - 40)}}
    async with _async_agent(nats_server.url, output):
        await wait_routable(client, "work", 1)
        job = await client.submit("work", {})
        with pytest.raises(ContractError, match="cannot be stored"):
            await job.result(timeout=5)
        record = await job.status()
        assert record.status == "failed"
        output["value"] = {"x": 1}  # and the agent goes on
        assert await (await client.submit("work", {})).result(timeout=5) == {"x": 1}


def mixed_agent(url: str) -> Agent:
    """One agent: a quick sync capability and one that runs as a job (its own mode)."""
    agent = Agent(
        {
            "agent_id": "mixed-1",
            "agent_name": "mixed",
            "version": "1.0.0",
            "capabilities": [
                {"name": "quick_lookup", "security_level": 1, "latency_sla_ms": 200},
                {
                    "name": "slow_export",
                    "security_level": 1,
                    "latency_sla_ms": 200,
                    "mode": "async",
                    "input_schema": SCHEMA,
                },
            ],
        },
        servers=url,
    )

    @agent.capability("quick_lookup")
    async def lookup(req: dict[str, Any]) -> dict[str, Any]:
        return {"found": req.get("key", "")}

    @agent.capability("slow_export")
    async def export(req: dict[str, Any]) -> dict[str, Any]:
        if req["rows"] < 0:
            raise BusinessError("negative export", code="bad_rows")
        return {"file": f"export-{req['rows']}.csv"}

    return agent


async def test_one_agent_offers_a_quick_call_and_a_job(
    nats_server: NatsServer, client: ReachClient
) -> None:
    async with mixed_agent(nats_server.url):
        await wait_routable(client, "slow_export", 1)
        quick = await client.call("quick_lookup", {"key": "k"})
        assert quick.job is None
        assert quick.value == {"found": "k"}
        job = await client.submit("slow_export", {"rows": 3})
        assert await job.result(timeout=5) == {"file": "export-3.csv"}
        with pytest.raises(ConfigurationError, match="not an async-mode capability"):
            await client.submit("quick_lookup", {"key": "k"})
        instance = client.routes.find("quick_lookup")[0]
        assert instance.manifest.mode_of("quick_lookup") == "sync"
        assert instance.manifest.mode_of("slow_export") == "async"


def _reach(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "reach", *args, "--servers", url],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


async def test_the_cli_waits_for_a_job_or_reads_it_later(
    nats_server: NatsServer, client: ReachClient
) -> None:
    async with mixed_agent(nats_server.url):
        await wait_routable(client, "slow_export", 1)
        url = nats_server.url
        waited = await asyncio.to_thread(
            _reach, url, "call", "slow_export", '{"rows": 7}', "--wait", "10"
        )
        assert waited.returncode == 0, waited.stderr
        assert json.loads(waited.stdout) == {"file": "export-7.csv"}
        later = await asyncio.to_thread(_reach, url, "call", "slow_export", '{"rows": 8}')
        assert later.returncode == 0, later.stderr
        job_id = json.loads(later.stdout)["job_id"]
        assert f"reach jobs get {job_id}" in later.stderr
        got = await asyncio.to_thread(_reach, url, "jobs", "get", job_id, "--wait")
        assert got.returncode == 0, got.stderr
        assert json.loads(got.stdout) == {"file": "export-8.csv"}
        failed = await client.call("slow_export", {"rows": -1})
        assert failed.job is not None
        with pytest.raises(BusinessError):
            await failed.job.result(timeout=5)
        refused = await asyncio.to_thread(_reach, url, "jobs", "get", failed.job.job_id)
        assert refused.returncode == 1
        assert "BusinessError" in refused.stderr
        assert "negative export" in refused.stderr
        unknown = await asyncio.to_thread(_reach, url, "jobs", "get", "no-such-job")
        assert unknown.returncode == 1
        assert "NotFound" in unknown.stderr
