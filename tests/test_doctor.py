"""``reach doctor`` names the layer at fault, for each kind of failure, on a real fabric."""

from __future__ import annotations

import json
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

from reach.registry import Registrar
from reach.testing import NatsServer
from tests.cli_helpers import run_reach
from tests.conftest import manifest


async def doctor(server: NatsServer, name: str) -> dict[str, Any]:
    code, out, err = await run_reach("doctor", name, "--json", "--servers", server.url)
    assert code == 0, err
    result: dict[str, Any] = json.loads(out)
    assert [s["number"] for s in result["steps"]] == [1, 2, 3, 4, 5, 6]
    return result


async def test_an_unknown_capability_is_a_registry_problem(
    nats_server: NatsServer, registrar: Registrar
) -> None:
    result = await doctor(nats_server, "no_such_capability")
    assert result["layer"] == "registry"
    assert result["steps"][0]["verdict"] == "fail"
    assert "not in the registry" in result["conclusion"]


async def test_a_healthy_agent_has_no_fault(
    nats_server: NatsServer, registrar: Registrar, spawn_agent: Callable[..., Any]
) -> None:
    await spawn_agent(manifest("fine-1", "fine_cap"))
    result = await doctor(nats_server, "fine_cap")
    assert result["layer"] == "none", result
    verdicts = {s["name"]: s["verdict"] for s in result["steps"]}
    assert verdicts["connectivity"] == "ok"
    assert verdicts["fabric"] == "ok"


async def test_a_dead_agent_is_a_connectivity_problem(
    nats_server: NatsServer, registrar: Registrar, spawn_agent: Callable[..., Any]
) -> None:
    # a long health interval keeps the dead record in the registry while doctor looks
    agent = await spawn_agent(manifest("dead-1", "dead_cap", interval=5.0, timeout=1.0))
    agent.kill()
    result = await doctor(nats_server, "dead-1")
    assert result["layer"] == "connectivity", result
    assert "gone" in result["conclusion"]


async def test_a_hung_agent_is_an_agent_problem(
    nats_server: NatsServer, registrar: Registrar, spawn_agent: Callable[..., Any]
) -> None:
    agent = await spawn_agent(manifest("hung-1", "hung_cap", interval=5.0, timeout=1.0))
    agent.signal(signal.SIGSTOP)
    try:
        result = await doctor(nats_server, "hung_cap")
    finally:
        agent.signal(signal.SIGCONT)
    assert result["layer"] == "agent", result
    assert "hung" in result["conclusion"]


async def test_a_saturated_pool_is_a_dependencies_problem(
    nats_server: NatsServer,
    registrar: Registrar,
    spawn_agent: Callable[..., Any],
    tmp_path: Path,
) -> None:
    flag = tmp_path / "saturated"
    flag.touch()
    await spawn_agent(manifest("busy-1", "busy_cap"), not_ready_file=flag)
    result = await doctor(nats_server, "busy-1")
    assert result["layer"] == "dependencies", result
    assert "connection pool 85% used" in result["conclusion"]
