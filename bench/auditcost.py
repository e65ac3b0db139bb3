"""What auditing costs a caller's process per call, measured directly.

    python -m bench.auditcost [--calls 200000] [--runs 3]

Records ``--calls`` plain calls' audit events through a real ``CallRecorder`` and
``AuditWriter`` on a throwaway nats-server (JetStream on), yielding to the event loop
every thousand calls as a busy caller does, until the stream has acked every batch; and
reports the process CPU time per call (recording it, encoding the batches, publishing
them and reading the acks), the garbage collections per thousand calls in the timed
runs, and what one recorded call holds on to until its batch is sent: memory blocks,
and objects the garbage collector tracks (``sys.getallocatedblocks`` and
``gc.get_count`` over calls recorded without a batch sealed). The call-path benchmark's
``reach-noaudit`` variant measures the same cost from the outside, as a share of calls/s
and of CPU per call, where the noise of a small shared machine is several points per
repetition; this measures it from the inside, where it is a few percent of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import sys
import time
import uuid
from collections.abc import Sequence
from typing import cast

from reach.audit.events import attempt
from reach.audit.recording import CallRecorder, CallTrail
from reach.audit.streams import ensure_streams
from reach.audit.writer import AuditWriter, WriterConfig
from reach.caller.routing import RouteEntry
from reach.clock import SystemClock
from reach.telemetry import Telemetry, new_traceparent
from reach.testing import NatsServer
from reach.transport import Connection, connect
from reach.wire.envelope import RequestMeta


def _names(
    capability: str, tags: tuple[str, ...], candidates: Sequence[RouteEntry]
) -> tuple[str, ...]:
    return ("echo-1", "echo-2")


class _Collections:
    """Garbage collections while it is entered, of any generation."""

    def __init__(self) -> None:
        self.count = 0

    def _seen(self, phase: str, _info: dict[str, int]) -> None:
        if phase == "start":
            self.count += 1

    def __enter__(self) -> _Collections:
        gc.callbacks.append(self._seen)
        return self

    def __exit__(self, *_exc: object) -> None:
        gc.callbacks.remove(self._seen)


def held_per_call(calls: int = 2000) -> tuple[float, float]:
    """Memory blocks and GC-tracked objects one recorded plain call holds on to while
    its batch fills (a writer that is never started: nothing is sealed or sent)."""
    writer = AuditWriter(cast(Connection, None), WriterConfig(spool="off"))
    recorder = CallRecorder(Telemetry(), SystemClock(), _names)
    recorder.caller = "bench-client"
    recorder.audit = writer
    metas = [RequestMeta(f"held-{i:x}", traceparent=new_traceparent()) for i in range(calls)]
    trails = [CallTrail("echo", 1.0 + i, ()) for i in range(calls)]
    route = (attempt(agent_id="echo-1", score=0.5, latency_ms=0.3),)
    for trail in trails:
        trail.last_target = "echo-1"
    recorder.served(trails[0], metas[0], 0.4, route)  # the batch and its tables exist
    gc.collect()
    gc.disable()
    try:
        blocks, tracked = sys.getallocatedblocks(), gc.get_count()[0]
        for trail, meta in zip(trails[1:], metas[1:], strict=True):
            recorder.served(trail, meta, 0.4, route)
        blocks, tracked = sys.getallocatedblocks() - blocks, gc.get_count()[0] - tracked
    finally:
        gc.enable()
    return blocks / (calls - 1), tracked / (calls - 1)


async def measure(url: str, calls: int) -> tuple[float, float]:
    """Process CPU seconds per call of recording ``calls`` plain calls until acked, and
    garbage collections per thousand calls meanwhile."""
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
        with _Collections() as collections:
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
        return spent / calls, collections.count * 1000 / calls
    finally:
        await conn.close()


async def run(calls: int, runs: int) -> list[tuple[float, float]]:
    async with NatsServer() as server:
        return [await measure(server.url, calls) for _ in range(runs)]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.auditcost", description=__doc__)
    parser.add_argument("--calls", type=int, default=200_000, help="calls per run")
    parser.add_argument("--runs", type=int, default=3, help="runs (the median is reported)")
    args = parser.parse_args(argv)
    measured = asyncio.run(run(args.calls, args.runs))
    per_call = [cpu for cpu, _ in measured]
    shown = ", ".join(f"{x * 1e6:.2f}" for x in per_call)
    print(
        f"audit, caller's process CPU per call: {statistics.median(per_call) * 1e6:.2f} µs"
        f" (median of {len(per_call)} runs of {args.calls:,} calls: {shown})"
    )
    collections = statistics.median(c for _, c in measured)
    blocks, tracked = held_per_call()
    print(
        f"garbage collections per 1,000 calls: {collections:.2f}; held per call while its"
        f" batch fills: {blocks:.2f} memory blocks, {tracked:.2f} GC-tracked objects"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
