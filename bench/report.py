"""Numbers out of samples: medians with min–max, paired ratios to the baseline, the
printed tables, the JSON document and (when matplotlib is installed) PNG charts.

Every figure is a median over repetitions with its min–max; a ratio to the baseline is
taken per repetition (the stacks of one repetition ran side by side) and then summarised
the same way, so that a slow minute on a shared machine does not pass for a slow stack.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.callpath import CallpathResult, Cpu, LatencyRun, StackRuns, ThroughputRun
from bench.payload import payload_bytes
from reach.native import compiled_modules, stale_message

__all__ = [
    "BASELINE",
    "build_document",
    "format_tables",
    "machine_info",
    "percentile",
    "spread",
    "summarize",
    "write_charts",
]

BASELINE = "raw"
_LATENCY_POINTS = (("p50", 0.50), ("p90", 0.90), ("p99", 0.99))
_ROLES = ("caller", "responder", "server", "registrar")

Spread = dict[str, Any]


def percentile(values: Sequence[float], q: float) -> float:
    """The q-quantile (0..1) with linear interpolation between closest ranks."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def spread(values: Sequence[float | None]) -> Spread:
    """Median, min and max of per-repetition values (None where a value is unknown)."""
    known = [v for v in values if v is not None]
    if not known:
        return {"median": None, "min": None, "max": None, "per_rep": list(values)}
    return {
        "median": statistics.median(known),
        "min": min(known),
        "max": max(known),
        "per_rep": list(values),
    }


def _ratios(values: Sequence[float | None], base: Sequence[float | None]) -> Spread:
    paired = [
        v / b if v is not None and b is not None and b > 0 else None
        for v, b in zip(values, base, strict=False)
    ]
    return spread(paired)


def _per_call_us(cpu: Cpu, calls: int) -> dict[str, float | None]:
    def us(sec: float | None) -> float | None:
        return None if sec is None or calls <= 0 else round(sec / calls * 1e6, 2)

    return {
        "caller": us(cpu.caller_sec),
        "responder": us(cpu.responder_sec),
        "server": us(cpu.server_sec),
        "registrar": us(cpu.registrar_sec),
    }


def _total(per_call: dict[str, float | None]) -> float | None:
    """CPU per call of every process measured (None if none was)."""
    known = [v for v in per_call.values() if v is not None]
    return round(sum(known), 2) if known else None


def _stack_points(runs: StackRuns) -> dict[str, list[float | None]]:
    """Per-repetition values of every figure of one stack, by figure name."""
    points: dict[str, list[float | None]] = {}
    for label, q in _LATENCY_POINTS:
        points[f"latency_{label}"] = [
            percentile(r.latencies_ms, q) if r.latencies_ms else None for r in runs.sequential
        ]
    seq_cpu = [_per_call_us(r.cpu, len(r.latencies_ms)) for r in runs.sequential]
    for role in _ROLES:
        points[f"cpu_sequential_{role}"] = [c[role] for c in seq_cpu]
    for concurrency, tp_runs in sorted(runs.throughput.items()):
        points[f"calls_per_sec_{concurrency}"] = [r.calls_per_sec for r in tp_runs]
        tp_cpu = [_per_call_us(r.cpu, r.calls) for r in tp_runs]
        for role in _ROLES:
            points[f"cpu_{concurrency}_{role}"] = [c[role] for c in tp_cpu]
        points[f"cpu_{concurrency}_total"] = [_total(c) for c in tp_cpu]
    return points


def _all_runs(runs: StackRuns) -> list[LatencyRun | ThroughputRun]:
    return [*runs.sequential, *(r for rs in runs.throughput.values() for r in rs)]


