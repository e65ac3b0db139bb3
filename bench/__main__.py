"""``python -m bench [--quick] [--servers URL] [--reps N] [--out FILE]``: the call-path
benchmark (see ``bench/callpath.py``); a table on stdout, every sample in the JSON file."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path

from bench.callpath import DEFAULT, QUICK, Settings, run_callpath
from bench.report import (
    build_document,
    format_tables,
    require_fresh_build,
    write_charts,
    write_json,
)
from bench.stacks import STACKS

_DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "latest.json"


def _positive_ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 1,16,128, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError("every number of calls in flight must be >= 1")
    return values


def _stacks(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in STACKS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown stack(s) {', '.join(unknown) or '(none)'}; known: {', '.join(STACKS)}"
        )
    return names


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, Settings]:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description="Call-path benchmark: Agent-Reach stacks against raw nats-py, side by side.",
    )
    parser.add_argument("--quick", action="store_true", help="1 repetition with tiny counts")
    parser.add_argument(
        "--servers", default=None, help="use this NATS (JetStream on) instead of starting one"
    )
    parser.add_argument("--reps", type=int, default=None, help="interleaved repetitions (5)")
    parser.add_argument("--out", type=Path, default=_DEFAULT_OUT, help="JSON results file")
    parser.add_argument(
        "--stacks", type=_stacks, default=list(STACKS), help=f"comma-separated ({','.join(STACKS)})"
    )
    parser.add_argument("--seq-calls", type=int, default=None, help="sequential calls per rep")
    parser.add_argument("--duration", type=float, default=None, help="seconds per throughput run")
    parser.add_argument(
        "--concurrency", type=_positive_ints, default=None, help="calls in flight (1,16,128)"
    )
    parser.add_argument("--warmup", type=int, default=None, help="warm-up calls per stack")
    parser.add_argument("--no-charts", action="store_true", help="do not write PNG charts")
    args = parser.parse_args(argv)
    base = QUICK if args.quick else DEFAULT
    overrides = {
        "reps": args.reps,
        "seq_calls": args.seq_calls,
        "duration_sec": args.duration,
        "concurrency": args.concurrency,
        "warmup_calls": args.warmup,
    }
    settings = dataclasses.replace(base, **{k: v for k, v in overrides.items() if v is not None})
    if settings.reps < 1 or settings.seq_calls < 1 or settings.duration_sec <= 0:
        parser.error("--reps and --seq-calls must be >= 1 and --duration > 0")
    if "raw" not in args.stacks:
        args.stacks.insert(0, "raw")  # every figure is a ratio to raw: it always runs
    for name in list(args.stacks):  # a variant runs on its base's processes: that runs too
        under = STACKS[name].variant_of if name in STACKS else None
        if under is not None and under not in args.stacks:
            args.stacks.append(under)
    return args, settings


def main(argv: Sequence[str] | None = None) -> int:
    require_fresh_build()
    argv = list(sys.argv[1:] if argv is None else argv)
    args, settings = parse_args(argv)
    stacks = [STACKS[name] for name in STACKS if name in args.stacks]

    def progress(line: str) -> None:
        print(f"[bench] {line}", file=sys.stderr, flush=True)

    result = asyncio.run(run_callpath(settings, stacks, args.servers, progress))
    doc = build_document(result, argv)
    out: Path = args.out
    charts: list[Path] = []
    if args.no_charts:
        note = "charts not requested (--no-charts)"
    else:
        charts, note = write_charts(doc, out.parent, out.stem)
    doc["charts"] = [str(p) for p in charts]
    if note:
        doc["charts_note"] = note
    write_json(doc, out)
    print(format_tables(doc))
    print(
        f"\nJSON: {out}" + "".join(f"\nchart: {p}" for p in charts) + (f"\n{note}" if note else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
