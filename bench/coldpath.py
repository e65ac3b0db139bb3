"""``python -m bench.coldpath [--quick] [--gap-ms 0.5] [--samples N] [--out FILE]``: what
the call path's pieces cost warm, and what they cost after the process idled.

A sequential caller and its callee idle between calls (about half a millisecond here,
while the request and the reply cross the server). On a virtual machine the CPU loses
much of its cache state while it idles, so every piece of the path runs colder than in
a loop. Each piece below is timed back to back ("warm") and after a sleep of
``--gap-ms`` before each sample ("after an idle gap"), in one process with nothing else
running, and the ratio says how much an idle gap multiplies it. A fixed pure-Python loop
is the control: it touches no data, so what it loses is the code's cache and the
CPU's own state.

This is why the sequential latency ratio to raw nats-py is larger than the CPU ratio at
load: the microseconds Agent-Reach adds per call are paid several times over at one
call in flight. Read it with ``python -m bench`` (docs/benchmarks.md, "Call path").
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

from bench.payload import PAYLOAD, PAYLOAD_SCHEMA
from bench.report import machine_info, percentile, require_fresh_build, write_json
from reach.agent.serving import CallServer, endpoint_for
from reach.clock import system_clock
from reach.wire import codec, envelope
from reach.wire.contract import compile_schema
from reach.wire.models import Capability

__all__ = ["DEFAULT", "QUICK", "Settings", "main", "measure"]

_DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "coldpath.json"


@dataclass(frozen=True)
class Settings:
    samples: int = 2000
    gap_ms: float = 0.5


DEFAULT = Settings()
QUICK = Settings(samples=50)


def _control(n: int = 60) -> int:
    total = 0
    for i in range(n):
        total += i * i
    return total


def _callee_handle() -> Callable[[], Any]:
    """One call served end to end by a ``CallServer`` (contracts on, no token, no
    deadline): its coroutine runs to the end in one step, as an eager call does."""
    capability = Capability.model_validate(
        {"name": "echo", "input_schema": PAYLOAD_SCHEMA, "output_schema": PAYLOAD_SCHEMA}
    )

    async def echo(req: dict[str, Any]) -> dict[str, Any]:
        return req

    endpoint = endpoint_for(capability, echo)
    server = CallServer(
        "bench-echo", max_concurrency=1024, clock=system_clock, is_ready=lambda: (True, "")
    )
    body = codec.encode(PAYLOAD)
    seq = [0]

    def serve() -> bytes:
        seq[0] += 1
        meta = envelope.RequestMeta(call_id=f"cold-{seq[0]:x}")
        step = server.handle(endpoint, envelope.pack_request(meta, body))
        try:
            step.send(None)
        except StopIteration as done:
            reply: bytes = done.value
            return reply
        step.close()
        raise RuntimeError("the echo call waited: it should finish in one step")

    return serve


def pieces() -> dict[str, Callable[[], Any]]:
    validator = compile_schema(PAYLOAD_SCHEMA)
    packed = codec.encode(PAYLOAD)
    return {
        "control: a fixed pure-Python loop": _control,
        "msgpack.packb of the payload (raw's encode)": lambda: msgpack.packb(
            PAYLOAD, use_bin_type=True
        ),
        "contract check (jsonschema-rs)": lambda: validator.validate(PAYLOAD, plain=True),
        "codec walk (check_value)": lambda: codec.check_value(PAYLOAD),
        "encode the payload": lambda: codec.encode(PAYLOAD, checked=False, plain=True),
        "decode the payload (checked)": lambda: codec.decode(packed),
        "callee: one call served (CallServer.handle)": _callee_handle(),
    }


def _time(fn: Callable[[], Any], samples: int, gap_sec: float | None) -> list[float]:
    """µs per run of ``fn``; with ``gap_sec``, a sleep before each run."""
    out: list[float] = []
    clock = time.perf_counter_ns
    for _ in range(samples):
        if gap_sec is not None:
            time.sleep(gap_sec)
        started = clock()
        fn()
        out.append((clock() - started) / 1000)
    return out


def _summary(values: Sequence[float]) -> dict[str, float]:
    return {
        "median": round(statistics.median(values), 2),
        "p90": round(percentile(values, 0.90), 2),
        "count": len(values),
    }


def measure(settings: Settings) -> dict[str, Any]:
    gap = settings.gap_ms / 1000
    results: dict[str, Any] = {}
    for name, fn in pieces().items():
        for _ in range(20):  # first runs: imports, caches, the schema's compilation
            fn()
        # warm and idle samples taken in turn, so both see the same minutes of the machine
        warm: list[float] = []
        idle: list[float] = []
        for _ in range(10):
            warm += _time(fn, max(1, settings.samples // 10), None)
            idle += _time(fn, max(1, settings.samples // 10), gap)
        w, i = _summary(warm), _summary(idle)
        results[name] = {
            "warm_us": w,
            "after_gap_us": i,
            "ratio": round(i["median"] / w["median"], 1) if w["median"] else None,
        }
    return results


def format_table(results: dict[str, Any], settings: Settings) -> str:
    width = max(len(name) for name in results)
    gap = f"after {settings.gap_ms:g} ms idle"
    lines = [
        f"{'piece':<{width}}  {'warm µs':>9}  {gap:>18}  {'ratio':>6}",
        "-" * (width + 41),
    ]
    for name, row in results.items():
        lines.append(
            f"{name:<{width}}  {row['warm_us']['median']:>9.2f}"
            f"  {row['after_gap_us']['median']:>18.2f}  {row['ratio']:>5}×"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.coldpath", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="few samples (a smoke run)")
    parser.add_argument("--samples", type=int, help=f"samples per piece ({DEFAULT.samples})")
    parser.add_argument("--gap-ms", type=float, help=f"idle gap, ms ({DEFAULT.gap_ms})")
    parser.add_argument("--out", type=Path, default=_DEFAULT_OUT, help="JSON results file")
    args = parser.parse_args(argv)
    require_fresh_build()
    base = QUICK if args.quick else DEFAULT
    settings = Settings(
        samples=args.samples if args.samples is not None else base.samples,
        gap_ms=args.gap_ms if args.gap_ms is not None else base.gap_ms,
    )
    results = measure(settings)
    print(format_table(results, settings))
    doc = {
        "benchmark": "coldpath",
        "format": 1,
        "timestamp": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "python -m bench.coldpath " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": machine_info("not used"),
        "settings": {"samples": settings.samples, "gap_ms": settings.gap_ms},
        "pieces": results,
    }
    write_json(doc, args.out)
    print(f"\nJSON: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
