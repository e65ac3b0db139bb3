"""The gateways benchmark: what ``reach mcp`` and ``reach a2a`` add to a fabric call.

    python -m bench.gateways [--quick] [--repeats N] [--seq-calls N] [--duration S]
                             [--a2a-version 1.0|0.3] [--out FILE]

One echo capability (``echo``, an agent in its own process, no contracts) on a fabric
with tokens (a nats-server and a registrar process, as ``reach up`` runs them), called
the same ~200-byte object in one run by:

- ``direct``: ``ReachClient.call``, the baseline;
- ``mcp-stdio``: the official MCP SDK's ``Client`` launching ``reach mcp`` (stdio);
- ``mcp-http``: the MCP SDK's ``Client`` over streamable HTTP to ``reach mcp --http``;
- ``mcp-http-wire``: the same requests to the same gateway written by hand over
  kept-alive connections (no client library: the gateway's own share);
- ``a2a``: A2A ``SendMessage`` (1.0; ``--a2a-version 0.3``: ``message/send``) as a
  JSON-RPC POST with plain httpx to ``reach a2a``;
- ``a2a-wire``: the same by hand.

The HTTP callers log in when the gateway asks (``bench.gatewayclients``). Each
repetition measures every caller in turn (``balanced_orders``): ``--seq-calls`` calls one
after the other (median and p99), then ``--duration`` seconds with 16 calls in flight
(calls/s), with the CPU per call of this process (the caller), the gateway and the agent.
Figures are medians over repetitions with their range; the latency a gateway adds is
the difference of its median to the direct call's in the same repetition, and its ratio.
Writes bench/results/gateways.json and prints the table.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.callpath import balanced_orders, measure_sequential, measure_throughput, server_version
from bench.failover import echo_manifest, fabric, start_agents
from bench.gatewayclients import (
    LOGINS,
    TOOL,
    open_a2a,
    open_a2a_wire,
    open_direct,
    open_mcp_http,
    open_mcp_stdio,
    open_mcp_wire,
)
from bench.procs import cpu_seconds, descendants
from bench.report import _table, machine_info, percentile, require_fresh_build, spread, write_json
from bench.stacks import Call

__all__ = ["DEFAULT", "QUICK", "Settings", "main", "run_gateways"]

Progress = Callable[[str], None]

_OUT = Path(__file__).resolve().parent / "results" / "gateways.json"
#: the targets (issue 43): latency added at the median, in ms, and calls/s kept at 16 in
#: flight as a share of the direct call's
ADDED_MS_TARGET = {"mcp-stdio": 0.3, "mcp-http": 0.5, "a2a": 0.5}
THROUGHPUT_TARGET = 0.5
IN_FLIGHT = 16


@dataclass(frozen=True)
class Settings:
    repeats: int = 5
    #: sequential calls per caller and repetition
    seq_calls: int = 1000
    #: seconds of each caller's block at 16 calls in flight
    duration_sec: float = 2.0
    warmup_calls: int = 200
    a2a_version: str = "1.0"


DEFAULT = Settings()
QUICK = Settings(repeats=1, seq_calls=20, duration_sec=0.3, warmup_calls=5)


@dataclass(frozen=True)
class Caller:
    name: str
    description: str
    #: the gateway process whose CPU is counted ("" for none)
    gateway: str


CALLERS = (
    Caller("direct", "ReachClient.call", ""),
    Caller("mcp-stdio", "MCP SDK Client, stdio (launches `reach mcp`)", "mcp-stdio"),
    Caller("mcp-http", "MCP SDK Client, streamable HTTP", "mcp-http"),
    Caller("mcp-http-wire", "the same requests by hand, kept-alive HTTP/1.1", "mcp-http"),
    Caller("a2a", "A2A JSON-RPC POST, httpx", "a2a"),
    Caller("a2a-wire", "the same requests by hand, kept-alive HTTP/1.1", "a2a"),
)


@dataclass
class Block:
    """One caller's measurements in one repetition."""

    latencies_ms: list[float]
    seq_errors: int
    calls: int
    errors: int
    seconds: float
    #: CPU µs per call at 16 in flight: caller (this process), gateway, agent
    cpu_us: dict[str, float | None]
    first_error: str | None = None

    @property
    def calls_per_sec(self) -> float:
        return self.calls / self.seconds if self.seconds > 0 else 0.0


@dataclass
class Bed:
    """Everything running: the fabric's URL, the credentials, the processes by role."""

    url: str
    creds: Path
    gateway_creds: Path
    pids: dict[str, int | None] = field(default_factory=dict)
    calls: dict[str, Call] = field(default_factory=dict)
    #: by HTTP caller: whether its gateway asked it to log in
    logins: dict[str, bool] = field(default_factory=dict)