def summarize(result: CallpathResult, baseline: str = BASELINE) -> dict[str, Any]:
    """Per stack: every figure as a spread, ratios to the baseline, and the error count."""
    points = {name: _stack_points(runs) for name, runs in result.runs.items()}
    base = points.get(baseline)
    summary: dict[str, Any] = {}
    for name, runs in result.runs.items():
        mine = points[name]
        entry: dict[str, Any] = {
            "latency_ms": {label: spread(mine[f"latency_{label}"]) for label, _ in _LATENCY_POINTS},
            "calls_per_sec": {
                str(c): spread(mine[f"calls_per_sec_{c}"]) for c in sorted(runs.throughput)
            },
            "cpu_us_per_call": {
                "sequential": {r: spread(mine[f"cpu_sequential_{r}"]) for r in _ROLES},
                **{
                    str(c): {r: spread(mine[f"cpu_{c}_{r}"]) for r in _ROLES}
                    for c in sorted(runs.throughput)
                },
            },
            "errors": sum(r.errors for r in _all_runs(runs)),
            "first_error": next((r.first_error for r in _all_runs(runs) if r.first_error), None),
        }
        if base is not None:
            entry["ratio_to_" + baseline] = {
                key: _ratios(values, base[key])
                for key, values in mine.items()
                if key in base and not key.startswith("cpu_")
            }
        summary[name] = entry
    return summary


#: full Agent-Reach, and the prefix of the stacks that turn one of its features off
FULL_STACK = "reach"
_WITHOUT = "reach-no"


def feature_costs(
    result: CallpathResult, measure: str = "calls_per_sec_"
) -> dict[str, dict[str, Spread]]:
    """What each feature costs: per ``reach-no<feature>`` stack run alongside ``reach``, a
    paired per-repetition ratio at each concurrency.

    ``calls_per_sec_``: reach ÷ reach-no<feature> of calls/s (1 − ratio: the share of
    calls/s the feature costs). ``cpu_``: reach-no<feature> ÷ reach of the CPU per call of
    all measured processes (1 − ratio: the feature's share of reach's CPU per call), a
    figure that a busy, noisy machine moves less than calls/s."""
    points = {name: _stack_points(runs) for name, runs in result.runs.items()}
    full = points.get(FULL_STACK)
    costs: dict[str, dict[str, Spread]] = {}
    if full is None:
        return costs
    for name, mine in points.items():
        if not name.startswith(_WITHOUT):
            continue
        feature = name[len(_WITHOUT) :]
        if measure == "cpu_":
            costs[feature] = {
                key.removeprefix("cpu_").removesuffix("_total"): _ratios(mine[key], full[key])
                for key in mine
                if key.startswith("cpu_") and key.endswith("_total") and key in full
            }
        else:
            costs[feature] = {
                key.removeprefix(measure): _ratios(full[key], mine[key])
                for key in mine
                if key.startswith(measure) and key in full
            }
    return costs


# -- machine and document ----------------------------------------------------------------


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _git(*args: str) -> str:
    root = Path(__file__).resolve().parent.parent
    return subprocess.run(
        ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=5, check=True
    ).stdout


def _git_state() -> tuple[str, list[str]]:
    """The commit measured, and the tracked files changed on top of it."""
    try:
        head = _git("rev-parse", "--short", "HEAD").strip()
        dirty = _git("status", "--porcelain", "--untracked-files=no").splitlines()
    except (OSError, subprocess.SubprocessError):
        return "unknown", []
    return head + ("-dirty" if dirty else ""), [line[3:] for line in dirty]


def require_fresh_build() -> None:
    """Refuse to measure compiled modules older than their sources: not the code in the
    tree (``make build`` rebuilds them; ``make pure`` removes them)."""
    stale = stale_message()
    if stale is not None:
        raise SystemExit(f"bench: {stale}")


def _compiled() -> list[str]:
    """The call path's modules that run compiled (mypyc) in this install."""
    import reach.agent.agent
    import reach.caller.client  # noqa: F401  (loaded, to be listed)

    return compiled_modules()


def machine_info(server_version: str) -> dict[str, Any]:
    affinity = getattr(os, "sched_getaffinity", None)
    commit, changed = _git_state()
    return {
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(affinity(0)) if affinity is not None else os.cpu_count(),
        "cpu_model": _cpu_model(),
        "platform": platform.platform(),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "nats_server": server_version,
        "nats_py": _version("nats-py"),
        "msgpack": _version("msgpack"),
        "agent_reach": _version("agent-reach"),
        # the call path's modules compiled with mypyc (empty: plain Python)
        "agent_reach_compiled": _compiled(),
        "git_commit": commit,
        "git_changed_files": changed,
        "load_average": [round(x, 2) for x in os.getloadavg()]
        if hasattr(os, "getloadavg")
        else None,
    }


