"""The operator's view tells the truth: per-instance statistics, audit filters, doctor's
conclusions, the observed p99 window, health that does not flap, and the breaker alert.

Each test pins one fix: on the code before it, it fails."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest

from reach import subjects
from reach.audit import AuditWriter, WriterConfig, read_events
from reach.audit.alerts import AlertEngine, decode_alert
from reach.audit.batch import RowSummary, encode_batch, read_counts
from reach.audit.events import CallEvent
from reach.audit.reader import AuditFilter
from reach.audit.records import AuditAttempt, AuditEvent
from reach.audit.stats import CallStats
from reach.cli.agents import P99_WINDOW_SEC, observed_p99
from reach.client import ReachClient
from reach.clock import ManualClock
from reach.context import current_call
from reach.doctor import Evidence, conclude, diagnose
from reach.errors import NoResponders, NotAuthorized, ReachTimeout
from reach.models import Instance, ProbeReply, Readiness
from reach.registry import Registrar
from reach.registry.probe import ProbeResult
from reach.testing import NatsServer
from reach.transport import Connection
from tests.audit_helpers import event, make_event
from tests.calls_helpers import Behaviour, capability, make_agent, wait_routable
from tests.cli_helpers import run_reach
from tests.conftest import Fabric, vault_agent
from tests.test_routing import instance


async def write(conn: Connection, *rows: CallEvent) -> None:
    """Rows into REACH_AUDIT through a real writer (flushed before it returns)."""
    writer = AuditWriter(conn, WriterConfig(flush_interval=0.01))
    await writer.start()
    for row in rows:
        writer.record(row)
    await writer.stop()


async def flushed(client: ReachClient) -> None:
    assert client.audit is not None
    await asyncio.wait_for(client.audit.flush(), 10)


# -- 1. each attempt counts against the instance it went to ---------------------------


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


# -- 2. the audit filter sees calls that passed an open breaker over -------------------


def skipped_call(ts: float, *, skipped: str = "u-1", served: str = "u-2") -> AuditEvent:
    """Served by ``served`` after passing ``skipped`` over: its breaker was open."""
    return AuditEvent(
        ts=ts,
        capability="unav",
        callee=served,
        outcome="ok",
        candidates=[skipped, served],
        n_candidates=2,
        skipped=[skipped],
        attempts=[AuditAttempt(agent_id=served, outcome="ok", latency_ms=1.0)],
    )


def test_the_callee_filter_and_the_breaker_kind_match_a_skipped_instance() -> None:
    call = skipped_call(time.time())
    assert AuditFilter(callee="u-1").matches(call)
    assert AuditFilter(kind="breaker").matches(call)
    assert AuditFilter(callee="u-1", kind="breaker").matches(call)
    assert AuditFilter(callee="u-2").matches(call)  # served it
    assert not AuditFilter(callee="u-3").matches(call)
    assert not AuditFilter(kind="timeout").matches(call)
    assert not AuditFilter(kind="retry").matches(call)
    # a call that skipped nothing is no breaker event
    plain = call.model_copy(update={"skipped": []})
    assert not AuditFilter(kind="breaker").matches(plain)
    assert not AuditFilter(callee="u-1").matches(plain)


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


# -- 3, 4. doctor: the calls' own failures, weighed after the other steps --------------


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


# -- 5. doctor on an agent id that left the registry -----------------------------------


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


# -- 6. reach agents: observed p99 of the last minute ----------------------------------


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


# -- 7. a heartbeat does not clear failing probes --------------------------------------


async def test_an_instance_whose_probes_fail_stays_unhealthy_while_it_heartbeats(
    nats_server: NatsServer, registrar: Registrar
) -> None:
    async def slow_readiness() -> Readiness:
        await asyncio.sleep(0.35)  # longer than the probe timeout: every probe times out
        return Readiness()

    # heartbeats come every ~1.1 s (0.8 s + the check), never 2 intervals apart: never
    # "missed"; new agents are probed every 0.4 s, so two probes fail between heartbeats
    health = {"interval_sec": 0.8, "timeout_sec": 0.2, "failures_before_unhealthy": 2}
    agent, _ = make_agent(
        nats_server.url, "flap-1", capability("flap_cap"), readiness=slow_readiness, health=health
    )

    async def status() -> Instance:
        record = await registrar.store.get("flap-1")
        assert record is not None, "evicted: heartbeats did not arrive"
        return record[0]

    async with agent:
        async with asyncio.timeout(5):
            while (await status()).status != "unhealthy":  # noqa: ASYNC110 - polled
                await asyncio.sleep(0.05)
        marked = len((await status()).transitions)
        # three heartbeat intervals: each heartbeat arrives, none makes it healthy again
        seen: set[str] = set()
        heartbeats: set[float] = set()
        deadline = time.monotonic() + 2.5
        while time.monotonic() < deadline:
            inst = await status()
            seen.add(inst.status)
            heartbeats.add(inst.last_heartbeat_at)
            await asyncio.sleep(0.05)
    assert seen == {"unhealthy"}
    assert len(heartbeats) >= 2  # heartbeats did arrive meanwhile
    assert inst.consecutive_failures >= 2
    assert "probe failures" in inst.status_reason
    later = inst.transitions[marked:]
    assert [t.status for t in later] == [], later


# -- 8. the breaker alert counts calls that passed an open breaker over ----------------


def skipped_row(n: int, capability: str = "query") -> CallEvent:
    return make_event(
        ts=0.0,
        capability=capability,
        call_id=f"c-{n}",
        caller="sched",
        callee="dq-2",
        outcome="ok",
        skipped=("dq-1",),
        attempts=[{"agent_id": "dq-2", "outcome": "ok", "latency_ms": 1.0}],
    )


def plain_row(n: int, capability: str = "query") -> CallEvent:
    return make_event(
        ts=0.0,
        capability=capability,
        call_id=f"p-{n}",
        caller="sched",
        callee="dq-2",
        outcome="ok",
        candidates=("dq-2",),
        n_candidates=1,
        attempts=[{"agent_id": "dq-2", "outcome": "ok", "latency_ms": 1.0}],
    )


def test_a_call_served_after_skipping_an_open_breaker_counts_as_a_rejection() -> None:
    engine = AlertEngine(clock=ManualClock())
    ok: dict[str, Any] = {"capability": "query", "caller": "c", "outcome": "ok", "attempts": [{}]}
    skipped = {**ok, "skipped": ["dq-1"], "attempts": [{"agent_id": "dq-2", "outcome": "ok"}]}
    for _ in range(18):
        assert engine.observe(ok) == []
    assert engine.observe(skipped) == []  # 1 of 19: under 20 calls
    assert engine.observe(skipped) == []  # 2 of 20 = 10 %: not above
    (alert,) = engine.observe(skipped)  # 3 of 21, though every call succeeded
    assert alert.rule == "breaker_rejections"
    assert alert.details == {"capability": "query", "rejected": 3, "calls": 21}


def test_a_batch_with_skipped_rows_is_notable_and_raises_the_alert() -> None:
    summary = RowSummary()
    summary.add(plain_row(0))
    assert summary.notable == 0
    summary.add(skipped_row(1))
    assert summary.notable == 1
    assert summary.calls == {"query": 2}
    plain = encode_batch([plain_row(n) for n in range(30)])
    assert read_counts(plain) == {"query": 30}
    mixed = encode_batch([plain_row(n) for n in range(30)] + [skipped_row(n) for n in range(3)])
    assert read_counts(mixed) is None  # its rows must be read
    engine = AlertEngine(clock=ManualClock())
    assert engine.observe_batch(mixed) == []  # 3 of 33: below 10 %
    (alert,) = engine.observe_batch(encode_batch([skipped_row(3)]))  # 4 of 34
    assert alert.rule == "breaker_rejections"
    assert alert.details == {"capability": "query", "rejected": 4, "calls": 34}


async def test_the_registrar_alerts_on_calls_that_skip_an_open_breaker(
    nats_server: NatsServer, registrar: Registrar, conn: Connection
) -> None:
    now = time.time()
    served = [{"agent_id": "u-2", "outcome": "ok", "latency_ms": 1.0}]
    rows = [event(n, capability="unav", ts=now, callee="u-2", attempts=served) for n in range(20)]
    rows += [
        event(100 + n, capability="unav", ts=now, callee="u-2", skipped=("u-1",), attempts=served)
        for n in range(5)
    ]
    await write(conn, *rows)
    stream = await conn.stream(subjects.ALERTS_STREAM)
    found: list[Any] = []
    for _ in range(100):  # the registrar's watcher reads the notable batch in the background
        messages = [m async for m in stream.read(subjects.alert("breaker_rejections"))]
        found = [a for a in (decode_alert(m.data) for m in messages) if a is not None]
        if found:
            break
        await asyncio.sleep(0.05)
    (alert,) = found
    assert alert.key == "unav"
    assert alert.details["rejected"] >= 3