# -- the test bed ----------------------------------------------------------------------


def _env() -> dict[str, str]:
    root = str(Path(__file__).resolve().parent.parent)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}


def _gateway_creds(url: str, creds: Path, out: Path, progress: Progress) -> Path:
    """A credential for the HTTP gateways: level 4 with the gateway role, which logging
    callers in and calling as them needs. Where the role is unknown (gateways that log
    no caller in), the bench's own credential."""
    cmd = [sys.executable, "-m", "reach", "creds", "add", "bench-gateway", "--level", "4"]
    cmd += ["--role", "gateway", "--out", str(out), "--servers", url, "--creds", str(creds)]
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=60, check=False)
    if done.returncode == 0:
        return out
    if "'--role'" not in done.stderr:
        raise RuntimeError(f"reach creds add failed: {done.stderr.strip()}")
    progress("no gateway role here: the gateways run under the bench's own credential")
    return creds


@asynccontextmanager
async def _gateway(
    args: Sequence[str], url: str, creds: Path, stream: str
) -> AsyncIterator[tuple[str, int]]:
    """``reach ARGS`` serving HTTP: (the URL of the line it prints when up, its pid)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "reach", *args, "--servers", url, "--creds", str(creds),
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, env={**_env(), "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        out = proc.stdout if stream == "stdout" else proc.stderr
        assert out is not None
        line = (await asyncio.wait_for(out.readline(), 60)).decode()
        words = [w for w in line.split() if w.startswith("http://")]
        if not words:
            raise RuntimeError(f"reach {args[0]} did not start: {line!r}")
        yield words[0], proc.pid
    finally:
        if proc.returncode is None:
            proc.terminate()
        await asyncio.wait_for(proc.wait(), 30)


@asynccontextmanager
async def _stdio(bed: Bed) -> AsyncIterator[Call]:
    """The stdio gateway's caller; its process's pid noted as the SDK starts it."""
    before = set(descendants(os.getpid()))
    async with open_mcp_stdio(bed.url, bed.creds) as call:
        started = [p for p in descendants(os.getpid()) if p not in before]
        bed.pids["mcp-stdio"] = started[0] if len(started) == 1 else None
        yield call


@asynccontextmanager
async def testbed(settings: Settings, progress: Progress) -> AsyncIterator[Bed]:
    """Fabric, agent, gateways and every caller, ready to call."""
    async with fabric(progress) as fab, AsyncExitStack() as stack:
        creds = fab.logs / "bench.creds"
        gateway_creds = _gateway_creds(fab.url, creds, fab.logs / "gateway.creds", progress)
        bed = Bed(fab.url, creds, gateway_creds)
        agent = await start_agents("agent", fab.url, [echo_manifest("echo-1", TOOL)], fab.logs)
        stack.push_async_callback(agent.stop)
        bed.pids["agent"] = agent.pid
        mcp_url, bed.pids["mcp-http"] = await stack.enter_async_context(
            _gateway(["mcp", "--http", "0"], fab.url, bed.gateway_creds, "stderr")
        )
        a2a_base, bed.pids["a2a"] = await stack.enter_async_context(
            _gateway(["a2a", "--port", "0"], fab.url, bed.gateway_creds, "stdout")
        )
        agent_url = f"{a2a_base.rstrip('/')}/agents/bench_echo"
        version = settings.a2a_version
        opens: dict[str, AbstractAsyncContextManager[Call]] = {
            "direct": open_direct(fab.url),
            "mcp-stdio": _stdio(bed),
            "mcp-http": open_mcp_http(mcp_url, creds),
            "mcp-http-wire": open_mcp_wire(mcp_url, creds),
            "a2a": open_a2a(agent_url, creds, version),
            "a2a-wire": open_a2a_wire(agent_url, creds, version),
        }
        urls = {"mcp-http": mcp_url, "mcp-http-wire": mcp_url, "a2a": agent_url}
        urls["a2a-wire"] = agent_url
        for name, opening in opens.items():
            progress(f"opening {name}")
            bed.calls[name] = await stack.enter_async_context(opening)
            if name in urls:
                bed.logins[name] = LOGINS.get(urls[name], False)
        yield bed


# -- measuring -------------------------------------------------------------------------


def _cpu(bed: Bed, caller: Caller) -> tuple[float, float | None, float | None]:
    gateway = bed.pids.get(caller.gateway) if caller.gateway else None
    return time.process_time(), cpu_seconds(gateway), cpu_seconds(bed.pids.get("agent"))


async def _block(bed: Bed, caller: Caller, settings: Settings) -> Block:
    call = bed.calls[caller.name]
    latencies, seq_errors, seq_first = await measure_sequential(call, settings.seq_calls)
    before = _cpu(bed, caller)
    calls, errors, seconds, first = await measure_throughput(call, IN_FLIGHT, settings.duration_sec)
    after = _cpu(bed, caller)

    def per_call(i: int) -> float | None:
        a, b = before[i], after[i]
        return None if a is None or b is None or calls == 0 else round((b - a) / calls * 1e6, 1)

    cpu = {"caller": per_call(0), "gateway": per_call(1), "agent": per_call(2)}
    return Block(latencies, seq_errors, calls, errors, seconds, cpu, seq_first or first)


async def run_gateways(settings: Settings, progress: Progress) -> dict[str, Any]:
    began = time.perf_counter()
    runs: dict[str, list[Block]] = {c.name: [] for c in CALLERS}
    async with testbed(settings, progress) as bed:
        version = await asyncio.to_thread(server_version, bed.url)
        for caller in CALLERS:
            progress(f"warming up {caller.name}")
            _, errors, first = await measure_sequential(
                bed.calls[caller.name], settings.warmup_calls
            )
            if errors:
                raise RuntimeError(f"{caller.name}: {errors} warm-up calls failed: {first}")
        orders = balanced_orders(len(CALLERS))
        for rep in range(settings.repeats):
            for i in orders[rep % len(orders)]:
                caller = CALLERS[i]
                block = await _block(bed, caller, settings)
                runs[caller.name].append(block)
                progress(
                    f"rep {rep + 1}/{settings.repeats} {caller.name}: p50"
                    f" {percentile(block.latencies_ms, 0.5):.3f} ms,"
                    f" {block.calls_per_sec:,.0f} calls/s at {IN_FLIGHT}"
                )
    return {
        "server": version,
        "runs": runs,
        "logins": bed.logins,
        "wall_sec": round(time.perf_counter() - began, 1),
    }


# -- figures ---------------------------------------------------------------------------


def _p(block: Block, q: float) -> float | None:
    return percentile(block.latencies_ms, q) if block.latencies_ms else None


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def _over(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b <= 0 else a / b


def summarize(runs: dict[str, list[Block]]) -> dict[str, Any]:
    """Per caller, every figure as median and range over repetitions; what it adds to the
    direct call paired repetition by repetition (the callers of one repetition ran side
    by side)."""
    direct = runs["direct"]
    summary: dict[str, Any] = {}
    for caller in CALLERS:
        blocks = runs[caller.name]
        p50 = [_p(b, 0.5) for b in blocks]
        p99 = [_p(b, 0.99) for b in blocks]
        rate = [b.calls_per_sec for b in blocks]
        base50 = [_p(b, 0.5) for b in direct]
        base_rate = [b.calls_per_sec for b in direct]
        summary[caller.name] = {
            "description": caller.description,
            "p50_ms": spread(p50),
            "p99_ms": spread(p99),
            "calls_per_sec": spread(rate),
            "added_p50_ms": spread([_minus(a, b) for a, b in zip(p50, base50, strict=True)]),
            "ratio_p50": spread([_over(a, b) for a, b in zip(p50, base50, strict=True)]),
            "throughput_ratio": spread([_over(a, b) for a, b in zip(rate, base_rate, strict=True)]),
            "cpu_us_per_call": {
                role: spread([b.cpu_us[role] for b in blocks])
                for role in ("caller", "gateway", "agent")
            },
            "errors": sum(b.errors + b.seq_errors for b in blocks),
            "first_error": next((b.first_error for b in blocks if b.first_error), None),
        }
    return summary


def targets(summary: dict[str, Any]) -> dict[str, Any]:
    """Each gateway's targets and whether the median over repetitions meets them."""
    met: dict[str, Any] = {}
    for name, limit in ADDED_MS_TARGET.items():
        added = summary[name]["added_p50_ms"]["median"]
        kept = summary[name]["throughput_ratio"]["median"]
        met[name] = {
            "added_p50_ms": {"target": limit, "measured": added, "met": added <= limit},
            "throughput_ratio": {
                "target": THROUGHPUT_TARGET,
                "measured": kept,
                "met": kept >= THROUGHPUT_TARGET,
            },
        }
    return met


