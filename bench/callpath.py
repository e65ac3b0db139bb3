"""The call-path benchmark: one echo of a ~200-byte msgpack payload, stack by stack.

For every stack a responder runs in its own OS process and the caller in this one. After a
warm-up, each repetition measures, for every stack in turn, sequential latency and then
throughput at each number of calls in flight; stacks are interleaved block by block, in
an order that changes from one repetition to the next so that every stack runs right
after every other one equally often (``balanced_orders``), and the noise of a shared
machine falls on all stacks alike. CPU time of the caller, the responder and nats-server
is recorded with every block: CPU per call is much steadier than wall time.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import secrets
import shutil
import socket
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from bench.payload import PAYLOAD
from bench.procs import Child, cpu_seconds, log_dir
from bench.stacks import Call, Context, Stack

__all__ = [
    "DEFAULT",
    "QUICK",
    "CallpathResult",
    "Cpu",
    "LatencyRun",
    "Settings",
    "StackRuns",
    "Testbed",
    "ThroughputRun",
    "launch",
    "measure_sequential",
    "measure_throughput",
    "run_callpath",
    "warm_up",
]

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Settings:
    reps: int = 5
    #: sequential calls per repetition (latency percentiles)
    seq_calls: int = 2000
    #: seconds of each throughput block
    duration_sec: float = 2.0
    concurrency: tuple[int, ...] = (1, 16, 128)
    #: once per stack before the first repetition: sequential calls, then a burst
    warmup_calls: int = 500
    warmup_sec: float = 1.0
    #: before every block: a few calls, so that switching stacks starts warm
    block_warmup_calls: int = 20


DEFAULT = Settings()
QUICK = Settings(
    reps=1, seq_calls=200, duration_sec=0.25, warmup_calls=100, warmup_sec=0.2, block_warmup_calls=5
)


@dataclass
class Cpu:
    """CPU seconds used during a block by each process on the call path."""

    caller_sec: float
    responder_sec: float | None
    server_sec: float | None
    #: the registrar (Agent-Reach stacks: it reads the audit stream for the alert rules);
    #: None when no stack needs one or its CPU is unknown
    registrar_sec: float | None = None


@dataclass
class LatencyRun:
    rep: int
    latencies_ms: list[float]
    errors: int
    first_error: str | None
    cpu: Cpu


@dataclass
class ThroughputRun:
    rep: int
    concurrency: int
    calls: int
    errors: int
    seconds: float
    first_error: str | None
    cpu: Cpu

    @property
    def calls_per_sec(self) -> float:
        return self.calls / self.seconds if self.seconds > 0 else 0.0


@dataclass
class StackRuns:
    sequential: list[LatencyRun] = field(default_factory=list)
    throughput: dict[int, list[ThroughputRun]] = field(default_factory=dict)


@dataclass
class CallpathResult:
    settings: Settings
    stacks: list[Stack]
    runs: dict[str, StackRuns]
    server_url: str
    server_version: str
    run_id: str
    wall_sec: float


# -- measuring -------------------------------------------------------------------------


class _Meter:
    """CPU time of the caller (this process), a responder, the server and the registrar
    between two reads."""

    def __init__(self, responder: Child, server_pid: int | None, registrar: Child | None) -> None:
        self._responder = responder
        self._server_pid = server_pid
        self._registrar = registrar
        self._start: tuple[float, float | None, float | None, float | None] = (
            0.0,
            None,
            None,
            None,
        )

    def _read(self) -> tuple[float, float | None, float | None, float | None]:
        return (
            time.process_time(),
            self._responder.cpu_seconds(),
            cpu_seconds(self._server_pid),
            self._registrar.cpu_seconds() if self._registrar is not None else None,
        )

    def start(self) -> None:
        self._start = self._read()

    def stop(self) -> Cpu:
        end = self._read()

        def delta(a: float | None, b: float | None) -> float | None:
            return None if a is None or b is None else round(b - a, 4)

        return Cpu(
            caller_sec=round(end[0] - self._start[0], 4),
            responder_sec=delta(self._start[1], end[1]),
            server_sec=delta(self._start[2], end[2]),
            registrar_sec=delta(self._start[3], end[3]),
        )


async def measure_sequential(call: Call, count: int) -> tuple[list[float], int, str | None]:
    """Latency in ms of ``count`` calls one after the other (failed calls only counted)."""
    latencies: list[float] = []
    errors = 0
    first_error: str | None = None
    clock = time.perf_counter_ns
    for _ in range(count):
        started = clock()
        try:
            await call(PAYLOAD)
        except Exception as exc:
            errors += 1
            first_error = first_error or f"{type(exc).__name__}: {exc}"
            continue
        latencies.append(round((clock() - started) / 1e6, 4))
    return latencies, errors, first_error


async def measure_throughput(
    call: Call, concurrency: int, duration: float
) -> tuple[int, int, float, str | None]:
    """Calls completed by ``concurrency`` workers calling back to back for ``duration``."""
    done = 0
    errors = 0
    first_error: str | None = None
    stop_at = time.perf_counter() + duration

    async def worker() -> None:
        nonlocal done, errors, first_error
        while time.perf_counter() < stop_at:
            try:
                await call(PAYLOAD)
            except Exception as exc:
                errors += 1
                first_error = first_error or f"{type(exc).__name__}: {exc}"
            else:
                done += 1

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done, errors, time.perf_counter() - started, first_error


# -- the test bed: server, registrar, responders, callers -------------------------------


@dataclass
class Live:
    """A stack ready to measure: its responder process, the caller's ``call``, and what
    is entered around each of its blocks (a variant's switch)."""

    stack: Stack
    responder: Child
    call: Call
    context: Context


@dataclass
class Testbed:
    url: str
    server_pid: int | None
    run_id: str
    live: list[Live]
    registrar: Child | None = None


def check_variants(stacks: Sequence[Stack]) -> None:
    """ValueError unless every variant comes after the stack whose processes it uses."""
    seen: set[str] = set()
    for s in stacks:
        if s.variant_of is not None and s.variant_of not in seen:
            raise ValueError(
                f"{s.name} runs on the processes of {s.variant_of}: list {s.variant_of}"
                f" before it (--stacks {s.variant_of},{s.name})"
            )
        seen.add(s.name)


@asynccontextmanager
async def launch(
    stacks: Sequence[Stack],
    servers: str | None,
    progress: Progress,
    profile_dir: Path | None = None,
) -> AsyncIterator[Testbed]:
    """Everything the stacks need, started in order and stopped in reverse.

    Child logs and the server's store live in a temporary directory, removed after a
    clean run and kept (and named) after a failed one.
    """
    check_variants(stacks)
    run_id = secrets.token_hex(3)
    logs = log_dir()
    try:
        async with AsyncExitStack() as stack:
            url, server_pid = await _start_server(stack, servers, logs, progress)
            registrar: Child | None = None
            if any(s.needs_registry for s in stacks):
                registrar = await Child.start("registrar", ["registrar", url, str(logs)], logs)
                stack.push_async_callback(registrar.stop)
                # tokens on, as with `reach up`: responders (children) and callers use these
                stack.callback(_restore_env, "REACH_CREDS", os.environ.get("REACH_CREDS"))
                os.environ["REACH_CREDS"] = str(logs / "bench.creds")
            own = [s for s in stacks if s.variant_of is None]
            progress(f"starting {len(own)} responder processes")

            async def start_responder(s: Stack) -> Child:
                args = ["responder", s.name, url, run_id]
                if profile_dir is not None:
                    args += ["--profile", str(profile_dir / f"hotspots-{s.name}-responder.txt")]
                return await Child.start(f"responder-{s.name}", args, logs)

            started = await asyncio.gather(
                *(start_responder(s) for s in own), return_exceptions=True
            )
            for child in started:
                if isinstance(child, Child):
                    stack.push_async_callback(child.stop)
            responders: dict[str, Child] = {}
            for s, child in zip(own, started, strict=True):
                if isinstance(child, BaseException):
                    raise child
                responders[s.name] = child
            live = []
            for s in stacks:  # a variant's base comes first (check_variants)
                ctx = Context(url, run_id, s.variant_of or s.name)
                call = await stack.enter_async_context(s.caller(ctx))
                live.append(Live(s, responders[ctx.stack], call, ctx))
            yield Testbed(url, server_pid, run_id, live, registrar)
    except BaseException:
        progress(f"failed; logs of the child processes are in {logs}")
        raise
    shutil.rmtree(logs, ignore_errors=True)


def _restore_env(name: str, value: str | None) -> None:
    """Put an environment variable back as it was (unset if it was)."""
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


async def _start_server(
    stack: AsyncExitStack, servers: str | None, logs: Path, progress: Progress
) -> tuple[str, int | None]:
    """The NATS URL to use and the server's pid (None for a server we did not start)."""
    if servers is not None:
        return servers, None
    from reach.testing import NatsServer

    server = NatsServer(store_dir=logs / "nats")
    await server.start()
    stack.push_async_callback(server.stop)
    progress(f"nats-server {server.url} (pid {server.pid})")
    return server.url, server.pid


async def warm_up(live: Live, settings: Settings, progress: Progress) -> None:
    reply = await live.call(PAYLOAD)
    if reply != PAYLOAD:
        raise RuntimeError(f"{live.stack.name} does not echo the payload: got {reply!r}")
    _, errors, first_error = await measure_sequential(live.call, settings.warmup_calls)
    burst = max(settings.concurrency)
    _, burst_errors, _, burst_error = await measure_throughput(
        live.call, burst, settings.warmup_sec
    )
    if errors or burst_errors:
        progress(
            f"warm-up of {live.stack.name}: {errors + burst_errors} errors, first: "
            f"{first_error or burst_error}"
        )


def server_version(url: str) -> str:
    """The version the server announces in its INFO line."""
    parts = urlsplit(url.split(",")[0])
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 4222), 5) as s:
            line = s.makefile("rb").readline()
        info: dict[str, Any] = json.loads(line.split(b" ", 1)[1])
        return str(info.get("version", "unknown"))
    except (OSError, ValueError, IndexError):
        return "unknown"


