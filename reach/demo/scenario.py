"""The seed scenario: scheduler → industry report → data query (two processes).

It runs on the secured fabric users get (``reach.fabric.Fabric``, as ``reach up``
starts it): no client gets in without credentials, every participant has its own (an
agent's bound to its agent_id and capability), and every call carries a token its
callee checks. During the run one data-query instance's connection pool saturates
(alive, answering probes, but not ready) and traffic moves to the other; then a
data-query instance is killed and a replacement starts. The summary shows that no call
failed, and why.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from reach.agent.agent import Agent
from reach.audit.alerts import Alert, decode_alert
from reach.audit.eventmodels import AuditEvent
from reach.audit.reader import format_event, read_events
from reach.caller.client import ReachClient
from reach.demo.participants import (
    DATA_QUERIES,
    LEVEL,
    REPORT_ID,
    DataQueryProcess,
    demo_fabric,
)
from reach.errors import AuthenticationFailed, NotAuthorized, ReachError
from reach.fabric import Fabric
from reach.security.membership import connect_as
from reach.tasks import cancel_and_wait
from reach.transport import Connection
from reach.wire import subjects
from reach.wire.models import Instance

__all__ = ["REPORT_MANIFEST", "run_demo"]

REPORT_MANIFEST: dict[str, Any] = {
    "agent_id": REPORT_ID,
    "agent_name": "industry_report",
    "version": "2.3.1",
    "capabilities": [
        {
            "name": "generate_industry_report",
            "description": "Structured report for an industry and time range",
            "input_schema": {
                "type": "object",
                "properties": {
                    "industry": {"type": "string"},
                    "time_range": {"type": "string"},
                    "include_charts": {"type": "boolean"},
                },
                "required": ["industry", "time_range"],
            },
            "output_schema": {
                "type": "object",
                "properties": {
                    "report_id": {"type": "string"},
                    "status": {"type": "string"},
                    "data_from": {"type": "string"},
                },
                "required": ["report_id", "status"],
            },
            "tags": ["report-generate", "industry", "analytics"],
            "qps": 100,
            "latency_sla_ms": 1500,
            "security_level": 2,
        }
    ],
    "health": {"interval_sec": 0.5, "timeout_sec": 0.25, "failures_before_unhealthy": 2},
}


@dataclass
class Tally:
    made: int = 0
    ok: int = 0
    failed: int = 0
    retries: int = 0
    fallbacks: int = 0
    latencies: list[float] = field(default_factory=list)
    served_by: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)

    def percentile(self, q: float) -> float:
        if not self.latencies:
            return 0.0
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def say(message: str, *, style: str | None = None) -> None:
    click.secho(f"[{time.strftime('%H:%M:%S')}] {message}", fg=style)


async def run_demo(duration: float = 24.0, rate: float = 40.0, *, keep: bool = False) -> int:
    """Run the scenario; returns the number of failed calls (0 is the goal). ``keep``:
    the fabric stays up after the summary, for the operator's commands, until Enter."""
    # the demo prints the alerts and denials itself, not as log lines
    logging.getLogger("reach.alerts").setLevel(logging.ERROR)
    logging.getLogger("reach.agent.serving").setLevel(logging.ERROR)
    workdir = Path(tempfile.mkdtemp(prefix="reach-demo-"))
    data_queries: list[DataQueryProcess] = []
    try:
        say("starting a secured fabric: nats-server, login gate, registrar")
        async with demo_fabric(workdir) as fabric:
            try:
                return await _run(fabric, data_queries, workdir, duration, rate, keep)
            finally:
                # the agents leave before their fabric does (they would log its going),
                # waited for off the loop, which the registrar shares
                await asyncio.gather(*(asyncio.to_thread(dq.stop) for dq in data_queries))
    finally:
        for dq in data_queries:
            dq.stop()
        shutil.rmtree(workdir, ignore_errors=True)