def build_document(result: CallpathResult, argv: Sequence[str]) -> dict[str, Any]:
    samples: dict[str, Any] = {}
    for name, runs in result.runs.items():
        samples[name] = {
            "sequential": [asdict(r) for r in runs.sequential],
            "throughput": {
                str(c): [{**asdict(r), "calls_per_sec": r.calls_per_sec} for r in rs]
                for c, rs in sorted(runs.throughput.items())
            },
        }
    return {
        "benchmark": "callpath",
        "format": 1,
        "timestamp": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(["python -m bench", *argv]),
        "argv": [sys.executable, "-m", "bench", *argv],
        "machine": machine_info(result.server_version),
        "settings": asdict(result.settings),
        "payload_bytes": payload_bytes(),
        "server_url": result.server_url,
        "run_id": result.run_id,
        "wall_sec": result.wall_sec,
        "baseline": BASELINE,
        "stacks": {s.name: s.description for s in result.stacks},
        "summary": summarize(result),
        "feature_cost": feature_costs(result),
        "feature_cpu_share": feature_costs(result, "cpu_"),
        "samples": samples,
    }


# -- tables ------------------------------------------------------------------------------


def _num(value: float | None, digits: int) -> str:
    if value is None:
        return "n/a"
    return f"{value:,.{digits}f}"


def _fmt(s: Spread | None, digits: int, unit: str = "") -> str:
    if not s or s.get("median") is None:
        return "n/a"
    return f"{_num(s['median'], digits)}{unit} ({_num(s['min'], digits)}–{_num(s['max'], digits)})"


def _table(title: str, header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows, strict=True)]

    def line(cells: Sequence[str]) -> str:
        first = cells[0].ljust(widths[0])
        rest = (c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True))
        return "  ".join([first, *rest]).rstrip()

    rule = "-" * len(line(header))
    return "\n".join([title, line(header), rule, *(line(r) for r in rows)])


def format_tables(doc: dict[str, Any]) -> str:
    summary: dict[str, Any] = doc["summary"]
    settings = doc["settings"]
    machine = doc["machine"]
    concurrency = [str(c) for c in settings["concurrency"]]
    ratio_key = "ratio_to_" + doc["baseline"]
    blocks = [
        f"Agent-Reach call path: {doc['payload_bytes']}-byte msgpack echo, responder in its own"
        f" process; {settings['reps']} interleaved repetitions, median (min–max).",
        f"{machine['python']}, nats-py {machine['nats_py']}, nats-server {machine['nats_server']},"
        f" {machine['cpus_usable']} CPUs ({machine['cpu_model']}), commit {machine['git_commit']}.",
    ]
    blocks.append(
        _table(
            f"\nSequential latency, ms ({settings['seq_calls']} calls per repetition;"
            " lower is better)",
            ["stack", "p50", "p90", "p99"],
            [
                [name] + [_fmt(s["latency_ms"][p], 3) for p in ("p50", "p90", "p99")]
                for name, s in summary.items()
            ],
        )
    )
    blocks.append(
        _table(
            f"\nThroughput, calls/s by calls in flight ({settings['duration_sec']:g} s per"
            " repetition; higher is better)",
            ["stack", *(f"{c} in flight" for c in concurrency)],
            [
                [name] + [_fmt(s["calls_per_sec"].get(c), 0) for c in concurrency]
                for name, s in summary.items()
            ],
        )
    )
    ratio_rows = [
        [name]
        + [_fmt(s[ratio_key].get(f"latency_{p}"), 2, "×") for p in ("p50", "p99")]
        + [_fmt(s[ratio_key].get(f"calls_per_sec_{c}"), 2, "×") for c in concurrency]
        for name, s in summary.items()
        if ratio_key in s
    ]
    if ratio_rows:
        blocks.append(
            _table(
                f"\nRelative to {doc['baseline']} (per-repetition ratio; latency: lower is"
                " better, calls/s: higher is better)",
                ["stack", "p50 latency", "p99 latency", *(f"calls/s @{c}" for c in concurrency)],
                ratio_rows,
            )
        )
    top = concurrency[-1] if concurrency else None
    if top is not None:
        cpu_rows = []
        for name, s in summary.items():
            cpu = s["cpu_us_per_call"].get(top, {})
            medians = [cpu.get(r, {}).get("median") for r in _ROLES]
            total = sum(m for m in medians if m is not None)
            cpu_rows.append([name, *(_num(m, 1) for m in medians), _num(total, 1)])
        blocks.append(
            _table(
                f"\nCPU per call at {top} in flight, µs (median; whole processes, so the"
                " callee's idle overhead is included; one registrar serves every stack)",
                ["stack", "caller", "responder", "nats-server", "registrar", "total"],
                cpu_rows,
            )
        )
    for key, title in (
        (
            "feature_cost",
            f"What each feature costs: 1 − calls/s of {FULL_STACK} ÷ calls/s without it"
            " (paired per repetition, median)",
        ),
        (
            "feature_cpu_share",
            f"Its share of {FULL_STACK}'s CPU per call: 1 − CPU per call without it ÷ CPU per"
            " call with it (all four processes; paired per repetition, median)",
        ),
    ):
        costs: dict[str, Any] = doc.get(key, {})
        if not costs:
            continue
        cost_rows = []
        for feature, by_conc in costs.items():
            row = [feature]
            for c in concurrency:
                ratio = by_conc.get(c)
                median = ratio.get("median") if ratio else None
                cost = None if median is None else 1 - median
                row.append(f"{_num(cost * 100 if cost is not None else None, 1)} %")
            cost_rows.append(row)
        blocks.append(_table(f"\n{title}", ["feature", *(f"@{c}" for c in concurrency)], cost_rows))
    errors = [
        f"  {name}: {s['errors']} errors, first: {s['first_error']}"
        for name, s in summary.items()
        if s["errors"]
    ]
    if errors:
        blocks.append("\nERRORS during measurement (numbers above exclude failed calls):")
        blocks.extend(errors)
    return "\n".join(blocks)


