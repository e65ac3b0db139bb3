"""``python -m bench.faults [--quick] [--scenarios a,b] [--rate R] [--pre S] [--post S]``

Runs every fault scenario of issue 24 (see :mod:`bench.faults.scenarios`), each on a fabric
of its own: 200 calls/s open loop, 10 s of load before the fault and 20 s after it ended
(30–60 s a scenario). Writes ``bench/results/faults.json`` (every check of every scenario)
and ``bench/results/faults.md`` (the table: scenario | sent | ok | audit events kept | what
happened), and prints the table. ``--quick``: 50 calls/s and a few seconds each, a smoke
test. The exit code is 0 whatever the verdicts: the table says them.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.faults.bed import BENCH, QUICK, Timing
from bench.faults.engine import run_scenario
from bench.faults.scenarios import SCENARIOS
from bench.report import machine_info, require_fresh_build, write_json

_RESULTS = Path(__file__).resolve().parent.parent / "results"


def what_happened(outcome: dict[str, Any]) -> str:
    """The last column: the verdict, what failed, how long recovery took."""
    facts = outcome["facts"]
    parts = ["meets every target" if outcome["passed"] else "FAILS"]
    if outcome["errors"]:
        errors = ", ".join(f"{n} {kind}" for kind, n in outcome["errors"].items())
        parts.append(f"failed: {errors}")
    if outcome["recovered_sec"] is not None and outcome["fault_sec"] is not None:
        parts.append(f"recovered {outcome['recovered_sec']:.1f} s after the fault")
    elif outcome["recovered_sec"] is None:
        parts.append("an instance never served again")
    for key, label in (
        ("breaker_open_after_sec", "breaker open or ejected after"),
        ("serving_again_after_sec", "serving again after SIGCONT"),
        ("fair_after_sec", "fair shares after"),
        ("gate_back_sec", "gate back after"),
    ):
        if key in facts:
            value = facts[key]
            parts.append(f"{label} {'never' if value is None else f'{value:.2f} s'}")
    if "share_after" in facts:
        parts.append(
            f"{facts['share_after']:.2%} of the attempts to it from {facts['within_sec']:g} s on"
            f" ({facts['attempts_before']} before)"
        )
    failing = [c["detail"].splitlines()[0] for c in outcome["checks"] if not c["passed"]]
    parts += failing[:3]
    return "; ".join(parts).replace("|", "/")


def format_table(doc: dict[str, Any]) -> str:
    t = doc["timing"]
    m = doc["machine"]
    head = (
        f"Fault injection: {t['rate']:g} calls/s open loop, {t['pre_sec']:g} s of load before"
        f" each fault, {t['post_sec']:g} s after it ended; three echo instances, the caller"
        f" and the fabric each their own process. {m['python']}, nats-server"
        f" {m['nats_server']}, {m['cpus_usable']} CPUs, commit {m['git_commit']}.\n"
    )
    rows = ["| scenario | sent | ok | audit events kept | what happened |", "|---|---|---|---|---|"]
    for o in doc["runs"]:
        rows.append(
            f"| {o['title']} | {o['sent']:,} | {o['ok']:,} | {o['audit_kept']:,}"
            f" | {what_happened(o)} |"
        )
    return head + "\n" + "\n".join(rows) + "\n"


async def run_all(
    names: Sequence[str], timing: Timing, keep: bool
) -> tuple[list[dict[str, Any]], list[str]]:
    runs: list[dict[str, Any]] = []
    kept: list[str] = []
    for name in names:
        workdir = Path(tempfile.mkdtemp(prefix=f"reach-faults-{name}-"))

        def progress(line: str) -> None:
            print(f"[faults] {line}", file=sys.stderr, flush=True)

        began = time.monotonic()
        try:
            outcome = await run_scenario(name, timing, workdir, progress)
        except Exception as exc:  # one broken scenario must not lose the others' results
            progress(f"{name}: the run broke: {type(exc).__name__}: {exc}")
            outcome = _broken(name, exc)
        outcome["wall_sec"] = round(time.monotonic() - began, 1)
        runs.append(outcome)
        progress(f"{name}: {'ok' if outcome['passed'] else 'FAILS'}, logs {workdir}")
        if outcome["passed"] and not keep:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            kept.append(str(workdir))
    return runs, kept


def _broken(name: str, exc: Exception) -> dict[str, Any]:
    scenario = SCENARIOS[name]
    check = {"name": "the run", "passed": False, "detail": f"{type(exc).__name__}: {exc}"}
    return {
        "scenario": name,
        "title": scenario.title,
        "sent": 0,
        "ok": 0,
        "audit_kept": 0,
        "passed": False,
        "errors": {},
        "recovered_sec": None,
        "fault_sec": None,
        "facts": {},
        "checks": [check],
    }


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, Timing, list[str]]:
    parser = argparse.ArgumentParser(prog="python -m bench.faults", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="50 calls/s, a few seconds each")
    parser.add_argument("--scenarios", default=None, help="comma-separated: " + ",".join(SCENARIOS))
    parser.add_argument("--rate", type=float, default=None, help="calls/s (200)")
    parser.add_argument("--pre", type=float, default=None, help="seconds before the fault (10)")
    parser.add_argument("--post", type=float, default=None, help="seconds after it (20)")
    parser.add_argument("--keep", action="store_true", help="keep the logs of passed runs too")
    parser.add_argument("--out", type=Path, default=_RESULTS / "faults.json", help="JSON file")
    args = parser.parse_args(argv)
    timing = QUICK if args.quick else BENCH
    changes = {"rate": args.rate, "pre_sec": args.pre, "post_sec": args.post}
    timing = dataclasses.replace(timing, **{k: v for k, v in changes.items() if v is not None})
    names = list(SCENARIOS)
    if args.scenarios is not None:
        names = [n.strip() for n in args.scenarios.split(",") if n.strip()]
        unknown = [n for n in names if n not in SCENARIOS]
        if unknown or not names:
            parser.error(f"--scenarios: unknown {unknown}; choose among {', '.join(SCENARIOS)}")
    if timing.rate <= 0 or timing.pre_sec < 1.0 or timing.post_sec <= 0:
        parser.error("--rate > 0, --pre >= 1 and --post > 0")
    return args, timing, names


def _nats_version() -> str:
    from reach.fabric.embedded import find_nats_server

    try:
        out = subprocess.run(
            [find_nats_server(), "--version"], capture_output=True, text=True, timeout=10
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.strip().rsplit(" ", 1)[-1].lstrip("v") or "unknown"


def main(argv: Sequence[str] | None = None) -> int:
    require_fresh_build()
    argv = list(sys.argv[1:] if argv is None else argv)
    args, timing, names = parse_args(argv)
    began = time.monotonic()
    runs, kept = asyncio.run(run_all(names, timing, args.keep))
    doc = {
        "benchmark": "faults",
        "format": 1,
        "timestamp": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(["python -m bench.faults", *argv]),
        "machine": machine_info(_nats_version()),
        "timing": dataclasses.asdict(timing),
        "wall_sec": round(time.monotonic() - began, 1),
        "runs": runs,
        "logs_kept": kept,
    }
    write_json(doc, args.out)
    table = format_table(doc)
    args.out.with_suffix(".md").write_text(table)
    print(table)
    print(f"JSON: {args.out}\nTable: {args.out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