async def _run(
    fabric: Fabric,
    data_queries: list[DataQueryProcess],
    workdir: Path,
    duration: float,
    rate: float,
    keep: bool,
) -> int:
    say(
        f"secured fabric at {fabric.url}: logins through the login gate, calls carry"
        f" tokens their callee checks; registrar {fabric.registrar_id}"
    )
    say("starting data-query-1 and data-query-2, each in a process of its own")
    for agent_id in DATA_QUERIES[:2]:
        data_queries.append(DataQueryProcess(fabric.url, agent_id, workdir, fabric.creds(agent_id)))
    await asyncio.gather(*(dq.ready() for dq in data_queries))
    say("data-query-1 and data-query-2 running as separate processes")
    tally, transitions, alerts, audit = await _scenario(
        fabric, data_queries, workdir, duration, rate
    )
    _summary(tally, transitions, alerts, audit)
    if keep:
        await _keep_up(fabric)
    else:
        click.echo(
            "  (on a terminal, `reach demo` keeps its fabric up after the run for"
            " `reach audit tail`, `reach agents` and `reach top`)"
        )
    return tally.failed


async def _keep_up(fabric: Fabric) -> None:
    """The fabric and its agents stay up until Enter (or end of input): the commands to
    look into it, with the options that reach it."""
    options = f"--servers {fabric.url} --creds {fabric.creds('admin')}"
    click.echo()
    click.secho("The fabric stays up until you press Enter. In another terminal:", bold=True)
    for command in ("audit tail", "agents", "top", "doctor query_industry_data"):
        click.echo(f"  reach {command} {options}")
    await _line_typed()


async def _line_typed() -> None:
    """Until a line (or end of input) comes on stdin. Watched by the loop, not read in a
    thread: a thread blocked in a read would hold up the exit that Ctrl-C asks for."""
    loop = asyncio.get_running_loop()
    typed: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        if not typed.done():
            typed.set_result(None)

    try:
        loop.add_reader(sys.stdin.fileno(), readable)
    except (OSError, ValueError, NotImplementedError):  # stdin a regular file, or none
        return
    try:
        await typed
    finally:
        loop.remove_reader(sys.stdin.fileno())
    sys.stdin.readline()


async def _scenario(
    fabric: Fabric,
    data_queries: list[DataQueryProcess],
    workdir: Path,
    duration: float,
    rate: float,
) -> tuple[Tally, list[str], list[Alert], list[AuditEvent]]:
    """The report agent, the scheduler's calls and the faults; what the summary shows."""
    report = Agent(REPORT_MANIFEST, servers=fabric.url, credentials=fabric.creds(REPORT_ID))
    report_client = ReachClient(
        servers=fabric.url, name=REPORT_ID, credentials=fabric.creds(REPORT_ID)
    )

    @report.capability("generate_industry_report")
    async def generate(req: dict[str, Any]) -> dict[str, Any]:
        data = await report_client.call(
            "query_industry_data",
            {"industry": req["industry"], "time_range": req["time_range"]},
        )
        return {
            "report_id": f"{req['industry']}-{req['time_range']}",
            "status": "done",
            "data_from": data.value["served_by"],
        }

    operator, _ = await connect_as(
        fabric.urls, name="demo-operator", credentials=fabric.creds("admin")
    )
    try:
        async with (
            report_client,
            report,
            ReachClient(
                servers=fabric.url, name="scheduler", credentials=fabric.creds("scheduler")
            ) as scheduler,
        ):
            await _routable(scheduler, report_client)
            await _show_refusals(fabric)
            say("industry-report-1 running; the scheduler starts calling it")
            log = TransitionLog(report_client)
            alerts: list[Alert] = []
            watching = asyncio.create_task(_follow_alerts(operator, alerts))
            try:
                tally = await _drive(scheduler, data_queries, fabric, workdir, duration, rate)
            finally:
                await cancel_and_wait([watching])
            transitions = log.ordered()
            audit = await _audit_trail(operator, scheduler, report_client)
    finally:
        await operator.close()
    return tally, transitions, alerts, audit


