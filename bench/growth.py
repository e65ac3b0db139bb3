"""The growth benchmark: calls/s and latency as callee instances and caller processes grow.

``python -m bench.growth [--quick] [--instances 1,2,5] [--callers 1,2] [--out FILE]``

Two curves, on one nats-server and one registrar (its own process, tokens on):

- instances: 1 → 100 instances of one echo capability, one caller process with
  ``in_flight`` calls in flight (closed loop: each worker calls again as soon as its call
  returns). With 2 cores, N instances cannot be N processes: they are N agents (each its
  own NATS connection, heartbeats, probe subscription and registry record) spread
  round-robin over ``min(N, max_hosts)`` processes. So this curve measures what more
  instances cost the fabric — routing over N candidates per call, N records in every
  route cache, N heartbeats and probes — and not more serving capacity, which 2 cores
  do not have;
- callers: 1 → 20 caller processes against ``callers_instances`` instances, each caller
  with ``in_flight`` calls in flight.

Every point starts its callers together at one wall-clock instant (after ``warmup_sec``
of uncounted calls) and counts the calls that complete in the next ``duration_sec``;
latency percentiles are over every counted call of every caller. CPU time of every
process is read from /proc over the same window. A PNG chart of both curves is written
next to the JSON when matplotlib is installed.

Child side (run by the bench, not by hand)::

    python -m bench.growth caller URL NAME

connects a ReachClient, prints ``READY``, then for each ``RUN {json}`` line on its
standard input answers one ``RESULT {json}`` line; it exits when its input closes.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.callpath import server_version
from bench.failover import Fabric, echo_manifest, fabric, start_agents, start_child
from bench.procs import Child, cpu_seconds
from bench.report import (
    NO_MATPLOTLIB,
    _table,
    machine_info,
    percentile,
    pyplot,
    require_fresh_build,
    write_json,
)

__all__ = ["DEFAULT", "QUICK", "Settings", "format_tables", "main", "run_growth", "write_chart"]

_DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "growth.json"
_READY_TIMEOUT = 60.0


@dataclass(frozen=True)
class Settings:
    instances: tuple[int, ...] = (1, 2, 5, 10, 25, 50, 100)
    callers: tuple[int, ...] = (1, 2, 5, 10, 20)
    #: callee instances while the number of callers grows
    callers_instances: int = 10
    #: calls in flight per caller process (closed loop)
    in_flight: int = 16
    #: callee instances are spread over at most this many processes
    max_hosts: int = 4
    warmup_sec: float = 1.0
    duration_sec: float = 3.0
    #: the instances' heartbeat and probe interval (the manifest default)
    interval_sec: float = 15.0


DEFAULT = Settings()
QUICK = Settings(
    instances=(1, 5), callers=(1, 2), callers_instances=2, warmup_sec=0.3, duration_sec=1.0
)


# -- child side: a caller process ------------------------------------------------------


async def _run_calls(client: Any, cmd: dict[str, Any]) -> dict[str, Any]:
    """Wait for the instances, call until the window ends, report the window's calls."""
    capability: str = cmd["capability"]
    expect: int = cmd["instances"]

    def routable(cache: Any) -> bool:
        return sum(1 for i in cache.find(capability) if i.status == "healthy") >= expect

    await client.routes.wait_for(routable, timeout=_READY_TIMEOUT)
    # the window in this process's monotonic clock, from the parent's wall-clock instant
    start = time.monotonic() + (cmd["start_at"] - time.time())
    end = start + cmd["duration_sec"]
    late = time.monotonic() > start
    latencies: list[float] = []
    errors = 0
    first_error: str | None = None
    payload = {"industry": "electric-vehicles", "time_range": "2025Q3", "max_items": 25}

    async def worker() -> None:
        nonlocal errors, first_error
        while True:
            began = time.monotonic()
            if began >= end:
                return
            try:
                await client.call(capability, payload)
            except Exception as exc:
                if began >= start:
                    errors += 1
                    first_error = first_error or f"{type(exc).__name__}: {exc}"
                continue
            done = time.monotonic()
            if began >= start and done <= end:
                latencies.append(round((done - began) * 1000, 3))

    cpu = time.process_time()
    await asyncio.gather(*(worker() for _ in range(cmd["in_flight"])))
    return {
        "calls": len(latencies),
        "errors": errors,
        "first_error": first_error,
        "late": late,
        "cpu_sec": round(time.process_time() - cpu, 4),
        "latencies_ms": latencies,
    }


async def _serve_caller(url: str, name: str) -> None:
    from reach.caller.client import ReachClient

    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    async with ReachClient(servers=url, name=name) as client:
        print("READY", flush=True)
        while line := await reader.readline():
            word, _, body = line.decode().partition(" ")
            if word.strip() != "RUN":
                continue
            try:
                result = await _run_calls(client, json.loads(body))
            except Exception as exc:
                result = {"failed": f"{type(exc).__name__}: {exc}"}
            print("RESULT " + json.dumps(result), flush=True)