# -- charts -------------------------------------------------------------------------------

#: what a benchmark says instead of a chart when matplotlib is not there
NO_MATPLOTLIB = "matplotlib is not installed: no PNG chart (pip install matplotlib for it)"


def pyplot() -> Any | None:
    """matplotlib's pyplot drawing to files (the Agg backend), or None without matplotlib
    (an optional dependency: the ``bench`` extra)."""
    try:
        matplotlib = importlib.import_module("matplotlib")
    except ImportError:
        return None
    matplotlib.use("Agg")
    return importlib.import_module("matplotlib.pyplot")


def write_charts(doc: dict[str, Any], directory: Path, stem: str) -> tuple[list[Path], str]:
    """PNG charts next to the JSON; without matplotlib, no charts and a note saying so."""
    plt = pyplot()
    if plt is None:
        return [], NO_MATPLOTLIB
    directory.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = doc["summary"]
    names = list(summary)
    concurrency = [str(c) for c in doc["settings"]["concurrency"]]
    paths: list[Path] = []

    def grouped(
        filename: str,
        title: str,
        ylabel: str,
        groups: Sequence[str],
        pick: Callable[[dict[str, Any], str], Spread | None],
    ) -> None:
        fig, ax = plt.subplots(figsize=(8, 4.5))
        width = 0.8 / max(1, len(names))
        for i, name in enumerate(names):
            spreads = [pick(summary[name], g) or {} for g in groups]
            med = [s.get("median") or 0.0 for s in spreads]
            low = [m - (s.get("min") or m) for m, s in zip(med, spreads, strict=True)]
            high = [(s.get("max") or m) - m for m, s in zip(med, spreads, strict=True)]
            xs = [x + (i - (len(names) - 1) / 2) * width for x in range(len(groups))]
            ax.bar(xs, med, width, yerr=[low, high], capsize=3, label=name)
        ax.set_xticks(range(len(groups)), groups)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.legend()
        fig.tight_layout()
        path = directory / filename
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)

    reps = doc["settings"]["reps"]
    grouped(
        f"{stem}-throughput.png",
        f"Calls/s by calls in flight (median, min–max of {reps} reps)",
        "calls/s",
        [f"{c} in flight" for c in concurrency],
        lambda s, g: s["calls_per_sec"].get(g.split()[0]),
    )
    grouped(
        f"{stem}-latency.png",
        f"Sequential latency (median, min–max of {reps} reps)",
        "ms",
        ["p50", "p90", "p99"],
        lambda s, g: s["latency_ms"].get(g),
    )
    return paths, ""


def write_json(doc: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
