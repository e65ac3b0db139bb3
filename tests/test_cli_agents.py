"""``reach agents`` lists the registry from another process: table, filters, JSON, one
line per agent when piped; it connects where its credentials file says, and with a
caller's credentials (no audit stream) it still lists the agents, as ``reach top`` does."""

from __future__ import annotations

import json
from pathlib import Path

from reach.agent.agent import Agent
from reach.audit.stats import LATENCY
from reach.caller.client import ReachClient
from reach.registry import Registrar
from reach.security.credentials import CredentialsFile
from reach.testing import NatsServer

from .calls_helpers import capability, make_agent, wait_routable
from .cli_helpers import CLEAN_ENV, reach_cli, run_reach
from .conftest import manifest
from .up_helpers import Secured, secured_agent


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


# -- with a caller's credentials -------------------------------------------------------


async def test_agents_and_top_with_a_callers_credentials_still_list_the_agents(
    secured: Secured,
) -> None:
    """A caller may not read the audit stream: the list shows without observed p99 (and
    a note saying why) rather than the command failing after a timeout."""
    async with (
        secured_agent(secured),
        ReachClient(servers=secured.url, credentials=secured.admin) as admin,
    ):
        await wait_routable(admin, "echo", 1)
        as_watcher = ("--servers", secured.url, "--creds", str(secured.watcher))
        code, out, err = await reach_cli("agents", *as_watcher)
        assert code == 0, err
        (row,) = [line for line in out.splitlines() if "a-1" in line]
        assert "echo" in row
        assert "healthy" in row
        assert "note: no observed p99" in err
        assert "refused these credentials" in err
        code, out, err = await reach_cli("top", "--once", *as_watcher)
        assert code == 0, err
        assert "1 instance(s)" in out
        assert "calls not shown" in out
        assert [line for line in out.splitlines() if line.lstrip().startswith("a-1")]


async def test_agents_with_an_admins_credentials_shows_the_observed_p99(
    secured: Secured,
) -> None:
    """On a fabric `reach up` started, the audit stream is read as `reach top` reads it:
    the p99 of the last minute's calls shows beside each instance that served some."""
    async with (
        secured_agent(secured),
        ReachClient(servers=secured.url, credentials=secured.admin) as admin,
    ):
        await wait_routable(admin, "echo", 1)
        for n in range(5):
            await admin.call("echo", {"n": n})
        assert admin.audit is not None
        await admin.audit.flush()
        code, out, err = await reach_cli(
            "agents", "--servers", secured.url, "--creds", str(secured.admin)
        )
    assert code == 0, err
    assert "no observed p99" not in err
    (header,) = [line for line in out.splitlines() if "p99" in line]
    (row,) = [line for line in out.splitlines() if "a-1" in line]
    assert "healthy" in row
    columns = [c.strip() for c in header.split("┃")]  # the header's rule is heavier
    cells = dict(zip(columns, (c.strip() for c in row.split("│")), strict=True))
    assert cells["p99"].endswith("ms"), row


# -- piped -----------------------------------------------------------------------------


async def test_agents_piped_prints_each_agent_on_one_line_however_wide(
    nats_server: NatsServer, client: ReachClient
) -> None:
    names = ("generate_industry_report", "summarise_quarterly_filings", "forecast_demand")
    agent, _ = make_agent(
        nats_server.url, "report-generator-eu-west-001", *(capability(n) for n in names)
    )
    async with agent:
        await wait_routable(client, names[0], 1)
        code, out, err = await reach_cli("agents", "--servers", nats_server.url)
    assert code == 0, err
    (row,) = [line for line in out.splitlines() if "report-generator-eu-west-001" in line]
    assert ", ".join(names) in row  # not wrapped onto the lines below
    assert "healthy" in row
    assert len(row.rstrip()) > 80
    assert len(out.strip().splitlines()) == 3  # header, rule, the one agent
    assert LATENCY in err  # what p99 measures, beside the rows


# -- where a credentials file says to connect ------------------------------------------


async def test_a_command_connects_where_its_credentials_file_says(
    nats_server: NatsServer, registrar: Registrar, tmp_path: Path
) -> None:
    """No --servers and no REACH_URL: the url in the file, not 127.0.0.1:4222."""
    creds = tmp_path / "watcher.creds"
    CredentialsFile(nats_server.url, "watcher", "open-fabric-ignores-it").write(creds)
    agent, _ = make_agent(nats_server.url, "located-1", capability("echo"))
    async with agent:
        code, out, err = await reach_cli("agents", "--creds", str(creds), cwd=tmp_path)
        assert code == 0, err
        assert "located-1" in out
        # REACH_URL still wins over the file
        env = {**CLEAN_ENV, "REACH_URL": "nats://127.0.0.1:1"}
        code, _, err = await reach_cli("agents", "--creds", str(creds), env=env, cwd=tmp_path)
        assert code == 1
        assert "127.0.0.1:1" in err
