"""What auditing costs a caller's process per call, measured directly.

    python -m bench.auditcost [--calls 200000] [--runs 3]

Records ``--calls`` plain calls' audit events through a real ``CallRecorder`` and
``AuditWriter`` on a throwaway nats-server (JetStream on), yielding to the event loop
every thousand calls as a busy caller does, until the stream has acked every batch; and
reports the process CPU time per call (building the event, the writer's ``record``,
encoding the batches, publishing them and reading the acks). The call-path benchmark's
``reach-noaudit`` variant measures the same cost from the outside, as a share of calls/s
and of CPU per call, where the noise of a small shared machine is several points per
repetition; this measures it from the inside, where it is a few percent of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid
from collections.abc import Sequence

from reach.audit.events import attempt
from reach.audit.recording import CallRecorder, CallTrail
from reach.audit.streams import ensure_streams
from reach.audit.writer import AuditWriter
from reach.clock import SystemClock
from reach.envelope import RequestMeta
from reach.routing import RouteEntry
from reach.telemetry import Telemetry, new_traceparent
from reach.testing import NatsServer
from reach.transport import connect


def _names(
    capability: str, tags: tuple[str, ...], candidates: Sequence[RouteEntry]
) -> tuple[str, ...]:
    return ("echo-1", "echo-2")


async def measure(url: str, calls: int) -> float:
    """Process CPU seconds per call of recording ``calls`` plain calls until acked."""
    conn = await connect([url], name="bench-auditcost")
    try:
        await ensure_streams(conn)
        writer = AuditWriter(conn, servers=[url])
        await writer.start()
        recorder = CallRecorder(Telemetry(), SystemClock(), _names)
        recorder.caller = "bench-client"
        recorder.audit = writer
        prefix = uuid.uuid4().hex[:16]
        metas = [
            RequestMeta(f"{prefix}-{i:x}", traceparent=new_traceparent()) for i in range(calls)
        ]
        route = (attempt(agent_id="echo-1", score=0.5, latency_ms=0.3),)
        started = time.process_time()
        for i, meta in enumerate(metas):
            trail = CallTrail("echo", time.time(), ())
            trail.last_target = "echo-1"
            recorder.served(trail, meta, 0.4, route)
            if i % 1000 == 999:
                await asyncio.sleep(0)
        await writer.flush()
        spent = time.process_time() - started
        await writer.stop()
        return spent / calls
    finally:
        await conn.close()


async def run(calls: int, runs: int) -> list[float]:
    async with NatsServer() as server:
        return [await measure(server.url, calls) for _ in range(runs)]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.auditcost", description=__doc__)
    parser.add_argument("--calls", type=int, default=200_000, help="calls per run")
    parser.add_argument("--runs", type=int, default=3, help="runs (the median is reported)")
    args = parser.parse_args(argv)
    per_call = asyncio.run(run(args.calls, args.runs))
    shown = ", ".join(f"{x * 1e6:.2f}" for x in per_call)
    print(
        f"audit, caller's process CPU per call: {statistics.median(per_call) * 1e6:.2f} µs"
        f" (median of {len(per_call)} runs of {args.calls:,} calls: {shown})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