# -- parent side --------------------------------------------------------------------------


class _Callers:
    """A pool of caller processes, started as needed and kept for later points."""

    def __init__(self, bed: Fabric) -> None:
        self._bed = bed
        self.children: list[Child] = []

    async def at_least(self, count: int) -> list[Child]:
        missing = range(len(self.children), count)
        started = await asyncio.gather(
            *(
                start_child(
                    f"caller-{i}",
                    "bench.growth",
                    ["caller", self._bed.url, f"bench-growth-caller-{i}"],
                    self._bed.logs,
                    # a RESULT line carries every latency of the window
                    line_limit=2**26,
                )
                for i in missing
            ),
            return_exceptions=True,
        )
        for child in started:
            if isinstance(child, Child):
                self.children.append(child)
        for child in started:
            if isinstance(child, BaseException):
                raise child
        return self.children[:count]

    async def stop(self) -> None:
        await asyncio.gather(*(c.stop() for c in self.children), return_exceptions=True)
        self.children.clear()


def _rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except (OSError, ValueError, IndexError):
        pass
    return None


async def _start_hosts(
    bed: Fabric, settings: Settings, capability: str, count: int
) -> tuple[list[Child], list[str]]:
    ids = [f"grow-{bed.run_id}-{capability.rsplit('_', 1)[1]}-{i}" for i in range(count)]
    hosts = min(count, settings.max_hosts)
    groups = [
        [
            echo_manifest(
                agent_id, capability, interval_sec=settings.interval_sec, max_concurrency=1024
            )
            for agent_id in ids[h::hosts]
        ]
        for h in range(hosts)
    ]
    started = await asyncio.gather(
        *(
            start_agents(f"host-{capability}-{h}", bed.url, group, bed.logs)
            for h, group in enumerate(groups)
        ),
        return_exceptions=True,
    )
    children = [c for c in started if isinstance(c, Child)]
    for child in started:
        if isinstance(child, BaseException):
            await asyncio.gather(*(c.stop() for c in children), return_exceptions=True)
            raise child
    return children, ids


