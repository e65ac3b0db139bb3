"""Where a stack spends its CPU: profile the caller and the responder under load.

    python -m bench.hotspots [--stack reach] [--concurrency 128] [--duration 5] [--out-dir DIR]

The stack runs as in the benchmark (responder in its own process, registrar in another);
after a warm-up, both sides are profiled during one throughput run, and the reports go to
``DIR/hotspots-<stack>-caller.txt`` and ``DIR/hotspots-<stack>-responder.txt``. Uses
pyinstrument when it is installed (``pip install pyinstrument``), else cProfile, whose
overhead inflates small functions. Profiled numbers are for finding hotspots, never for
speed claims: those come from ``python -m bench``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from pathlib import Path

from bench.callpath import QUICK, launch, measure_throughput, warm_up
from bench.profiling import Profile, profiler_name
from bench.report import require_fresh_build
from bench.stacks import STACKS

_DEFAULT_DIR = Path(__file__).resolve().parent / "results"
_SHOWN_LINES = 32


async def profile_stack(stack: str, concurrency: int, duration: float, out_dir: Path) -> None:
    def progress(line: str) -> None:
        print(f"[hotspots] {line}", file=sys.stderr, flush=True)

    async with launch([STACKS[stack]], None, progress, profile_dir=out_dir) as bed:
        live = bed.live[0]
        await warm_up(live, QUICK, progress)
        caller = Profile(out_dir / f"hotspots-{stack}-caller.txt")
        await live.responder.profile(start=True)
        caller.start()
        calls, errors, seconds, _ = await measure_throughput(live.call, concurrency, duration)
        caller_report = caller.stop()
        await live.responder.profile(start=False)
    responder_out = out_dir / f"hotspots-{stack}-responder.txt"
    print(
        f"{stack}: {calls / seconds:,.0f} calls/s at {concurrency} in flight while profiled"
        f" with {profiler_name()} ({errors} errors)"
    )
    for side, text in (("caller", caller_report), ("responder", responder_out.read_text())):
        print(f"\n#### {side} ({stack}) ####")
        print("\n".join(text.splitlines()[:_SHOWN_LINES]))
    print(f"\nfull reports: {caller.out}, {responder_out}")


def main(argv: Sequence[str] | None = None) -> int:
    require_fresh_build()
    parser = argparse.ArgumentParser(prog="python -m bench.hotspots")
    parser.add_argument("--stack", default="reach", choices=list(STACKS))
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--out-dir", type=Path, default=_DEFAULT_DIR)
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    asyncio.run(profile_stack(args.stack, args.concurrency, args.duration, args.out_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
