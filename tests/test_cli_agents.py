"""``reach agents`` lists the registry from another process: table, filters, JSON."""

from __future__ import annotations

import json
from pathlib import Path

from reach.agent import Agent
from reach.client import ReachClient
from reach.testing import NatsServer

from .cli_helpers import run_reach
from .conftest import manifest


async def test_reach_agents_lists_instances_with_health_load_version_and_age(
    nats_server: NatsServer, client: ReachClient
) -> None:
    a = Agent(
        manifest("lister-1", "web_search", tags=("search",), version="2.1.0"),
        servers=nats_server.url,
    )
    b = Agent(manifest("lister-2", "make_report", tags=("report",)), servers=nats_server.url)
    for agent in (a, b):
        for cap in agent.manifest.capabilities:

            @agent.capability(cap.name)
            async def handle(req: object) -> object:
                return req

    async with a, b:
        await client.routes.wait_for(lambda c: len(c.all()) == 2, timeout=5)
        code, out, _ = await run_reach("agents", "--servers", nats_server.url)
        assert code == 0
        for expected in ("lister-1", "lister-2", "2.1.0", "web_search", "healthy", "0/64"):
            assert expected in out
        code, out, _ = await run_reach("agents", "--servers", nats_server.url, "--tag", "search")
        assert "lister-1" in out
        assert "lister-2" not in out
        code, out, _ = await run_reach(
            "agents", "--servers", nats_server.url, "--capability", "make_report", "--json"
        )
        rows = [json.loads(line) for line in out.splitlines()]
        assert [r["manifest"]["agent_id"] for r in rows] == ["lister-2"]
        assert rows[0]["status"] == "healthy"


async def test_reach_agents_without_nats_fails_with_one_line(tmp_path: Path) -> None:
    code, _out, err = await run_reach("agents", "--servers", "nats://127.0.0.1:1")
    assert code == 1
    assert err.strip().count("\n") == 0
    assert "cannot connect" in err


async def test_reach_agents_without_registry_says_to_run_reach_up(nats_server: NatsServer) -> None:
    code, _, err = await run_reach("agents", "--servers", nats_server.url)
    assert code == 1
    assert "reach up" in err