def balanced_orders(n: int) -> list[list[int]]:
    """Orders in which to run ``n`` stacks, one per repetition (then again from the
    first): over all of them, every stack runs first equally often and right after every
    other one equally often (a Williams design: ``n`` orders for an even ``n``, ``2 n``
    for an odd one).

    A block inherits something from the one before it (what that left in the caches, a
    responder process that sat idle while another stack ran, a batch still being
    written). Rotating one order does not spread that: each stack then always follows the
    same one (in a run of raw, reach and reach-noaudit, reach always followed raw), and a
    run of two identical variants measured them 1.5 points of calls/s apart.
    """
    if n < 1:
        return [[]]
    first = [0]  # 0, 1, n-1, 2, n-2, ...: the steps between neighbours are all different
    low, high = 1, n - 1
    while len(first) < n:
        first.append(low)
        low += 1
        if len(first) < n:
            first.append(high)
            high -= 1
    orders = [[(i + shift) % n for i in first] for shift in range(n)]
    if n % 2:
        orders += [order[::-1] for order in orders]
    return orders


async def run_callpath(
    settings: Settings,
    stacks: Sequence[Stack],
    servers: str | None = None,
    progress: Progress = lambda _line: None,
) -> CallpathResult:
    began = time.perf_counter()
    runs = {s.name: StackRuns() for s in stacks}
    async with launch(stacks, servers, progress) as bed:
        version = await asyncio.to_thread(server_version, bed.url)
        for live in bed.live:
            progress(f"warming up {live.stack.name}")
            with live.stack.switch(live.context):
                await warm_up(live, settings, progress)
        orders = balanced_orders(len(bed.live))
        for rep in range(settings.reps):
            order = [bed.live[i] for i in orders[rep % len(orders)]]
            blocks: list[int | None] = [None, *settings.concurrency]
            for concurrency in blocks:
                for live in order:
                    await _block(live, bed, settings, rep, concurrency, runs, progress)
    return CallpathResult(
        settings=settings,
        stacks=list(stacks),
        runs=runs,
        server_url=bed.url,
        server_version=version,
        run_id=bed.run_id,
        wall_sec=round(time.perf_counter() - began, 2),
    )


