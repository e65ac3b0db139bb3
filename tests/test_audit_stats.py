"""Call statistics read from audit events (reach.audit.stats, behind `reach agents`,
`reach top` and `reach doctor`): each attempt counts against the instance it went to,
and the observed p99 reads only the last minute's calls."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from reach.agent.context import current_call
from reach.audit import read_events
from reach.audit.eventmodels import AuditAttempt, AuditEvent
from reach.audit.events import CallEvent
from reach.audit.reader import AuditFilter
from reach.audit.stats import CallStats
from reach.caller.client import ReachClient
from reach.cli.agents import P99_WINDOW_SEC, observed_p99
from reach.registry import Registrar
from reach.testing import NatsServer
from reach.transport import Connection

from .audit_helpers import event, flushed, write
from .calls_helpers import capability, make_agent, wait_routable

# -- each attempt counts against the instance it went to -------------------------------


def retried_after_timeout(ts: float) -> AuditEvent:
    """Timed out on i-2 after 3 s, retried on i-1, which answered in 10 ms."""
    return AuditEvent(
        ts=ts,
        capability="idem",
        callee="i-1",
        outcome="ok",
        latency_ms=3010.0,
        candidates=["i-1", "i-2"],
        n_candidates=2,
        attempts=[
            AuditAttempt(agent_id="i-2", score=0.9, outcome="timeout", latency_ms=3000.0),
            AuditAttempt(agent_id="i-1", score=0.8, outcome="ok", latency_ms=10.0),
        ],
    )


def test_a_retried_call_counts_each_attempt_against_its_own_instance() -> None:
    stats = CallStats(window_sec=600)
    stats.add(retried_after_timeout(time.time()))
    tallies = stats.by_instance()
    assert set(tallies) == {"i-1", "i-2"}
    hung, served = tallies["i-2"], tallies["i-1"]
    assert (hung.calls, hung.ok, hung.errors) == (1, 0, {"timeout": 1})
    assert hung.latencies == []  # a failure is no latency sample
    assert hung.last_error == "timeout"
    assert (served.calls, served.ok, served.errors) == (1, 1, {})
    assert served.p(0.99) == 10.0  # its own answer, not the call's 3 s


async def timeout_on_first_attempt(req: Any) -> Any:
    call = current_call()
    assert call is not None
    if call.attempt == 1:
        await asyncio.sleep(2.0)  # longer than the attempt's 300 ms
    return {"attempt": call.attempt}


async def test_real_retried_calls_blame_the_instance_that_timed_out(
    nats_server: NatsServer, client: ReachClient, conn: Connection
) -> None:
    cap = capability("idem", idempotent=True, sla_ms=200)  # 300 ms per attempt
    one, _ = make_agent(nats_server.url, "att-1", cap, handler=timeout_on_first_attempt)
    two, _ = make_agent(nats_server.url, "att-2", cap, handler=timeout_on_first_attempt)
    async with one, two:
        await wait_routable(client, "idem", 2)
        result = await client.call("idem", {}, timeout=3)
        assert result.attempts == 2
        await flushed(client)
        events = [e async for e in read_events(conn, AuditFilter(capability="idem"))]
    (call,) = events
    failed, served = call.attempts
    assert (failed.outcome, served.outcome) == ("timeout", "ok")
    assert served.agent_id == call.callee != failed.agent_id
    stats = CallStats(window_sec=600)
    stats.add(call)
    tallies = stats.by_instance()
    assert tallies[failed.agent_id].errors == {"timeout": 1}
    assert tallies[failed.agent_id].ok == 0
    assert tallies[served.agent_id].ok == 1
    # the instance that answered is credited with its own latency, not the 300 ms wait
    (latency,) = tallies[served.agent_id].latencies
    assert latency == served.latency_ms < 250 < call.latency_ms


# -- reach agents: observed p99 of the last minute -------------------------------------


def timed(n: int, ts: float, latency: float) -> CallEvent:
    attempts = [{"agent_id": "e-1", "outcome": "ok", "latency_ms": latency}]
    return event(n, ts=ts, latency_ms=latency, callee="e-1", attempts=attempts)


async def test_observed_p99_reads_only_the_last_minute(
    nats_server: NatsServer, registrar: Registrar, conn: Connection
) -> None:
    now = time.time()
    # two minutes ago, calls were slow; in the last ten seconds they are fast (the
    # stream's own times are all recent: the window applies to the calls' times)
    old = [timed(n, now - 120 + n * 0.01, 500.0) for n in range(50)]
    recent = [timed(100 + n, now - 10 + n * 0.01, 1.0) for n in range(50)]
    await write(conn, *old, *recent)
    assert await observed_p99(conn, time.time()) == {"e-1": 1.0}
    assert P99_WINDOW_SEC == 60


# -- one latency across the operator commands --------------------------------------------


def first_call_with_a_token_fetch(ts: float) -> AuditEvent:
    """Answered in 1.5 ms by its instance; 6.2 ms for the caller, its token fetched first."""
    return AuditEvent(
        ts=ts,
        capability="echo",
        callee="echo-1",
        outcome="ok",
        latency_ms=6.2,
        attempts=[AuditAttempt(agent_id="echo-1", score=0.9, outcome="ok", latency_ms=1.5)],
    )


def test_every_command_shows_the_same_latency_for_the_same_call() -> None:
    from reach.audit.reader import format_event
    from reach.audit.stats import LATENCY
    from reach.cli.doctor import render as render_doctor
    from reach.cli.top import render as render_top
    from reach.fabric.doctor import Diagnosis

    call = first_call_with_a_token_fetch(time.time())
    assert call.answer_ms == 1.5
    stats = CallStats(window_sec=600)
    stats.add(call)
    # per instance (reach agents, reach top, reach doctor) and per capability (reach top)
    assert stats.by_instance()["echo-1"].p(0.99) == 1.5
    assert stats.by_capability()["echo"].p(0.99) == 1.5
    # reach audit tail: the same figure first, the whole call's beside it
    assert "  1.5ms (call 6.2ms)  " in format_event(call)
    # each says what it measures
    assert "round trip of the attempt that answered" in LATENCY
    assert len(LATENCY) <= 80  # every command says it: a line, not a paragraph
    diagnosis = Diagnosis(target="echo", steps=[], layer="none", conclusion="fine")
    assert LATENCY in render_doctor(diagnosis, colour=False)
    from rich.console import Console

    console = Console(width=400, record=True)
    console.print(render_top([], stats, time.time()))
    assert LATENCY in console.export_text()


def test_a_callees_own_event_says_its_latency_is_handling_time() -> None:
    from reach.audit.reader import format_event

    own = AuditEvent(ts=time.time(), side="callee", capability="echo", outcome="ok", latency_ms=0.8)
    assert "  0.8ms handling  " in format_event(own)
