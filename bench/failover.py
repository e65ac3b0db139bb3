"""The failover benchmark: what a caller sees when one of three instances dies or hangs.

``python -m bench.failover [--quick] [--reps N] [--rate R] [--out FILE]``

Three instances of one idempotent echo capability run in three OS processes (health
interval 1 s); a registrar runs in a fourth and the caller (one ``ReachClient``) in this
one. The caller offers a fixed load, open loop: call ``i`` starts at ``t0 + i / rate``
whether or not earlier calls have returned, so a stall shows up as latency and not as
a quietly lower rate. After ``pre_sec`` one instance gets a signal:

- ``kill`` (SIGKILL, a crash): failed calls (target 0), the latency of calls started in
  the second after the kill against the second before (p99, max), and when the caller's
  route cache (a KV watch, what routing reads) shows the instance unhealthy, then gone;
- ``stop`` (SIGSTOP, a hang: the process keeps its connection but answers nothing): the
  same, plus when calls stopped being routed to it.

"Routed to it" is read per attempt (the subject each request is sent on), since a call
whose first attempt went to the hung instance ends with ``CallResult.agent_id`` naming
the instance that answered the retry. Every repetition uses fresh instances and a fresh
capability; figures are medians with min–max over repetitions.

Child side, shared with ``bench.growth`` (run by the benches, not by hand)::

    python -m bench.failover agents URL MANIFESTS_JSON

runs every agent of the JSON list in one process (echo handlers), prints ``READY`` and
serves until its standard input closes or it gets SIGTERM. SIGUSR1 turns its handlers
into ones that raise on every call, SIGUSR2 into ones that answer at five times the
capability's latency SLA (the fault scenarios' alive-but-wrong instances); the same
signal again turns them back. The process and its probes stay as they were.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import json
import os
import secrets
import shutil
import signal
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.callpath import server_version
from bench.procs import Child, log_dir
from bench.report import (
    _fmt,
    _table,
    machine_info,
    percentile,
    require_fresh_build,
    spread,
    write_json,
)

__all__ = [
    "DEFAULT",
    "QUICK",
    "Fabric",
    "Settings",
    "echo_manifest",
    "fabric",
    "main",
    "start_agents",
    "start_child",
]

Progress = Callable[[str], None]

_ROOT = Path(__file__).resolve().parent.parent
_DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "failover.json"
_START_TIMEOUT = 60.0
SCENARIOS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}


@dataclass(frozen=True)
class Settings:
    reps: int = 5
    #: offered load, calls started per second (open loop)
    rate: float = 300.0
    instances: int = 3
    #: seconds of load before the signal
    pre_sec: float = 3.0
    #: seconds of load after the signal, at least; load goes on until the route cache
    #: shows the instance evicted (or ``settle_max_sec`` passed)
    post_sec: float = 3.0
    settle_max_sec: float = 15.0
    #: the instances' health settings (manifest ``health``)
    interval_sec: float = 1.0
    probe_timeout_sec: float = 0.5
    failures_before_unhealthy: int = 2
    #: one attempt waits 1.5 × this; the call as a whole ``call_timeout_sec``
    latency_sla_ms: float = 200.0
    call_timeout_sec: float = 2.0
    scenarios: tuple[str, ...] = ("kill", "stop")
    #: load before the first repetition, so that the caller's retry budget (10 % of the
    #: first attempts of the last 60 s, at least 10) is that of a caller already running
    warmup_sec: float = 20.0


DEFAULT = Settings()
QUICK = Settings(reps=1, rate=100.0, pre_sec=1.5, post_sec=1.5, settle_max_sec=8.0, warmup_sec=3.0)


# -- child processes ------------------------------------------------------------------


async def start_child(
    name: str,
    module: str,
    args: Sequence[str],
    logs: Path,
    timeout: float = _START_TIMEOUT,
    line_limit: int = 2**16,
) -> Child:
    """``python -m module *args`` as a :class:`bench.procs.Child`, once it says READY."""
    return await Child.launch(name, module, args, logs, timeout, line_limit)


async def start_agents(
    name: str, url: str, manifests: Sequence[dict[str, Any]], logs: Path
) -> Child:
    """One process serving every agent of ``manifests`` (echo handlers)."""
    return await start_child(name, "bench.failover", ["agents", url, json.dumps(manifests)], logs)


def echo_manifest(
    agent_id: str,
    capability: str,
    *,
    interval_sec: float = 15.0,
    probe_timeout_sec: float = 3.0,
    failures_before_unhealthy: int = 2,
    latency_sla_ms: float = 1000.0,
    idempotent: bool = False,
    max_concurrency: int = 64,
) -> dict[str, Any]:
    return {
        "agent_id": agent_id,
        "agent_name": "bench_echo",
        "version": "1.0.0",
        "max_concurrency": max_concurrency,
        "capabilities": [
            {
                "name": capability,
                "description": "Echo the request (benchmark)",
                "tags": ["bench", "echo"],
                "latency_sla_ms": latency_sla_ms,
                "security_level": 1,
                "idempotent": idempotent,
            }
        ],
        "health": {
            "interval_sec": interval_sec,
            "timeout_sec": probe_timeout_sec,
            "failures_before_unhealthy": failures_before_unhealthy,
        },
    }


async def _serve_agents(url: str, manifests: list[dict[str, Any]]) -> None:
    from reach.agent.agent import Agent

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)

    misbehave = {"crash": False, "crawl": False}

    def toggle(mode: str) -> None:
        misbehave[mode] = not misbehave[mode]

    loop.add_signal_handler(signal.SIGUSR1, toggle, "crash")
    loop.add_signal_handler(signal.SIGUSR2, toggle, "crawl")

    def echo_for(sla_ms: float) -> Any:
        async def echo(req: Any) -> Any:
            if misbehave["crash"]:
                raise RuntimeError("this instance raises on every call (SIGUSR1)")
            if misbehave["crawl"]:
                await asyncio.sleep(5 * sla_ms / 1000.0)
            return req

        return echo

    agents = [Agent(m, servers=url) for m in manifests]
    for agent in agents:
        for cap in agent.manifest.capabilities:
            agent.capability(cap.name)(echo_for(cap.latency_sla_ms))
    started: list[Any] = []
    # each start asks the token issuer, which checks the secret with scrypt (~40 ms of
    # CPU, one at a time): dozens at once wait past the 5 s token request timeout
    slots = asyncio.Semaphore(4)

    async def start(agent: Any) -> None:
        async with slots:
            await agent.start()
            started.append(agent)

    async def until_eof() -> None:
        await reader.read()
        stop.set()

    watcher = asyncio.create_task(until_eof())
    try:
        await asyncio.gather(*(start(a) for a in agents))
        print("READY", flush=True)
        await stop.wait()
    finally:
        watcher.cancel()
        await asyncio.gather(*(a.stop() for a in started), return_exceptions=True)


# -- the fabric: server and registrar --------------------------------------------------


@dataclass
class Fabric:
    url: str
    server_pid: int | None
    registrar: Child
    logs: Path
    run_id: str


@asynccontextmanager
async def fabric(progress: Progress) -> AsyncIterator[Fabric]:
    """A nats-server and a registrar process (tokens on, as with ``reach up``).

    Child logs live in a temporary directory, removed after a clean run and named after a
    failed one.
    """
    from reach.testing import NatsServer

    logs = log_dir()
    try:
        async with AsyncExitStack() as stack:
            server = NatsServer(store_dir=logs / "nats")
            await server.start()
            stack.push_async_callback(server.stop)
            progress(f"nats-server {server.url} (pid {server.pid})")
            registrar = await Child.start("registrar", ["registrar", server.url, str(logs)], logs)
            stack.push_async_callback(registrar.stop)
            # the benchmark's agents (children) and callers use the registrar's credentials
            os.environ["REACH_CREDS"] = str(logs / "bench.creds")
            yield Fabric(server.url, server.pid, registrar, logs, secrets.token_hex(3))
    except BaseException:
        progress(f"failed; logs of the child processes are in {logs}")
        raise
    shutil.rmtree(logs, ignore_errors=True)


# -- one repetition -----------------------------------------------------------------------


@dataclass
class _Call:
    #: seconds from the signal to the start of the call (negative: before it)
    at: float
    latency_ms: float
    agent_id: str
    attempts: int
    error: str | None = None


@dataclass
class _Watch:
    """Route-cache changes (what routing reads) and the attempts sent, in monotonic time."""

    #: agent id -> (time, status or "gone", status reason)
    changes: dict[str, list[tuple[float, str, str]]] = field(default_factory=dict)
    attempts: dict[str, list[float]] = field(default_factory=dict)

    def on_change(self, agent_id: str, instance: Any) -> None:
        if instance is None:
            entry = (time.monotonic(), "gone", "")
        else:
            entry = (time.monotonic(), str(instance.status), str(instance.status_reason))
        self.changes.setdefault(agent_id, []).append(entry)

    def first(self, agent_id: str, status: str, after: float) -> tuple[float, str] | None:
        """Time and reason of the first change to ``status`` at or after ``after``."""
        return next(
            ((t, r) for t, s, r in self.changes.get(agent_id, []) if s == status and t >= after),
            None,
        )


def _tap_attempts(client: Any, watch: _Watch) -> bool:
    """Record the instance of every attempt, from the subject it is sent on.

    ReachClient has no public per-attempt hook (CallResult names only the instance that
    answered last; the route of every attempt is in the audit event only), so the
    benchmark wraps the client's request function. Returns False if it cannot.
    """
    attempts: Any = getattr(client, "_attempts", None)  # the client's AttemptRunner
    original = getattr(attempts, "request", None)
    if original is None:
        return False
    prefix = "reach.v1.cap."

    async def tapped(subject: str, data: bytes, timeout: float, batch: bool) -> Any:
        if subject.startswith(prefix):
            parts = subject[len(prefix) :].split(".", 1)
            if len(parts) == 2:
                watch.attempts.setdefault(parts[1], []).append(time.monotonic())
        return await original(subject, data, timeout, batch)

    attempts.request = tapped
    return True


def _latency(calls: Sequence[_Call]) -> dict[str, Any]:
    ok = [c.latency_ms for c in calls if c.error is None]
    if not ok:
        return {"calls": len(calls), "p50": None, "p99": None, "max": None}
    return {
        "calls": len(calls),
        "p50": round(percentile(ok, 0.5), 3),
        "p99": round(percentile(ok, 0.99), 3),
        "max": round(max(ok), 3),
    }


def _rel(t: float | None, origin: float) -> float | None:
    return None if t is None else round(t - origin, 3)


async def _open_loop(
    client: Any,
    capability: str,
    settings: Settings,
    watch: _Watch,
    victim: str,
    hit: Callable[[], None],
) -> tuple[list[tuple[float, _Call]], float, int]:
    """Calls at ``rate``/s; ``hit()`` at ``pre_sec``; on until the victim is gone.

    Returns (start time, call) pairs, the monotonic time of the signal, and how many calls
    started more than 10 ms behind their schedule (the generator itself falling behind).
    """
    from reach.errors import ReachError

    calls: list[tuple[float, _Call]] = []
    tasks: set[asyncio.Task[None]] = set()
    late = 0
    hit_at: float | None = None

    async def one(seq: int) -> None:
        started = time.monotonic()
        perf = time.perf_counter()
        try:
            result = await client.call(capability, {"seq": seq}, timeout=settings.call_timeout_sec)
        except ReachError as exc:
            ms = (time.perf_counter() - perf) * 1000
            error = f"{type(exc).__name__}: {exc}"
            calls.append((started, _Call(0.0, ms, "", getattr(exc, "attempts", 0), error)))
            return
        ms = (time.perf_counter() - perf) * 1000
        calls.append((started, _Call(0.0, ms, result.agent_id, result.attempts)))

    t0 = time.monotonic()
    seq = 0
    while True:
        now = time.monotonic()
        if hit_at is None and now - t0 >= settings.pre_sec:
            hit()
            hit_at = time.monotonic()
        if hit_at is not None and now - hit_at >= settings.post_sec:
            gone = watch.first(victim, "gone", hit_at) is not None
            if gone or now - hit_at >= settings.settle_max_sec:
                break
        target = t0 + seq / settings.rate
        if target > now:
            await asyncio.sleep(target - now)
        elif now - target > 0.010:
            late += 1
        task = asyncio.create_task(one(seq))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        seq += 1
    if tasks:
        await asyncio.wait(set(tasks))
    assert hit_at is not None
    return calls, hit_at, late


async def _steady(client: Any, capability: str, settings: Settings, seconds: float) -> int:
    """Calls at the offered rate for ``seconds``, open loop; returns the failed ones."""
    tasks = []
    t0 = time.monotonic()
    for seq in range(int(settings.rate * seconds)):
        delay = t0 + seq / settings.rate - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        call = client.call(capability, {"seq": -seq}, timeout=settings.call_timeout_sec)
        tasks.append(asyncio.create_task(call))
    results = await asyncio.gather(*tasks, return_exceptions=True)
    return sum(1 for r in results if isinstance(r, BaseException))


async def _repetition(
    bed: Fabric,
    client: Any,
    watch: _Watch,
    settings: Settings,
    scenario: str,
    rep: int,
    warmup_sec: float,
) -> dict[str, Any]:
    capability = f"failover_{bed.run_id}_{scenario}_{rep}"
    ids = [f"fo-{bed.run_id}-{scenario}{rep}-{i}" for i in range(settings.instances)]
    manifests = [
        echo_manifest(
            agent_id,
            capability,
            interval_sec=settings.interval_sec,
            probe_timeout_sec=settings.probe_timeout_sec,
            failures_before_unhealthy=settings.failures_before_unhealthy,
            latency_sla_ms=settings.latency_sla_ms,
            idempotent=True,
        )
        for agent_id in ids
    ]
    hosts = await asyncio.gather(
        *(
            start_agents(f"agent-{a}", bed.url, [m], bed.logs)
            for a, m in zip(ids, manifests, strict=True)
        )
    )
    victim_index = rep % len(hosts)
    victim, victim_id = hosts[victim_index], ids[victim_index]
    try:
        await client.routes.wait_for(
            lambda c: sum(1 for i in c.find(capability) if i.status == "healthy") == len(ids),
            timeout=30,
        )
        # a few calls first, so that every instance has a latency observation
        for seq in range(30):
            await client.call(capability, {"seq": -seq}, timeout=settings.call_timeout_sec)
        warmup_failed = await _steady(client, capability, settings, warmup_sec)
        budget_before = _budget(client)

        def hit() -> None:
            victim.proc.send_signal(SCENARIOS[scenario])

        stamped, hit_at, late = await _open_loop(
            client, capability, settings, watch, victim_id, hit
        )
    finally:
        with contextlib.suppress(ProcessLookupError):
            victim.proc.kill()
        await asyncio.gather(*(h.stop() for h in hosts), return_exceptions=True)
    calls = []
    for started, call in stamped:
        call.at = round(started - hit_at, 4)
        calls.append(call)
    calls.sort(key=lambda c: c.at)
    before = [c for c in calls if -1.0 <= c.at < 0.0]
    after = [c for c in calls if 0.0 <= c.at < 1.0]
    failed = [c for c in calls if c.error is not None]
    lb, la = _latency(before), _latency(after)
    routed_after = [t for t in watch.attempts.get(victim_id, []) if t >= hit_at]
    answered_after = [c.at for c in calls if c.at >= 0 and c.agent_id == victim_id]
    affected = [c.at for c in calls if c.at >= 0 and (c.attempts > 1 or c.error is not None)]

    def extra(key: str) -> float | None:
        was, now = lb[key], la[key]
        if was is None or now is None:
            return None
        return round(float(now) - float(was), 3)

    unhealthy = watch.first(victim_id, "unhealthy", hit_at)
    gone = watch.first(victim_id, "gone", hit_at)
    breaker = client.breakers.get(victim_id).snapshot()
    return {
        "scenario": scenario,
        "rep": rep,
        "victim": victim_id,
        "calls": len(calls),
        "offered_per_sec": settings.rate,
        "load_sec": round(calls[-1].at - calls[0].at, 3) if calls else 0.0,
        "late_starts": late,
        "failed": len(failed),
        "errors": dict(Counter(c.error.split(":", 1)[0] for c in failed if c.error)),
        "first_error": failed[0].error if failed else None,
        "retried_calls": sum(1 for c in calls if c.attempts > 1),
        "max_attempts": max((c.attempts for c in calls), default=0),
        "latency_before_ms": lb,
        "latency_after_ms": la,
        "extra_p99_ms": extra("p99"),
        "extra_max_ms": extra("max"),
        "attempts_to_victim_after_sec": len(routed_after),
        "last_routed_to_victim_sec": _rel(max(routed_after, default=None), hit_at),
        "last_answered_by_victim_sec": max(answered_after, default=None),
        "last_affected_call_sec": max(affected, default=None),
        "unhealthy_after_sec": _rel(unhealthy[0] if unhealthy else None, hit_at),
        "gone_after_sec": _rel(gone[0] if gone else None, hit_at),
        "unhealthy_reason": unhealthy[1] if unhealthy else None,
        "breaker": {"state": str(breaker.state), "trips": breaker.trips},
        "warmup_sec": warmup_sec,
        "warmup_failed": warmup_failed,
        "retry_budget_before": budget_before,
        "retry_budget_after": _budget(client),
    }


def _budget(client: Any) -> dict[str, int]:
    budget = client.retry_budget
    return {"calls": budget.calls, "retries": budget.retries, "available": budget.available}


# -- the run -------------------------------------------------------------------------------


_FIGURES = (
    "failed",
    "retried_calls",
    "extra_p99_ms",
    "extra_max_ms",
    "last_routed_to_victim_sec",
    "unhealthy_after_sec",
    "gone_after_sec",
)


def summarize(runs: Sequence[dict[str, Any]], scenarios: Sequence[str]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for scenario in scenarios:
        mine = [r for r in runs if r["scenario"] == scenario]
        entry = {key: spread([r[key] for r in mine]) for key in _FIGURES}
        for side in ("before", "after"):
            for q in ("p50", "p99", "max"):
                entry[f"{side}_{q}_ms"] = spread([r[f"latency_{side}_ms"][q] for r in mine])
        entry["failed_total"] = sum(r["failed"] for r in mine)
        entry["calls_total"] = sum(r["calls"] for r in mine)
        summary[scenario] = entry
    return summary


async def run_failover(settings: Settings, progress: Progress) -> dict[str, Any]:
    from reach.caller.client import ReachClient

    began = time.perf_counter()
    runs: list[dict[str, Any]] = []
    async with fabric(progress) as bed:
        version = await asyncio.to_thread(server_version, bed.url)
        watch = _Watch()
        async with ReachClient(servers=bed.url, name="bench-failover") as client:
            client.routes.on_change(watch.on_change)
            tapped = _tap_attempts(client, watch)
            for rep in range(settings.reps):
                for scenario in settings.scenarios:
                    warmup = settings.warmup_sec if not runs else 0.0
                    run = await _repetition(bed, client, watch, settings, scenario, rep, warmup)
                    runs.append(run)
                    progress(
                        f"rep {rep + 1}/{settings.reps} {scenario}: {run['calls']} calls,"
                        f" {run['failed']} failed, p99 {run['latency_before_ms']['p99']} →"
                        f" {run['latency_after_ms']['p99']} ms, unhealthy after"
                        f" {run['unhealthy_after_sec']} s, gone after {run['gone_after_sec']} s"
                    )
    return {
        "benchmark": "failover",
        "format": 1,
        "timestamp": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine_info(version),
        "settings": asdict(settings),
        "attempts_tapped": tapped,
        "wall_sec": round(time.perf_counter() - began, 2),
        "summary": summarize(runs, settings.scenarios),
        "runs": runs,
    }


def format_table(doc: dict[str, Any]) -> str:
    s = doc["settings"]
    m = doc["machine"]
    head = (
        f"Failover: {s['instances']} instances (one process each, health interval"
        f" {s['interval_sec']:g} s), {s['rate']:g} calls/s open loop, idempotent echo;"
        f" {s['reps']} repetitions, median (min–max); the caller ran {s['warmup_sec']:g} s"
        " of load before the first.\n"
        f"{m['python']}, nats-server {m['nats_server']}, {m['cpus_usable']} CPUs,"
        f" load average {m['load_average']}, commit {m['git_commit']}."
    )
    rows_spec = [
        ("failed calls (target 0)", "failed", 0, ""),
        ("calls retried", "retried_calls", 0, ""),
        ("p99 in the second before, ms", "before_p99_ms", 1, ""),
        ("p99 in the second after, ms", "after_p99_ms", 1, ""),
        ("extra p99, ms", "extra_p99_ms", 1, ""),
        ("max in the second after, ms", "after_max_ms", 1, ""),
        ("extra max, ms", "extra_max_ms", 1, ""),
        ("last attempt routed to it, s", "last_routed_to_victim_sec", 2, ""),
        ("route cache: unhealthy after, s", "unhealthy_after_sec", 2, ""),
        ("route cache: gone after, s", "gone_after_sec", 2, ""),
    ]
    scenarios = list(doc["summary"])
    label = {"kill": "SIGKILL (crash)", "stop": "SIGSTOP (hang)"}
    rows = [
        [name, *(_fmt(doc["summary"][sc][key], digits) for sc in scenarios)]
        for name, key, digits, _ in rows_spec
    ]
    rows.append(
        ["failed / calls, all reps"]
        + [
            f"{doc['summary'][sc]['failed_total']} / {doc['summary'][sc]['calls_total']}"
            for sc in scenarios
        ]
    )
    table = _table("", ["", *(label.get(sc, sc) for sc in scenarios)], rows)
    errors = [
        f"  {r['scenario']} rep {r['rep'] + 1}: {r['failed']} failed, first: {r['first_error']}"
        for r in doc["runs"]
        if r["failed"]
    ]
    tail = "\nFAILED CALLS:\n" + "\n".join(errors) if errors else ""
    return head + "\n" + table + tail


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, Settings]:
    parser = argparse.ArgumentParser(
        prog="python -m bench.failover",
        description="Failover: SIGKILL and SIGSTOP of one of three instances under load.",
    )
    parser.add_argument("--quick", action="store_true", help="1 repetition at 100 calls/s")
    parser.add_argument("--reps", type=int, default=None, help="repetitions (5)")
    parser.add_argument("--rate", type=float, default=None, help="offered calls/s (300)")
    parser.add_argument("--pre", type=float, default=None, help="seconds of load before (3)")
    parser.add_argument("--post", type=float, default=None, help="seconds of load after, min (3)")
    parser.add_argument(
        "--scenarios", default=None, help="comma-separated, of: " + ",".join(SCENARIOS)
    )
    parser.add_argument(
        "--warmup", type=float, default=None, help="seconds of load before the first rep (20)"
    )
    parser.add_argument("--out", type=Path, default=_DEFAULT_OUT, help="JSON results file")
    args = parser.parse_args(argv)
    base = QUICK if args.quick else DEFAULT
    overrides: dict[str, Any] = {
        "reps": args.reps,
        "rate": args.rate,
        "pre_sec": args.pre,
        "post_sec": args.post,
        "warmup_sec": args.warmup,
    }
    if args.scenarios is not None:
        names = tuple(n.strip() for n in args.scenarios.split(",") if n.strip())
        if not names or any(n not in SCENARIOS for n in names):
            parser.error(f"--scenarios: choose among {', '.join(SCENARIOS)}")
        overrides["scenarios"] = names
    settings = dataclasses.replace(base, **{k: v for k, v in overrides.items() if v is not None})
    if settings.reps < 1 or settings.rate <= 0 or settings.pre_sec < 1.0 or settings.post_sec <= 0:
        parser.error("--reps >= 1, --rate > 0, --pre >= 1 (the second before) and --post > 0")
    return args, settings


def main(argv: Sequence[str] | None = None) -> int:
    require_fresh_build()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["agents"]:
        asyncio.run(_serve_agents(argv[1], json.loads(argv[2])))
        return 0
    args, settings = parse_args(argv)

    def progress(line: str) -> None:
        print(f"[failover] {line}", file=sys.stderr, flush=True)

    doc = asyncio.run(run_failover(settings, progress))
    doc["command"] = " ".join(["python -m bench.failover", *argv])
    write_json(doc, args.out)
    print(format_table(doc))
    print(f"\nJSON: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