def _ms(s: dict[str, Any], digits: int = 2) -> str:
    if s.get("median") is None:
        return "n/a"
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}–{s['max']:.{digits}f})"


def format_table(doc: dict[str, Any]) -> str:
    summary, settings, machine = doc["summary"], doc["settings"], doc["machine"]
    rows = []
    for name, s in summary.items():
        cpu = s["cpu_us_per_call"]
        rows.append(
            [
                name,
                _ms(s["p50_ms"], 3),
                _ms(s["p99_ms"]),
                "" if name == "direct" else _ms(s["added_p50_ms"], 3),
                "" if name == "direct" else _ms(s["ratio_p50"], 1) + "×",
                f"{s['calls_per_sec']['median']:,.0f}",
                "" if name == "direct" else _ms(s["throughput_ratio"]) + "×",
                " + ".join(
                    "–" if cpu[r]["median"] is None else f"{cpu[r]['median']:.0f}"
                    for r in ("caller", "gateway", "agent")
                ),
                str(s["errors"]),
            ]
        )
    header = [
        "caller", "p50 ms", "p99 ms", "added p50 ms", "p50 ratio", f"calls/s @{IN_FLIGHT}",
        "× direct", "CPU µs/call (caller + gateway + agent)", "errors",
    ]  # fmt: skip
    lines = [
        f"Gateways: one echo, {settings['repeats']} interleaved repetitions of"
        f" {settings['seq_calls']} sequential calls and {settings['duration_sec']} s at"
        f" {IN_FLIGHT} in flight; median (min–max) over repetitions.",
        f"{machine['python']}, nats-server {machine['nats_server']}, {machine['cpus_usable']}"
        f" CPUs ({machine['cpu_model']}), commit {machine['git_commit']}.",
        _table("", header, rows).lstrip("\n"),
        "",
    ]
    for name, met in doc["targets"].items():
        added, kept = met["added_p50_ms"], met["throughput_ratio"]
        lines.append(
            f"{name}: adds {added['measured']:.3f} ms at p50 (target ≤ {added['target']}:"
            f" {'met' if added['met'] else 'not met'}), keeps {kept['measured']:.2f}× the direct"
            f" calls/s at {IN_FLIGHT} in flight (target ≥ {kept['target']}:"
            f" {'met' if kept['met'] else 'not met'})"
        )
    return "\n".join(lines)


