"""A job's result is read only by the client that called it and written only by the agent
that runs it, whatever the clearance of anyone else holding the jobs role.

A level-1 caller with the jobs role read and overwrote a level-4 job's result: KV
permissions named the whole bucket. A job's key now names both parties
(``job.<client_id>.<agent_id>.<random>``) and each permission names one of them.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from reach import Agent
from reach.caller.client import ReachClient
from reach.errors import NotAuthorized
from reach.wire import subjects

from ..calls_helpers import wait_routable
from .conftest import Refusals, UpFabric, attacker


def export_agent(url: str, agent_id: str) -> Agent:
    agent = Agent(
        {
            "agent_id": agent_id,
            "agent_name": "exporter",
            "version": "1.0.0",
            "mode": "async",
            "capabilities": [{"name": "bulk_export", "security_level": 4}],
        },
        servers=url,
    )

    @agent.capability("bulk_export")
    async def export(req: dict[str, Any]) -> dict[str, Any]:
        return {"file": "all-customers.csv"}

    return agent


async def test_a_job_result_is_the_caller_and_the_agent_s_alone(
    up_fabric: UpFabric, refusals: Refusals
) -> None:
    victim_id, victim = await up_fabric.add_client(level=4, roles=("jobs",))
    _, snoop = await up_fabric.add_client(level=1, roles=("jobs",))
    _, exporter = await up_fabric.add_client(
        level=4, agent_id="exp-1", caps=("bulk_export",), roles=("jobs",)
    )
    _, forger = await up_fabric.add_client(agent_id="evil-1", caps=("other",), roles=("jobs",))
    agent = export_agent(up_fabric.url, "exp-1")
    agent.credentials = exporter
    async with agent, ReachClient(servers=up_fabric.url, credentials=victim) as client:
        await wait_routable(client, "bulk_export", 1)
        accepted = await client.call("bulk_export", {})
        assert accepted.job is not None
        job_id = accepted.job.job_id
        assert job_id.startswith(f"{victim_id}.exp-1.")
        assert await accepted.job.result(timeout=5) == {"file": "all-customers.csv"}

        key = f"$KV.{subjects.JOBS_BUCKET}.job.{job_id}"
        stream = f"KV_{subjects.JOBS_BUCKET}"
        nc = await attacker(up_fabric, snoop, error_cb=refusals.on_error)
        try:
            for api, body in (
                (f"$JS.API.DIRECT.GET.{stream}.{key}", {}),
                (f"$JS.API.DIRECT.GET.{stream}", {"next_by_subj": "$KV.REACH_JOBS.>", "batch": 9}),
                (f"$JS.API.STREAM.MSG.GET.{stream}", {"last_by_subj": key}),
            ):
                await nc.publish(api, json.dumps(body).encode(), reply=nc.new_inbox())
                await refusals.wait_for(api)
            for subject in (f"reach.v1.kv.REACH_JOBS.job.{victim_id}.>", "reach.v1.kv.>"):
                await nc.subscribe(subject)
                await refusals.wait_for(subject)
        finally:
            await nc.close()
        evil = await attacker(up_fabric, forger, error_cb=refusals.on_error)
        try:
            await evil.publish(key, b'{"status": "succeeded", "result": "forged"}')
            await refusals.wait_for(key)
            stolen = f"$KV.{subjects.JOBS_BUCKET}.job.{victim_id}.exp-1.x"
            await evil.publish(stolen, b"{}")
            await refusals.wait_for(stolen)
        finally:
            await evil.close()
        # the victim still reads its own result, unchanged
        again = await client.job(job_id)
        assert await asyncio.wait_for(again.result(), 5) == {"file": "all-customers.csv"}


async def test_a_caller_without_the_jobs_role_is_refused_before_the_job_runs(
    up_fabric: UpFabric,
) -> None:
    """Its result would be in REACH_JOBS, which such a caller may not read: the agent
    refuses the call, naming the role, and the handler never runs."""
    _, plain = await up_fabric.add_client(level=4)
    _, exporter = await up_fabric.add_client(
        level=4, agent_id="exp-2", caps=("bulk_export",), roles=("jobs",)
    )
    ran: list[dict[str, Any]] = []
    agent = Agent(
        {
            "agent_id": "exp-2",
            "agent_name": "exporter",
            "version": "1.0.0",
            "mode": "async",
            "capabilities": [{"name": "bulk_export", "security_level": 4}],
        },
        servers=up_fabric.url,
        credentials=exporter,
    )

    @agent.capability("bulk_export")
    async def export(req: dict[str, Any]) -> dict[str, Any]:
        ran.append(req)
        return {"file": "all-customers.csv"}

    async with agent, ReachClient(servers=up_fabric.url, credentials=plain) as client:
        await wait_routable(client, "bulk_export", 1)
        with pytest.raises(NotAuthorized, match="--role jobs") as refused:
            await client.call("bulk_export", {})
        assert "lacks the 'jobs' role" in str(refused.value)
    assert ran == []
    assert agent._server.denials == 1