async def _routable(scheduler: ReachClient, report_client: ReachClient) -> None:
    """Until both callers see the report agent and both data-query instances."""
    await scheduler.routes.wait_for(
        lambda c: (
            bool(c.find("generate_industry_report")) and len(c.find("query_industry_data")) == 2
        ),
        timeout=10,
    )
    await report_client.routes.wait_for(
        lambda c: len(c.find("query_industry_data")) == 2, timeout=10
    )


async def _show_refusals(fabric: Fabric) -> None:
    """What the fabric refuses: a client without credentials, and a call whose token
    holds less clearance than the capability requires (its callee checks the token)."""
    try:
        conn, _ = await connect_as(fabric.urls, name="demo-anonymous", credentials=None)
    except AuthenticationFailed as exc:
        say(f"a client without credentials is refused: {exc}", style="yellow")
    else:  # pragma: no cover - the fabric has logins on
        await conn.close()
        raise ReachError("the demo's fabric let a client in without credentials")
    async with ReachClient(
        servers=fabric.url, name="intern", credentials=fabric.creds("intern")
    ) as intern:
        await intern.routes.wait_for(lambda c: bool(c.find("query_industry_data")), timeout=10)
        try:
            await intern.call("query_industry_data", {"industry": "ev", "time_range": "2025Q3"})
        except NotAuthorized as exc:
            say(
                f"a call with a level-{LEVEL - 1} token is refused by its callee: {exc}",
                style="yellow",
            )
        else:  # pragma: no cover - the callee checks every token
            raise ReachError("the demo's data-query agent served a caller below its clearance")


async def _drive(
    scheduler: ReachClient,
    data_queries: list[DataQueryProcess],
    fabric: Fabric,
    workdir: Path,
    duration: float,
    rate: float,
) -> Tally:
    tally = Tally()
    events = [
        (0.2 * duration, "saturate"),
        (0.45 * duration, "recover"),
        (0.6 * duration, "kill"),
        (0.65 * duration, "replace"),
    ]

    async def one(i: int) -> None:
        started = time.perf_counter()
        try:
            result = await scheduler.call(
                "generate_industry_report",
                {"industry": ["ev", "solar", "chips"][i % 3], "time_range": "2025Q3"},
            )
        except ReachError as exc:
            tally.failed += 1
            tally.errors[f"{type(exc).__name__}: {exc}"[:120]] += 1
            return
        tally.ok += 1
        tally.latencies.append((time.perf_counter() - started) * 1000)
        tally.retries += result.attempts - 1
        tally.fallbacks += result.from_fallback
        tally.served_by[result.value.get("data_from", "?")] += 1

    tasks: list[asyncio.Task[None]] = []
    start = time.monotonic()
    last_progress = start
    i = 0
    while (elapsed := time.monotonic() - start) < duration:
        while events and elapsed >= events[0][0]:
            _, what = events.pop(0)
            # in the background: the scheduler's calls go on while a replacement starts
            tasks.append(asyncio.create_task(_event(what, data_queries, fabric, workdir)))
        tasks.append(asyncio.create_task(one(i)))
        tally.made += 1
        i += 1
        if time.monotonic() - last_progress >= 2:
            last_progress = time.monotonic()
            say(
                f"{tally.made} calls, {tally.ok} ok, {tally.failed} failed;"
                f" served by {dict(sorted(tally.served_by.items()))}"
            )
        await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
    await asyncio.gather(*tasks)
    return tally