def build_document(
    result: dict[str, Any], settings: Settings, argv: Sequence[str]
) -> dict[str, Any]:
    runs: dict[str, list[Block]] = result["runs"]
    summary = summarize(runs)
    return {
        "benchmark": "gateways",
        "format": 1,
        "timestamp": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(["python -m bench.gateways", *argv]),
        "machine": machine_info(result["server"]),
        "settings": {**dataclasses.asdict(settings), "in_flight": IN_FLIGHT},
        "wall_sec": result["wall_sec"],
        "callers": {c.name: c.description for c in CALLERS},
        # whether each HTTP caller's gateway asked it to log in (OAuth client credentials)
        "logged_in": result["logins"],
        "summary": summary,
        "targets": targets(summary),
        "samples": {name: [dataclasses.asdict(b) for b in blocks] for name, blocks in runs.items()},
    }


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, Settings]:
    parser = argparse.ArgumentParser(
        prog="python -m bench.gateways",
        description="What reach mcp (stdio, HTTP) and reach a2a add to a direct fabric call.",
    )
    parser.add_argument("--quick", action="store_true", help="1 repetition with tiny counts")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved repetitions (5)")
    parser.add_argument("--seq-calls", type=int, default=None, help="sequential calls (1000)")
    parser.add_argument(
        "--duration", type=float, default=None, help=f"seconds at {IN_FLIGHT} in flight (2)"
    )
    parser.add_argument("--warmup", type=int, default=None, help="warm-up calls per caller (200)")
    parser.add_argument(
        "--a2a-version",
        choices=["1.0", "0.3"],
        default=None,
        help="A2A's message method: SendMessage (1.0) or message/send (0.3)",
    )
    parser.add_argument("--out", type=Path, default=_OUT, help="JSON results file")
    args = parser.parse_args(argv)
    overrides = {
        "repeats": args.repeats,
        "seq_calls": args.seq_calls,
        "duration_sec": args.duration,
        "warmup_calls": args.warmup,
        "a2a_version": args.a2a_version,
    }
    base = QUICK if args.quick else DEFAULT
    settings = dataclasses.replace(base, **{k: v for k, v in overrides.items() if v is not None})
    if settings.repeats < 1 or settings.seq_calls < 2 or settings.duration_sec <= 0:
        parser.error("--repeats >= 1, --seq-calls >= 2 and --duration > 0")
    return args, settings


def main(argv: Sequence[str] | None = None) -> int:
    require_fresh_build()
    argv = list(sys.argv[1:] if argv is None else argv)
    args, settings = parse_args(argv)

    def progress(line: str) -> None:
        print(f"[gateways] {line}", file=sys.stderr, flush=True)

    result = asyncio.run(run_gateways(settings, progress))
    doc = build_document(result, settings, argv)
    write_json(doc, args.out)
    print(format_table(doc))
    print(f"\nJSON: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
