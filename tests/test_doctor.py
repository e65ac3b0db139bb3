"""``reach doctor`` names the layer at fault, for each kind of failure: on a real fabric,
and from gathered evidence alone (``conclude`` is a pure function of it)."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from reach.audit.eventmodels import AuditAttempt, AuditEvent
from reach.caller.client import ReachClient
from reach.errors import NoResponders, NotAuthorized, ReachTimeout
from reach.fabric.doctor import Evidence, conclude, diagnose
from reach.registry import Registrar
from reach.registry.probes import ProbeResult
from reach.testing import NatsServer
from reach.transport import Connection
from reach.wire.models import Instance, ProbeReply
from tests.audit_helpers import flushed
from tests.calls_helpers import Behaviour, capability, make_agent, wait_routable
from tests.cli_helpers import run_reach
from tests.conftest import Fabric, manifest, vault_agent
from tests.routing_helpers import instance


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


# -- the calls' own failures, weighed after the other steps ----------------------------


def live(agent_id: str, now: float, cap: str = "mix") -> Instance:
    return instance(agent_id, capabilities=(cap,)).model_copy(
        update={"registered_at": now - 120, "last_heartbeat_at": now - 0.5}
    )


def answered(inst: Instance) -> ProbeResult:
    reply = ProbeReply(
        agent_id=inst.agent_id, instance_id=inst.instance_id, in_flight=0, max_concurrency=64
    )
    return ProbeResult(reply, 1.0)


def call(ts: float, callee: str, error: str | None = None, **fields: Any) -> AuditEvent:
    outcome = "ok" if error is None else "denied" if error == "denied" else "error"
    attempt = AuditAttempt(agent_id=callee, outcome=error or "ok", latency_ms=2.0)
    return AuditEvent(
        ts=ts,
        capability="mix",
        callee=callee,
        outcome=outcome,
        error=error,
        latency_ms=2.0,
        attempts=[attempt],
        **fields,
    )


def evidence(now: float, instances: list[Instance], events: list[AuditEvent]) -> Evidence:
    return Evidence(
        target="mix",
        now=now,
        instances=instances,
        capability="mix",
        events=events,
        probes={i.agent_id: answered(i) for i in instances},
        registrar_answered=True,
    )


def test_doctor_names_a_dead_instance_before_a_business_rejection() -> None:
    now = time.time()
    alive, dead = live("m-1", now), live("m-2", now)
    events = [call(now - 30, "m-1", "business", code="E_NOPE", description="nope")]
    events += [call(now - 20 + n, "m-1") for n in range(10)]
    ev = evidence(now, [alive, dead], events)
    ev.probes["m-2"] = ProbeResult(None, 1.0, "NoResponders: none", NoResponders("none"))
    diagnosis = conclude(ev)
    assert diagnosis.layer == "connectivity", diagnosis
    assert "m-2 is gone" in diagnosis.conclusion
    # the business rejection is still reported, as a step-2 finding
    route = diagnosis.steps[1]
    assert route.verdict == "warn"
    assert any("1 failed" in f for f in route.findings)


@pytest.mark.parametrize(
    ("error", "layer", "phrase"),
    [
        ("timeout", "agent", "timed out"),
        ("denied", "fabric", "denied"),
        ("unavailable", "dependencies", "not taking calls"),
        ("internal", "agent", "the handler failed"),
    ],
)
def test_doctor_finds_a_fault_when_every_call_fails(error: str, layer: str, phrase: str) -> None:
    now = time.time()
    events = [call(now - 10 + n, "m-1", error) for n in range(5)]
    diagnosis = conclude(evidence(now, [live("m-1", now)], events))
    assert diagnosis.steps[1].verdict == "fail"
    assert diagnosis.layer == layer, diagnosis
    assert phrase in diagnosis.conclusion
    assert "5 of 5" in diagnosis.conclusion


async def test_doctor_says_calls_time_out_when_the_handler_is_slower_than_its_sla(
    nats_server: NatsServer, client: ReachClient, conn: Connection
) -> None:
    # the handler takes 1 s, the SLA is 200 ms: the caller gives up at 300 ms; probes
    # are answered at once, so only the calls themselves show the fault
    agent, _ = make_agent(
        nats_server.url, "slow-1", capability("slow_cap", sla_ms=200), behaviour=Behaviour(sleep=1)
    )
    async with agent:
        await wait_routable(client, "slow_cap", 1)
        for _ in range(3):
            with pytest.raises(ReachTimeout):
                await client.call("slow_cap", {})
        await flushed(client)
        diagnosis = await diagnose(conn, "slow_cap", probe_timeout=2)
    assert diagnosis.steps[1].verdict == "fail"
    assert diagnosis.steps[2].verdict == "ok"  # it answered its probe
    assert diagnosis.layer == "agent", diagnosis
    assert "3 of 3 recent call(s): timed out" in diagnosis.conclusion


async def test_doctor_blames_the_security_layer_for_denied_calls(fabric: Fabric) -> None:
    async with (
        vault_agent(fabric, Behaviour()) as vault,
        ReachClient(servers=fabric.url, credentials=fabric.creds["analyst"]) as analyst,
    ):
        await wait_routable(analyst, "customer_orders", 1)
        for _ in range(2):
            with pytest.raises(NotAuthorized):  # clearance 2, the capability needs 3
                await analyst.call("customer_orders", {"user": 7})
        await flushed(analyst)
        assert vault.audit is not None
        await asyncio.wait_for(vault.audit.flush(), 10)
        diagnosis = await diagnose(fabric.conn, "customer_orders", probe_timeout=2)
    assert diagnosis.layer == "fabric", diagnosis
    assert "denied" in diagnosis.conclusion
    assert "2 call(s) denied by the callee (security)" in diagnosis.steps[1].findings


# -- an agent id that left the registry ------------------------------------------------


async def test_doctor_on_an_agent_that_left_finds_its_calls_in_the_audit_stream(
    nats_server: NatsServer, registrar: Registrar, client: ReachClient, conn: Connection
) -> None:
    agent, _ = make_agent(nats_server.url, "left-1", capability("left_cap"))
    async with agent:
        await wait_routable(client, "left_cap", 1)
        for n in range(3):
            await client.call("left_cap", {"n": n})
        await flushed(client)
    assert await registrar.store.get("left-1") is None  # said goodbye: the record is gone
    diagnosis = await diagnose(conn, "left-1", probe_timeout=1)
    assert diagnosis.layer == "registry", diagnosis
    assert "evicted" in diagnosis.conclusion
    assert "unknown name" not in diagnosis.conclusion
    assert "3 ok" in diagnosis.conclusion  # of its last calls
    registry, route = diagnosis.steps[:2]
    assert "calls went to left-1 earlier: evicted since" in registry.findings
    assert route.findings[0].startswith("3 call(s) in the last 10 min")
    # a name nobody ever had is still an unknown name
    unknown = await diagnose(conn, "never-1", probe_timeout=1)
    assert unknown.layer == "registry"
    assert "unknown name" in unknown.conclusion


async def test_doctor_counts_the_calls_an_agent_completed_and_when_the_last_was(
    nats_server: NatsServer, client: ReachClient
) -> None:
    """The record is written only when a figure callers route on moves; the probe's
    answer is current: after calls, the agent step counts them."""
    agent, _ = make_agent(nats_server.url, "counted-1", capability("counted_cap"))
    async with agent:
        await wait_routable(client, "counted_cap", 1)
        for _ in range(30):
            await client.call("counted_cap", {})
        result = await doctor(nats_server, "counted_cap")
    [finding] = result["steps"][3]["findings"]
    assert "30 completed" in finding, finding
    assert "-0s" not in finding
    assert "last completion just now" in finding or "s ago" in finding, finding
