"""The seed scenario: scheduler → industry report → data query (two processes).

During the run one data-query instance's connection pool saturates (alive, answering
probes, but not ready) and traffic moves to the other; then a data-query instance is
killed and a replacement starts. The summary shows that no call failed, and why.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from reach import subjects
from reach.agent import Agent
from reach.audit.alerts import Alert, decode_alert
from reach.audit.reader import format_event, read_events
from reach.audit.records import AuditEvent
from reach.client import ReachClient
from reach.embedded import EmbeddedServer, die_with_parent
from reach.errors import ReachError
from reach.models import Instance
from reach.registry import Registrar, RegistrarConfig
from reach.tasks import cancel_and_wait
from reach.transport import Connection, connect

__all__ = ["run_demo"]

REPORT_MANIFEST: dict[str, Any] = {
    "agent_id": "industry-report-1",
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


class DataQueryProcess:
    def __init__(self, url: str, agent_id: str, workdir: Path) -> None:
        self.agent_id = agent_id
        self.saturation_file = workdir / f"{agent_id}.saturated"
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "reach.demo.data_query",
                url,
                agent_id,
                str(self.saturation_file),
            ],
            stdout=subprocess.PIPE,
            text=True,
            preexec_fn=die_with_parent(os.getpid()),
        )

    async def ready(self) -> None:
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(self.proc.stdout.readline), 20)
        if not line.startswith("READY"):
            raise RuntimeError(f"{self.agent_id} did not start: {line!r}")

    def saturate(self, on: bool) -> None:
        if on:
            self.saturation_file.touch()
        else:
            self.saturation_file.unlink(missing_ok=True)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.kill()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def say(message: str, *, style: str | None = None) -> None:
    click.secho(f"[{time.strftime('%H:%M:%S')}] {message}", fg=style)


@contextlib.asynccontextmanager
async def fabric(workdir: Path) -> AsyncIterator[tuple[str, Registrar]]:
    server = EmbeddedServer(store_dir=workdir / "nats")
    await server.start()
    conn = await connect([server.url], name="demo-registrar")
    registrar = Registrar(conn, RegistrarConfig(liveness_interval_sec=0.5))
    await registrar.start()
    try:
        yield server.url, registrar
    finally:
        await registrar.stop()
        await conn.close()
        await server.stop()


async def run_demo(duration: float = 24.0, rate: float = 40.0) -> int:
    """Run the scenario; returns the number of failed calls (0 is the goal)."""
    # the demo prints the alerts itself (from REACH_ALERTS), not as log lines
    logging.getLogger("reach.alerts").setLevel(logging.ERROR)
    workdir = Path(tempfile.mkdtemp(prefix="reach-demo-"))
    data_queries: list[DataQueryProcess] = []
    try:
        async with fabric(workdir) as (url, registrar):
            say(f"embedded NATS with JetStream at {url}; registrar {registrar.registrar_id}")
            for agent_id in ("data-query-1", "data-query-2"):
                data_queries.append(DataQueryProcess(url, agent_id, workdir))
            await asyncio.gather(*(dq.ready() for dq in data_queries))
            say("data-query-1 and data-query-2 running as separate processes")
            report = Agent(REPORT_MANIFEST, servers=url)
            report_client = ReachClient(servers=url, name="industry-report-1")

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

            async with (
                report_client,
                report,
                ReachClient(servers=url, name="scheduler") as scheduler,
            ):
                await scheduler.routes.wait_for(
                    lambda c: (
                        bool(c.find("generate_industry_report"))
                        and len(c.find("query_industry_data")) == 2
                    ),
                    timeout=10,
                )
                await report_client.routes.wait_for(
                    lambda c: len(c.find("query_industry_data")) == 2, timeout=10
                )
                say("industry-report-1 running; the scheduler starts calling it")
                log = TransitionLog(report_client)
                alerts: list[Alert] = []
                watching = asyncio.create_task(_follow_alerts(scheduler.connection, alerts))
                try:
                    tally = await _drive(
                        scheduler, report_client, data_queries, url, workdir, duration, rate
                    )
                finally:
                    await cancel_and_wait([watching])
                transitions = log.ordered()
                audit = await _audit_trail(scheduler, report_client)
            _summary(tally, transitions, alerts, audit)
            return tally.failed
    finally:
        for dq in data_queries:
            dq.stop()
        shutil.rmtree(workdir, ignore_errors=True)


async def _drive(
    scheduler: ReachClient,
    report_client: ReachClient,
    data_queries: list[DataQueryProcess],
    url: str,
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
            await _event(what, data_queries, url, workdir, report_client)
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
    url: str,
    workdir: Path,
    client: ReachClient,
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
        replacement = DataQueryProcess(url, "data-query-3", workdir)
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


async def _audit_trail(*clients: ReachClient) -> list[AuditEvent]:
    """Every audit event of the run, once the clients' writers have written them."""
    for client in clients:
        if client.audit is not None:
            await asyncio.wait_for(client.audit.flush(), 10)
    return [event async for event in read_events(clients[0].connection)]


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
            f" p99 {tally.percentile(0.99):.1f} ms"
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
        + ") — `reach audit tail` shows them"
    )
    click.echo("  last audit events:")
    for event in audit[-5:]:
        click.echo(f"    {format_event(event)}")