async def _event(
    what: str,
    data_queries: list[DataQueryProcess],
    fabric: Fabric,
    workdir: Path,
) -> None:
    if what == "saturate":
        data_queries[0].saturate(True)
        say(
            "data-query-1: connection pool saturates (alive, answers pings, not ready)",
            style="yellow",
        )
    elif what == "recover":
        data_queries[0].saturate(False)
        say("data-query-1: pool recovered", style="green")
    elif what == "kill":
        data_queries[1].kill()
        say("data-query-2: SIGKILL", style="red")
    elif what == "replace":
        agent_id = DATA_QUERIES[2]
        replacement = DataQueryProcess(fabric.url, agent_id, workdir, fabric.creds(agent_id))
        data_queries.append(replacement)
        await replacement.ready()
        say("data-query-3: replacement started", style="green")


class TransitionLog:
    """Health transitions and evictions as the route cache sees them, in order."""

    def __init__(self, client: ReachClient) -> None:
        self._seen: set[tuple[str, float]] = set()
        self.lines: list[tuple[float, str]] = []
        client.routes.on_change(self._on_change)
        for inst in client.routes.all():
            self._on_change(inst.agent_id, inst)

    def _on_change(self, agent_id: str, inst: Instance | None) -> None:
        if inst is None:
            self.lines.append((time.time(), f"{agent_id}: removed from the registry"))
            return
        for t in inst.transitions:
            if (agent_id, t.at) not in self._seen:
                self._seen.add((agent_id, t.at))
                self.lines.append((t.at, f"{agent_id}: {t.status} ({t.reason})"))

    def ordered(self) -> list[str]:
        return [
            f"{time.strftime('%H:%M:%S', time.localtime(at))} {text}"
            for at, text in sorted(self.lines)
        ]


async def _follow_alerts(conn: Connection, seen: list[Alert]) -> None:
    """Print alerts as the registrar's rules raise them (stream REACH_ALERTS)."""
    stream = await conn.stream(subjects.ALERTS_STREAM)
    async for msg in stream.read(subjects.alert("*"), new_only=True, follow=True):
        alert = decode_alert(msg.data)
        if alert is not None:
            seen.append(alert)
            say(f"alert {alert.rule}: {alert.summary}", style="yellow")


async def _audit_trail(operator: Connection, *clients: ReachClient) -> list[AuditEvent]:
    """Every audit event of the run, once the clients' writers have written them (read
    with the admin's credentials: callers may write audit events, not read them)."""
    for client in clients:
        if client.audit is not None:
            await asyncio.wait_for(client.audit.flush(), 10)
    return [event async for event in read_events(operator)]


def _summary(
    tally: Tally, transitions: list[str], alerts: list[Alert], audit: list[AuditEvent]
) -> None:
    click.echo()
    click.secho("Summary", bold=True)
    click.echo(f"  calls made        {tally.made}")
    click.echo(f"  succeeded         {tally.ok}")
    click.secho(f"  failed            {tally.failed}", fg="green" if tally.failed == 0 else "red")
    if tally.latencies:
        click.echo(
            f"  latency           p50 {statistics.median(tally.latencies):.1f} ms,"
            f" p99 {tally.percentile(0.99):.1f} ms (whole calls, as the scheduler timed them)"
        )
    click.echo(f"  retries           {tally.retries}")
    click.echo(f"  fallbacks         {tally.fallbacks}")
    click.echo(
        "  served by         " + ", ".join(f"{k}: {v}" for k, v in sorted(tally.served_by.items()))
    )
    for error, count in tally.errors.most_common(5):
        click.echo(f"  error ×{count}: {error}")
    click.echo("  health transitions seen by the registrar:")
    for line in transitions:
        click.echo(f"    {line}")
    click.echo(f"  alerts            {len(alerts)}")
    for alert in alerts:
        click.echo(f"    {alert.rule}: {alert.summary}")
    calls = [e for e in audit if e.side == "caller"]
    by_capability = Counter(e.capability for e in calls)
    click.echo(
        f"  audit events      {len(audit)} in REACH_AUDIT ("
        + ", ".join(f"{cap}: {n}" for cap, n in sorted(by_capability.items()))
        + ")"
    )
    click.echo("  last audit events:")
    for event in audit[-5:]:
        click.echo(f"    {format_event(event)}")
