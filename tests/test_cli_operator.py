"""Operator commands as real processes: audit tail (its filters and their checks),
alerts, call."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

from reach.audit.alerts import Alert, encode_alert
from reach.audit.events import CallEvent
from reach.registry import Registrar
from reach.testing import NatsServer
from reach.transport import Connection
from reach.wire import subjects
from tests.audit_helpers import event, write
from tests.cli_helpers import reach_cli, run_reach
from tests.conftest import manifest


def failed(n: int, kind: str, **fields: Any) -> CallEvent:
    return event(n, outcome="error", error=kind, code="x", description=f"{kind} happened", **fields)


async def test_audit_tail_prints_history_with_filters_and_json(
    nats_server: NatsServer, registrar: Registrar, conn: Connection
) -> None:
    old = event(0, ts=time.time() - 3600)
    await write(
        conn,
        old,
        event(1),
        failed(2, "timeout", callee="dq-2"),
        event(3, capability="report", caller="sched"),
        failed(
            4,
            "unavailable",
            attempts=[
                {"agent_id": "dq-1", "outcome": "unavailable"},
                {"agent_id": "dq-2", "outcome": "unavailable"},
            ],
        ),
    )
    url = ("--servers", nats_server.url)
    code, out, err = await run_reach("audit", "tail", *url)
    assert code == 0, err
    lines = out.strip().splitlines()
    assert len(lines) == 5
    assert "\x1b[" not in out  # piped: no colour
    (timed_out,) = [line for line in lines if "call c-2" in line]
    assert "timeout x: timeout happened" in timed_out

    async def ids(*args: str) -> list[str]:
        code, out, err = await run_reach("audit", "tail", "--json", *args, *url)
        assert code == 0, err
        return [json.loads(line)["call_id"] for line in out.strip().splitlines() if line]

    # in call order per capability (a stream message is a batch of one capability)
    assert sorted(await ids("--since", "10m")) == ["c-1", "c-2", "c-3", "c-4"]
    assert await ids("--capability", "report") == ["c-3"]
    assert await ids("--caller", "sched") == ["c-3"]
    assert await ids("--callee", "dq-2") == ["c-2", "c-4"]
    assert await ids("--kind", "timeout") == ["c-2"]
    assert await ids("--kind", "error") == ["c-2", "c-4"]
    assert await ids("--kind", "retry") == ["c-4"]
    code, out, _ = await run_reach("audit", "tail", "--kind", "breaker", *url)
    assert code == 0
    assert "no audit events matching the filter" in out
    code, _, err = await run_reach("audit", "tail", "--since", "yesterday-ish", *url)
    assert code == 2
    assert "--since 'yesterday-ish'" in err


async def test_audit_tail_follows_live_events(
    nats_server: NatsServer, registrar: Registrar, conn: Connection
) -> None:
    from tests.cli_helpers import REACH

    await write(conn, event(6))  # history
    proc = await asyncio.create_subprocess_exec(
        REACH,
        "audit",
        "tail",
        "-f",
        "--json",
        "--servers",
        nats_server.url,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        history = await asyncio.wait_for(proc.stdout.readline(), 20)
        assert json.loads(history)["call_id"] == "c-6"
        # the tail has read the history: what is written now reaches it live
        await write(conn, event(7), event(8))
        first = await asyncio.wait_for(proc.stdout.readline(), 20)
        second = await asyncio.wait_for(proc.stdout.readline(), 20)
        assert [json.loads(first)["call_id"], json.loads(second)["call_id"]] == ["c-7", "c-8"]
    finally:
        proc.terminate()
        await proc.wait()


async def test_alerts_command_lists_stored_alerts(
    nats_server: NatsServer, registrar: Registrar, conn: Connection
) -> None:
    stream = await conn.stream(subjects.ALERTS_STREAM)
    alert = Alert(
        rule="unhealthy", key="dq-1", ts=time.time(), severity="critical", summary="dq-1 down"
    )
    await stream.publish(subjects.alert("unhealthy"), encode_alert(alert), msg_id="a1", timeout=2)
    code, out, err = await run_reach("alerts", "--servers", nats_server.url)
    assert code == 0, err
    assert "CRITICAL unhealthy  dq-1 down" in out
    code, out, err = await run_reach("alerts", "--json", "--servers", nats_server.url)
    assert json.loads(out)["key"] == "dq-1"
    code, out, err = await run_reach(
        "alerts", "--rule", "retry_storm", "--servers", nats_server.url
    )
    assert "no alerts" in out


async def test_call_prints_the_result_or_the_typed_error_and_its_layer(
    nats_server: NatsServer, registrar: Registrar, spawn_agent: Callable[..., Any]
) -> None:
    await spawn_agent(manifest("echo-cli", "echo_cli"))
    url = ("--servers", nats_server.url)
    code, out, err = await run_reach("call", "echo_cli", '{"x": 1}', *url)
    assert code == 0, err
    assert json.loads(out)["echo"] == {"x": 1}
    assert "served by echo-cli" in err
    code, out, err = await run_reach("call", "no_such_cap", "{}", *url)
    assert code == 1
    assert "NotFound (layer: discovery)" in err
    code, out, err = await run_reach("call", "echo_cli", "{not json", *url)
    assert code == 2
    assert "JSON payload" in err


async def test_top_once_shows_instances_and_capabilities(
    nats_server: NatsServer, registrar: Registrar, spawn_agent: Callable[..., Any]
) -> None:
    await spawn_agent(manifest("top-1", "top_cap"))
    url = ("--servers", nats_server.url)
    for n in range(3):
        code, _, err = await run_reach("call", "top_cap", json.dumps({"n": n}), *url)
        assert code == 0, err
    code, out, err = await run_reach("top", "--once", *url)
    assert code == 0, err
    assert "1 instance(s)" in out
    (inst_line,) = [line for line in out.splitlines() if line.lstrip().startswith("top-1")]
    assert "healthy" in inst_line
    assert "100.0%" in inst_line
    assert "closed" in inst_line
    (cap_line,) = [line for line in out.splitlines() if line.lstrip().startswith("top_cap")]
    assert " 3 " in cap_line


async def test_audit_tail_lists_calls_that_skipped_an_agent(
    nats_server: NatsServer, registrar: Registrar, conn: Connection
) -> None:
    served = [{"agent_id": "u-2", "outcome": "ok", "latency_ms": 1.0}]
    await write(
        conn,
        event(1, capability="unav", callee="u-2", attempts=served),
        event(2, capability="unav", callee="u-2", skipped=("u-1",), attempts=served),
        event(3, capability="unav", callee="u-2", skipped=("u-1",), attempts=served),
    )
    url = ("--servers", nats_server.url)

    async def ids(*args: str) -> list[str]:
        code, out, err = await run_reach("audit", "tail", "--json", *args, *url)
        assert code == 0, err
        return [json.loads(line)["call_id"] for line in out.strip().splitlines() if line]

    assert await ids("--callee", "u-1") == ["c-2", "c-3"]
    assert await ids("--callee", "u-1", "--kind", "breaker") == ["c-2", "c-3"]
    assert await ids("--kind", "breaker") == ["c-2", "c-3"]
    assert await ids("--callee", "u-2") == ["c-1", "c-2", "c-3"]


async def test_audit_tail_refuses_an_unknown_kind_naming_the_allowed_ones(
    nats_server: NatsServer, registrar: Registrar
) -> None:
    code, out, err = await reach_cli(
        "audit", "tail", "--kind", "bogus", "--servers", nats_server.url
    )
    assert code == 2, out + err
    assert "bogus" in err
    for allowed in ("ok", "error", "fallback", "denied", "retry", "timeout", "breaker"):
        assert f"'{allowed}'" in err
    code, out, err = await reach_cli(
        "audit", "tail", "--kind", "timeout", "--servers", nats_server.url
    )
    assert code == 0, err
    assert "no audit events" in out
