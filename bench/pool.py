"""Pool several call-path runs per build and compare two builds, rep by rep.

    python -m bench.pool BEFORE.json[,BEFORE2.json…] AFTER.json[,AFTER2.json…]

Each file is what ``python -m bench --stacks raw,reach,reach-noaudit …`` wrote. On a small
shared machine one repetition's ratios move by several points from one to the next;
pooling the repetitions of runs made alternately (before, after, before, after) gives
medians and quartiles that say how far apart the two builds really are. Prints a
Markdown table: for each figure, the median and the interquartile range over every
repetition of every run of that build; with the caller's process CPU per call at 128 in
flight with and without audit, and their difference paired per repetition.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_CONCURRENCY = "128"
#: the caller's process CPU per call (µs), a figure of its own: less moved by the load
#: of other processes than calls/s
_CPU = "caller CPU µs/call"


def _ratios(summary: dict[str, Any], stack: str, path: Sequence[str]) -> list[float]:
    def per_rep(name: str) -> list[float]:
        node: Any = summary[name]
        for key in path:
            node = node[key]
        return [float(v) for v in node["per_rep"]]

    return [a / b for a, b in zip(per_rep(stack), per_rep("raw"), strict=True)]


def pool(files: Sequence[Path]) -> dict[str, list[float]]:
    """Every repetition's figures of the runs in ``files``, by figure."""
    out: dict[str, list[float]] = {}
    for file in files:
        run = json.loads(file.read_text())
        summary = run["summary"]
        for stack in ("reach", "reach-noaudit"):
            out.setdefault(f"{stack} calls/s @{_CONCURRENCY} vs raw", []).extend(
                _ratios(summary, stack, ("calls_per_sec", _CONCURRENCY))
            )
            out.setdefault(f"{stack} sequential p50 vs raw", []).extend(
                _ratios(summary, stack, ("latency_ms", "p50"))
            )
        caller = {
            stack: summary[stack]["cpu_us_per_call"][_CONCURRENCY]["caller"]["per_rep"]
            for stack in ("reach", "reach-noaudit")
        }
        for stack, values in caller.items():
            out.setdefault(f"{_CPU} @{_CONCURRENCY}, {stack}", []).extend(values)
        out.setdefault(f"{_CPU} @{_CONCURRENCY} added by audit", []).extend(
            a - b for a, b in zip(caller["reach"], caller["reach-noaudit"], strict=True)
        )
        for figure, key in (
            ("audit cost, calls/s", "feature_cost"),
            ("audit share of CPU per call", "feature_cpu_share"),
        ):
            kept = run[key]["audit"][_CONCURRENCY]["per_rep"]
            out.setdefault(f"{figure} @{_CONCURRENCY}", []).extend(1 - x for x in kept)
    return out


def _cell(values: list[float], percent: bool, micro: bool = False) -> str:
    low, _, high = statistics.quantiles(values, n=4)
    mid = statistics.median(values)
    if micro:
        return f"{mid:.1f} ({low:.1f} – {high:.1f})"
    if percent:
        return f"{mid * 100:.1f} % ({low * 100:.1f} – {high * 100:.1f})"
    return f"{mid:.2f}× ({low:.2f} – {high:.2f})"


def table(before: dict[str, list[float]], after: dict[str, list[float]]) -> str:
    lines = [
        "| figure | before: median (quartiles) | after: median (quartiles) |",
        "|---|---|---|",
    ]
    for figure, values in before.items():
        percent, micro = figure.startswith("audit"), figure.startswith(_CPU)
        lines.append(
            f"| {figure} | {_cell(values, percent, micro)}"
            f" | {_cell(after[figure], percent, micro)} |"
        )
    n_before = len(next(iter(before.values())))
    n_after = len(next(iter(after.values())))
    lines.append(f"\nrepetitions: {n_before} before, {n_after} after")
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    before, after = ([Path(p) for p in arg.split(",")] for arg in argv)
    print(table(pool(before), pool(after)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
