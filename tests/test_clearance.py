"""An agent serves no capability above its credential's clearance: the SDK's start fails
with ClearanceExceeded naming the capability and both levels (audited by the registrar),
an open fabric checks nothing, and `reach creds add` refuses such a credential up front
where it knows the capability's level (its --manifest, the registry)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from reach.audit import AuditEvent, read_events
from reach.errors import ClearanceExceeded, RegistrationRefused
from reach.registry import Registrar
from reach.testing import NatsServer

from .calls_helpers import Behaviour, capability, make_agent
from .cli_helpers import run_reach
from .conftest import Fabric, vault_agent


async def registrar_denials(fabric: Fabric, agent_id: str) -> list[AuditEvent]:
    """The registrar's audited denials of ``agent_id``, polled until one is there (its
    audit writer sends them in batches)."""
    async with asyncio.timeout(10):
        while True:
            events = [
                e
                async for e in read_events(fabric.conn)
                if e.side == "registrar" and e.callee == agent_id
            ]
            if events:
                return events
            await asyncio.sleep(0.05)


async def test_an_agent_above_its_clearance_fails_to_start_naming_the_levels(
    fabric: Fabric,
) -> None:
    # intruder: level 1, bound to intruder-1, lists weather and step_b
    agent, served = make_agent(
        fabric.url, "intruder-1", capability("step_b"), capability("weather", level=3)
    )
    agent.credentials = fabric.creds["intruder"]
    async with asyncio.timeout(15):  # refused at once: never retried
        with pytest.raises(ClearanceExceeded) as refused:
            await agent.start()
    error = refused.value
    assert isinstance(error, RegistrationRefused)
    assert (error.capability, error.security_level, error.clearance) == ("weather", 3, 1)
    assert error.agent_id == "intruder-1"
    assert error.layer == "security"
    message = str(error)
    assert message.startswith("intruder-1 cannot join the fabric: announce: "), message
    assert "client intruder holds clearance 1 and may not serve weather at security_level 3" in (
        message
    )
    assert "step_b" not in message  # at level 1, within its clearance
    (denial,) = await registrar_denials(fabric, "intruder-1")
    assert denial.code == "above_clearance:weather:3:1"
    assert denial.caller == "intruder"
    assert served.calls == 0

    within, _ = make_agent(fabric.url, "intruder-1", capability("weather", level=1))
    within.credentials = fabric.creds["intruder"]
    async with within:  # at its own level it serves
        pass


async def test_an_open_fabric_has_no_clearance_to_check(
    nats_server: NatsServer, registrar: Registrar
) -> None:
    agent, _ = make_agent(nats_server.url, "open-1", capability("weather", level=4))
    async with agent:
        assert agent.agent_id == "open-1"


# -- reach creds add ------------------------------------------------------------------


def write_manifest(path: Path, agent_id: str | None, **levels: int) -> Path:
    data: dict[str, Any] = {
        "agent_name": "exporter",
        "version": "1.0.0",
        "capabilities": [{"name": n, "security_level": lv} for n, lv in levels.items()],
    }
    if agent_id is not None:
        data["agent_id"] = agent_id
    path.write_text(yaml.safe_dump(data))
    return path


async def listed(fabric: Fabric) -> dict[str, dict[str, Any]]:
    code, out, err = await run_reach("creds", "list", "--json", "--servers", fabric.url)
    assert code == 0, out + err
    return {row["client_id"]: row for row in map(json.loads, out.splitlines())}


async def test_creds_add_refuses_a_capability_above_its_level_from_the_manifest(
    fabric: Fabric, tmp_path: Path
) -> None:
    manifest = write_manifest(tmp_path / "agent.yaml", "exp-1", public_search=1, bulk_export=4)
    add = ("creds", "add", "exporter", "--manifest", str(manifest), "--servers", fabric.url)
    code, out, err = await run_reach(*add, "--level", "2", "--cap", "bulk_export")
    assert code == 2, out + err
    assert err.splitlines() == [
        f"error: --cap bulk_export: bulk_export is at security_level 4 in {manifest},"
        " above --level 2: an agent serves no capability above its credential's level"
    ]
    # without --cap: every capability the manifest declares, so bulk_export too
    code, out, err = await run_reach(*add, "--level", "2")
    assert code == 2, out + err
    assert "bulk_export is at security_level 4" in err
    assert "exporter" not in await listed(fabric)

    code, out, err = await run_reach(*add, "--level", "4")
    assert code == 0, out + err
    record = (await listed(fabric))["exporter"]
    assert record["agent_id"] == "exp-1"
    assert sorted(record["capabilities"]) == ["bulk_export", "public_search"]

    code, out, err = await run_reach(
        "creds", "add", "searcher", "--level", "1", "--cap", "public_search",
        "--manifest", str(manifest), "--servers", fabric.url,
    )  # fmt: skip
    assert code == 0, out + err
    assert (await listed(fabric))["searcher"]["capabilities"] == ["public_search"]


async def test_creds_add_refuses_what_the_manifest_does_not_say(
    fabric: Fabric, tmp_path: Path
) -> None:
    named = write_manifest(tmp_path / "named.yaml", "exp-2", public_search=1)
    unnamed = write_manifest(tmp_path / "unnamed.yaml", None, public_search=1)
    cases = [
        (["--manifest", str(named), "--agent-id", "other-1"], "but"),
        (["--manifest", str(named), "--cap", "bulk_export"], "declares no capability"),
        (["--manifest", str(unnamed)], "names no agent_id"),
    ]
    for args, said in cases:
        code, out, err = await run_reach(
            "creds", "add", "x", "--level", "4", *args, "--servers", fabric.url
        )
        assert code == 2, (args, out + err)
        assert said in err, (args, err)
        assert len(err.splitlines()) == 1, (args, err)


async def test_creds_add_refuses_a_capability_served_above_its_level(
    fabric: Fabric, tmp_path: Path
) -> None:
    add = ("creds", "add", "low", "--agent-id", "low-1", "--cap", "customer_orders")
    async with vault_agent(fabric, Behaviour()):  # customer_orders at level 3
        code, out, err = await run_reach(*add, "--level", "2", "--servers", fabric.url)
        assert code == 2, out + err
        assert err.splitlines() == [
            "error: --cap customer_orders: customer_orders is served at security_level 3"
            " by vault-1, above --level 2: an agent serves no capability above its"
            " credential's level"
        ]
        assert "low" not in await listed(fabric)
        code, out, err = await run_reach(*add, "--level", "3", "--servers", fabric.url)
        assert code == 0, out + err
    # a capability nobody serves and no manifest declares: its level is checked when the
    # agent announces
    code, out, err = await run_reach(
        "creds", "add", "unknown", "--level", "1", "--agent-id", "u-1", "--cap", "unheard_of",
        "--servers", fabric.url,
    )  # fmt: skip
    assert code == 0, out + err