async def _block(
    live: Live,
    bed: Testbed,
    settings: Settings,
    rep: int,
    concurrency: int | None,
    runs: dict[str, StackRuns],
    progress: Progress,
) -> None:
    """One measurement of one stack: sequential latency (concurrency None) or throughput,
    inside the stack's switch (a variant's feature off)."""
    name = live.stack.name
    with live.stack.switch(live.context):
        await measure_sequential(live.call, settings.block_warmup_calls)
        gc.collect()  # every block starts with the same (empty) garbage
        meter = _Meter(live.responder, bed.server_pid, bed.registrar)
        meter.start()
        if concurrency is None:
            latencies, errors, first_error = await measure_sequential(live.call, settings.seq_calls)
        else:
            calls, errors, seconds, first_error = await measure_throughput(
                live.call, concurrency, settings.duration_sec
            )
        cpu = meter.stop()
    if concurrency is None:
        runs[name].sequential.append(LatencyRun(rep, latencies, errors, first_error, cpu))
        ordered = sorted(latencies) or [0.0]
        progress(
            f"rep {rep + 1}/{settings.reps} sequential {name}:"
            f" p50 {ordered[len(ordered) // 2]:.3f} ms" + (f", {errors} errors" if errors else "")
        )
        return
    run = ThroughputRun(rep, concurrency, calls, errors, seconds, first_error, cpu)
    runs[name].throughput.setdefault(concurrency, []).append(run)
    progress(
        f"rep {rep + 1}/{settings.reps} {concurrency:>3} in flight {name}:"
        f" {run.calls_per_sec:,.0f} calls/s" + (f", {errors} errors" if errors else "")
    )