async def _measure(
    bed: Fabric,
    callers: Sequence[Child],
    hosts: Sequence[Child],
    settings: Settings,
    capability: str,
    instances: int,
) -> dict[str, Any]:
    start_at = time.time() + settings.warmup_sec + 0.1
    cmd = {
        "capability": capability,
        "instances": instances,
        "start_at": start_at,
        "duration_sec": settings.duration_sec,
        "in_flight": settings.in_flight,
    }
    line = ("RUN " + json.dumps(cmd) + "\n").encode()
    for child in callers:
        assert child.proc.stdin is not None
        child.proc.stdin.write(line)
    await asyncio.gather(*(c.proc.stdin.drain() for c in callers if c.proc.stdin is not None))

    def cpu() -> dict[str, float | None]:
        def total(children: Sequence[Child]) -> float | None:
            values = [c.cpu_seconds() for c in children]
            return None if any(v is None for v in values) else sum(v for v in values if v)

        return {
            "callers": total(callers),
            "callees": total(hosts),
            "registrar": bed.registrar.cpu_seconds(),
            "server": cpu_seconds(bed.server_pid),
        }

    await asyncio.sleep(max(0.0, start_at - time.time()))
    cpu_start = cpu()
    await asyncio.sleep(settings.duration_sec)
    cpu_end = cpu()
    results = []
    for child in callers:
        assert child.proc.stdout is not None
        raw = await asyncio.wait_for(child.proc.stdout.readline(), _READY_TIMEOUT)
        text = raw.decode(errors="replace")
        if not text.startswith("RESULT "):
            raise RuntimeError(f"{child.name} said {text!r}; its log:\n{child.tail()}")
        result = json.loads(text[len("RESULT ") :])
        if "failed" in result:
            raise RuntimeError(f"{child.name}: {result['failed']}; its log:\n{child.tail()}")
        results.append(result)
    latencies = [x for r in results for x in r["latencies_ms"]]
    calls = len(latencies)

    def us_per_call(role: str) -> float | None:
        a, b = cpu_start[role], cpu_end[role]
        if a is None or b is None or calls == 0:
            return None
        return round((b - a) / calls * 1e6, 1)

    def pct(q: float) -> float | None:
        return round(percentile(latencies, q), 3) if latencies else None

    errors = sum(r["errors"] for r in results)
    return {
        "instances": instances,
        "callers": len(callers),
        "in_flight_per_caller": settings.in_flight,
        "host_processes": len(hosts),
        "calls": calls,
        "errors": errors,
        "first_error": next((r["first_error"] for r in results if r["first_error"]), None),
        "late_callers": sum(1 for r in results if r["late"]),
        "seconds": settings.duration_sec,
        "calls_per_sec": round(calls / settings.duration_sec, 1),
        "latency_ms": {"p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99)},
        "per_caller_calls_per_sec": [round(r["calls"] / settings.duration_sec, 1) for r in results],
        "cpu_us_per_call": {role: us_per_call(role) for role in cpu_start},
        "callee_rss_mb": sum(v for h in hosts if (v := _rss_mb(h.pid)) is not None),
    }


async def _point(
    bed: Fabric,
    callers: Sequence[Child],
    settings: Settings,
    capability: str,
    instances: int,
    hosts: Sequence[Child] | None = None,
) -> dict[str, Any]:
    if hosts is not None:
        return await _measure(bed, callers, hosts, settings, capability, instances)
    started, _ = await _start_hosts(bed, settings, capability, instances)
    try:
        return await _measure(bed, callers, started, settings, capability, instances)
    finally:
        await asyncio.gather(*(h.stop() for h in started), return_exceptions=True)


def _say(point: dict[str, Any]) -> str:
    lat = point["latency_ms"]
    return (
        f"{point['instances']} instances, {point['callers']} callers:"
        f" {point['calls_per_sec']:,.0f} calls/s, p50 {lat['p50']} ms, p99 {lat['p99']} ms"
        + (f", {point['errors']} errors" if point["errors"] else "")
    )


async def run_growth(settings: Settings, progress: Any) -> dict[str, Any]:
    began = time.perf_counter()
    by_instances: list[dict[str, Any]] = []
    by_callers: list[dict[str, Any]] = []
    async with fabric(progress) as bed:
        version = await asyncio.to_thread(server_version, bed.url)
        pool = _Callers(bed)
        try:
            (first,) = await pool.at_least(1)
            for n in settings.instances:
                point = await _point(bed, [first], settings, f"grow_{bed.run_id}_i{n}", n)
                by_instances.append(point)
                progress(_say(point))
            capability = f"grow_{bed.run_id}_c{settings.callers_instances}"
            hosts, _ = await _start_hosts(bed, settings, capability, settings.callers_instances)
            try:
                for count in settings.callers:
                    progress(f"{count} callers: starting caller processes")
                    callers = await pool.at_least(count)
                    point = await _point(
                        bed, callers, settings, capability, settings.callers_instances, hosts
                    )
                    by_callers.append(point)
                    progress(_say(point))
            finally:
                await asyncio.gather(*(h.stop() for h in hosts), return_exceptions=True)
        finally:
            await pool.stop()
    return {
        "benchmark": "growth",
        "format": 1,
        "timestamp": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine_info(version),
        "settings": asdict(settings),
        "wall_sec": round(time.perf_counter() - began, 2),
        "by_instances": by_instances,
        "by_callers": by_callers,
    }


# -- output ------------------------------------------------------------------------------


def _n(value: float | None, digits: int) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def format_tables(doc: dict[str, Any]) -> str:
    s = doc["settings"]
    m = doc["machine"]
    blocks = [
        f"Growth: echo capability, closed loop with {s['in_flight']} calls in flight per caller"
        f" process, {s['duration_sec']:g} s per point after {s['warmup_sec']:g} s of warm-up.",
        f"{m['python']}, nats-server {m['nats_server']}, {m['cpus_usable']} CPUs,"
        f" load average {m['load_average']}, commit {m['git_commit']}.",
    ]

    def rows(points: Sequence[dict[str, Any]], first: str) -> list[list[str]]:
        out = []
        for p in points:
            cpu = p["cpu_us_per_call"]
            out.append(
                [
                    str(p[first]),
                    str(p["host_processes"]),
                    _n(p["calls_per_sec"], 0),
                    _n(p["latency_ms"]["p50"], 2),
                    _n(p["latency_ms"]["p99"], 2),
                    _n(cpu["callers"], 0),
                    _n(cpu["callees"], 0),
                    _n(cpu["server"], 0),
                    str(p["errors"]),
                ]
            )
        return out

    header = [
        "",
        "callee procs",
        "calls/s",
        "p50 ms",
        "p99 ms",
        "CPU µs/call: callers",
        "callees",
        "server",
        "errors",
    ]
    blocks.append(
        _table(
            "\nGrowing the callee instances (1 caller process; N agents over at most"
            f" {s['max_hosts']} processes)",
            ["instances", *header[1:]],
            rows(doc["by_instances"], "instances"),
        )
    )
    blocks.append(
        _table(
            f"\nGrowing the caller processes ({s['callers_instances']} callee instances,"
            f" {s['in_flight']} in flight each)",
            ["callers", *header[1:]],
            rows(doc["by_callers"], "callers"),
        )
    )
    errors = [
        f"  {p['instances']} instances, {p['callers']} callers: {p['errors']} errors,"
        f" first: {p['first_error']}"
        for p in [*doc["by_instances"], *doc["by_callers"]]
        if p["errors"]
    ]
    if errors:
        blocks.append("\nERRORS during measurement (numbers above exclude failed calls):")
        blocks.extend(errors)
    return "\n".join(blocks)


def write_chart(doc: dict[str, Any], path: Path) -> tuple[Path | None, str]:
    """Both curves in one PNG; without matplotlib, no chart and a note saying so."""
    plt = pyplot()
    if plt is None:
        return None, NO_MATPLOTLIB
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, key, label in (
        (axes[0], "by_instances", "callee instances (1 caller process)"),
        (axes[1], "by_callers", f"caller processes ({doc['settings']['callers_instances']} inst.)"),
    ):
        points = doc[key]
        field = "instances" if key == "by_instances" else "callers"
        xs = [p[field] for p in points]
        ax.plot(xs, [p["calls_per_sec"] for p in points], "o-", color="tab:blue", label="calls/s")
        ax.set_xscale("log")
        ax.minorticks_off()
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel(label)
        ax.set_ylabel("calls/s", color="tab:blue")
        ax.set_ylim(bottom=0)
        lat = ax.twinx()
        for q, style in (("p50", "s--"), ("p99", "^:")):
            values = [p["latency_ms"][q] for p in points]
            lat.plot(xs, values, style, color="tab:red", label=f"{q} latency")
        lat.set_ylabel("latency, ms", color="tab:red")
        lat.set_ylim(bottom=0)
        handles = ax.get_legend_handles_labels()[0] + lat.get_legend_handles_labels()[0]
        ax.legend(handles, [h.get_label() for h in handles], loc="upper left", fontsize=8)
    fig.suptitle(
        f"Agent-Reach growth: {doc['settings']['in_flight']} calls in flight per caller,"
        f" {doc['machine']['cpus_usable']} CPUs"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path, ""


def _counts(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 1,2,5, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError("every count must be >= 1")
    return values


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, Settings]:
    parser = argparse.ArgumentParser(
        prog="python -m bench.growth",
        description="Calls/s and latency as callee instances and caller processes grow.",
    )
    parser.add_argument("--quick", action="store_true", help="two points per curve, 1 s each")
    parser.add_argument("--instances", type=_counts, default=None, help="1,2,5,10,25,50,100")
    parser.add_argument("--callers", type=_counts, default=None, help="1,2,5,10,20")
    parser.add_argument(
        "--callers-instances", type=int, default=None, help="instances for the callers curve (10)"
    )
    parser.add_argument("--in-flight", type=int, default=None, help="per caller process (16)")
    parser.add_argument("--duration", type=float, default=None, help="seconds per point (3)")
    parser.add_argument("--warmup", type=float, default=None, help="seconds before each (1)")
    parser.add_argument("--no-chart", action="store_true", help="do not write the PNG chart")
    parser.add_argument("--out", type=Path, default=_DEFAULT_OUT, help="JSON results file")
    args = parser.parse_args(argv)
    base = QUICK if args.quick else DEFAULT
    overrides = {
        "instances": args.instances,
        "callers": args.callers,
        "callers_instances": args.callers_instances,
        "in_flight": args.in_flight,
        "duration_sec": args.duration,
        "warmup_sec": args.warmup,
    }
    settings = dataclasses.replace(base, **{k: v for k, v in overrides.items() if v is not None})
    if settings.in_flight < 1 or settings.callers_instances < 1 or settings.duration_sec <= 0:
        parser.error("--in-flight and --callers-instances must be >= 1 and --duration > 0")
    if settings.warmup_sec < 0:
        parser.error("--warmup must be >= 0")
    return args, settings


def main(argv: Sequence[str] | None = None) -> int:
    require_fresh_build()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["caller"]:
        asyncio.run(_serve_caller(argv[1], argv[2]))
        return 0
    args, settings = parse_args(argv)

    def progress(line: str) -> None:
        print(f"[growth] {line}", file=sys.stderr, flush=True)

    doc = asyncio.run(run_growth(settings, progress))
    doc["command"] = " ".join(["python -m bench.growth", *argv])
    out: Path = args.out
    chart: Path | None = None
    if args.no_chart:
        note = "chart not requested (--no-chart)"
    else:
        chart, note = write_chart(doc, out.with_suffix(".png"))
    doc["chart"] = str(chart) if chart is not None else None
    if note:
        doc["chart_note"] = note
    write_json(doc, out)
    print(format_tables(doc))
    print(f"\nJSON: {out}" + (f"\nchart: {chart}" if chart else "") + (f"\n{note}" if note else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
