"""What `reach console` costs while it follows a busy fabric.

    python -m bench.console [--instances 1000] [--rate 2000] [--seconds 20] [--quick]

On a throwaway nats-server (JetStream on): ``--instances`` registry records (a capability
per ten instances), and audit events of ``--rate`` calls/s spread over them, written as
callers write them (``CallRecorder`` and ``AuditWriter``); a `reach console` process reads
that fabric. Its CPU (from /proc) is measured over ``--seconds`` twice: with nobody
looking, and with two pages open live (the agents page and a capability's page, each a
server-sent-events feed read to the end). The target is under 10 % of a core at 1,000
instances and 2,000 calls/s. Writes bench/results/console.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import nats

from bench.callpath import server_version
from bench.procs import cpu_seconds
from bench.report import machine_info, write_json
from reach.audit.events import attempt
from reach.audit.recording import CallRecorder, CallTrail
from reach.audit.streams import ensure_streams
from reach.audit.writer import AuditWriter
from reach.caller.routing import RouteEntry
from reach.clock import SystemClock
from reach.fabric.embedded import free_port
from reach.registry.store import RegistryStore
from reach.telemetry import Telemetry, new_traceparent
from reach.testing import NatsServer
from reach.transport import Connection, connect
from reach.wire import subjects
from reach.wire.envelope import RequestMeta
from reach.wire.models import Instance, Manifest

_OUT = Path(__file__).resolve().parent / "results" / "console.json"
_ROOT = Path(__file__).resolve().parent.parent
#: the target of the issue: a share of one core
TARGET = 0.10


def _record(i: int, now: float) -> Instance:
    manifest = Manifest.model_validate(
        {
            "agent_id": f"bench-{i}",
            "agent_name": "bench",
            "version": "1.2.3",
            "max_concurrency": 16,
            "capabilities": [
                {
                    "name": f"cap{i // 10}",
                    "description": "a capability of the console benchmark",
                    "tags": [f"region-{i % 4}"],
                    "latency_sla_ms": 200,
                }
            ],
            # long: the records stay as written for the whole run
            "health": {"interval_sec": 3600, "timeout_sec": 3, "failures_before_unhealthy": 2},
        }
    )
    return Instance(
        manifest=manifest,
        instance_id=secrets.token_hex(8),
        registered_at=now,
        last_heartbeat_at=now,
        in_flight=i % 5,
        max_concurrency=16,
    )


async def _populate(conn: Connection, instances: int) -> None:
    store = await RegistryStore.open(conn)
    now = time.time()
    for start in range(0, instances, 256):
        batch = [_record(i, now) for i in range(start, min(instances, start + 256))]
        await asyncio.gather(*(store.create(r) for r in batch))


def _names(
    capability: str, tags: tuple[str, ...], candidates: Sequence[RouteEntry]
) -> tuple[str, ...]:
    return ()


async def _calls(
    conn: Connection, url: str, instances: int, rate: float
) -> AsyncGenerator[int, None]:
    """Audit events of ``rate`` calls/s, as callers record them; yields the count so far
    every second (the generator's own pace is checked against the wall clock)."""
    writer = AuditWriter(conn, servers=[url])
    await writer.start()
    recorder = CallRecorder(Telemetry(), SystemClock(), _names)
    recorder.caller = "bench-caller"
    recorder.audit = writer
    prefix = uuid.uuid4().hex[:12]
    sent = 0
    started = time.monotonic()
    try:
        while True:
            due = int((time.monotonic() - started) * rate)
            for n in range(sent, due):
                i = n % instances
                agent = f"bench-{i}"
                trail = CallTrail(f"cap{i // 10}", time.time(), ())
                trail.last_target = agent
                meta = RequestMeta(f"{prefix}-{n:x}", traceparent=new_traceparent())
                latency = 1.0 + (n % 50) / 10
                recorder.served(
                    trail, meta, latency, (attempt(agent_id=agent, score=0.8, latency_ms=latency),)
                )
            sent = max(sent, due)
            yield sent
            await asyncio.sleep(0.01)
    finally:
        await writer.stop()


async def _follow(base: str, path: str) -> None:
    async with (
        httpx.AsyncClient(base_url=base, timeout=None) as http,
        http.stream("GET", path) as feed,
    ):
        async for _ in feed.aiter_bytes():
            pass


async def _stored(js: Any) -> int:
    """Messages in the audit stream so far: batches written, one per message."""
    return int((await js.stream_info(subjects.AUDIT_STREAM)).state.messages)


async def _phase(pid: int, seconds: float, load: AsyncIterator[int], js: Any) -> dict[str, float]:
    cpu0, wall0, stored0 = cpu_seconds(pid), time.monotonic(), await _stored(js)
    first = last = await anext(load)
    while time.monotonic() - wall0 < seconds:
        last = await anext(load)
    cpu1, wall, stored1 = cpu_seconds(pid), time.monotonic() - wall0, await _stored(js)
    if cpu0 is None or cpu1 is None:
        raise SystemExit("the console process is gone")
    return {
        "cpu_share": round((cpu1 - cpu0) / wall, 4),
        "calls_per_sec": round((last - first) / wall, 1),
        # what a reader pays for: a price per message, whatever the calls it holds
        "batches_per_sec": round((stored1 - stored0) / wall, 1),
    }


async def run(instances: int, rate: float, seconds: float) -> dict[str, Any]:
    async with NatsServer() as server:
        version = server_version(server.url)
        conn = await connect([server.url], name="bench-console")
        nc = await nats.connect(server.url, name="bench-console-stream-info")
        await ensure_streams(conn)
        await _populate(conn, instances)
        port = free_port()
        env = {**os.environ, "PYTHONPATH": str(_ROOT)}
        env.pop("REACH_CREDS", None)
        proc = subprocess.Popen(  # noqa: ASYNC220 - fork+exec, returns at once
            [
                sys.executable,
                "-m",
                "reach",
                "console",
                "--port",
                str(port),
                "--servers",
                server.url,
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        base = f"http://127.0.0.1:{port}"
        load = _calls(conn, server.url, instances, rate)
        feeds: list[asyncio.Task[None]] = []
        try:
            async with httpx.AsyncClient(base_url=base, timeout=30) as http:
                deadline = time.monotonic() + 60
                while True:
                    with contextlib.suppress(httpx.TransportError):
                        page = await http.get("/agents")
                        if f"{instances} of {instances} instance(s)" in page.text:
                            break
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise SystemExit(
                            f"reach console did not show the fabric: {proc.communicate()[1]!r}"
                        )
                    await asyncio.sleep(0.5)
            js = nc.jetstream()
            await _phase(proc.pid, 5, load, js)  # the console's window fills, the writer settles
            idle = await _phase(proc.pid, seconds, load, js)
            feeds = [
                asyncio.create_task(_follow(base, "/live/agents")),
                asyncio.create_task(_follow(base, "/live/capability?name=cap0")),
            ]
            watched = await _phase(proc.pid, seconds, load, js)
        finally:
            for task in feeds:
                task.cancel()
            await load.aclose()
            proc.terminate()
            proc.communicate(timeout=20)
            await nc.close()
            await conn.close()
    return {
        "server": version,
        "instances": instances,
        "rate": rate,
        "seconds": seconds,
        "idle": idle,
        "watched": watched,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.console", description=__doc__)
    parser.add_argument("--instances", type=int, default=1000)
    parser.add_argument("--rate", type=float, default=2000.0, help="calls per second")
    parser.add_argument("--seconds", type=float, default=20.0, help="per measurement")
    parser.add_argument("--quick", action="store_true", help="100 instances, 200 calls/s, 5 s")
    parser.add_argument("--out", type=Path, default=_OUT)
    args = parser.parse_args(argv)
    if args.quick:
        args.instances, args.rate, args.seconds = 100, 200.0, 5.0
    result = asyncio.run(run(args.instances, args.rate, args.seconds))
    doc = {"machine": machine_info(result.pop("server")), "target_cpu_share": TARGET, **result}
    write_json(doc, args.out)
    for phase in ("idle", "watched"):
        got = result[phase]
        print(
            f"{phase:>8}: console CPU {got['cpu_share']:.1%} of a core at"
            f" {args.instances} instances, {got['calls_per_sec']:.0f} calls/s"
            f" in {got['batches_per_sec']:.0f} batches/s"
            f" (target < {TARGET:.0%})"
        )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
