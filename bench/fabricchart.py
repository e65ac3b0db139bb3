"""The chart of part 4 of ``bench.discovery``: how each figure of callers on a fabric grows
with the instances, and where the growth measured takes it at 100,000.

One panel per target of the scale issue (a caller's CPU, a change's visibility at every
caller, the registrar's CPU per 10,000 instances) and one for the registry's footprint
per 10,000 (bytes and messages/s). Measured scales are solid markers; the projection to
100,000 (:func:`bench.fabricscale.project`) is a hollow one on a dotted line, so that a
reader never takes one for the other; the target is a grey dashed line.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.fabricscale import (
    TARGET_CALLER_CPU_PCT,
    TARGET_REGISTRAR_PCT_PER_10K,
    TARGET_SCALE,
    TARGET_VISIBLE_P99_MS,
    _figures,
    _measured,
    kept_up,
    project,
)
from bench.report import NO_MATPLOTLIB, pyplot

__all__ = ["write_fabric_chart"]

#: (panel title, y label, [(figure, series label)], target or None)
_PANELS: tuple[tuple[str, str, tuple[tuple[str, str], ...], float | None], ...] = (
    (
        "caller route cache CPU",
        "% of a core",
        (("caller_cpu_used_pct", "10 capabilities"), ("caller_cpu_all_pct", "every record")),
        TARGET_CALLER_CPU_PCT,
    ),
    (
        "announce / bye visible at every caller",
        "p99, ms",
        (("visible_p99_ms", "worst of announce and bye, both callers"),),
        TARGET_VISIBLE_P99_MS,
    ),
    (
        "registrar CPU per 10,000 instances",
        "% of a core",
        (("registrar_cpu_pct_per_10k", "one registrar"),),
        TARGET_REGISTRAR_PCT_PER_10K,
    ),
    (
        "registry per 10,000 instances",
        "MB; messages/s ÷ 1,000",
        (
            ("registry_mb_per_10k", "stored, MB"),
            ("messages_k_per_sec_per_10k", "messages/s ÷ 1,000"),
        ),
        None,
    ),
)


def _points(rows: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The measured scales where the registrar kept up, and the projection, each with the
    footprint figures in the panel's units."""
    measured = [{"instances": r["instances"], **_figures(r)} for r in _measured(rows) if kept_up(r)]
    at = project(rows)
    for point in [*measured, at]:
        if point.get("registry_bytes_per_10k") is not None:
            point["registry_mb_per_10k"] = point["registry_bytes_per_10k"] / 1e6
        if point.get("messages_per_sec_per_10k") is not None:
            point["messages_k_per_sec_per_10k"] = point["messages_per_sec_per_10k"] / 1e3
    return measured, at


def write_fabric_chart(rows: Sequence[dict[str, Any]], path: Path) -> tuple[Path | None, str]:
    """The PNG at ``path``; None and a note instead without matplotlib or measured rows."""
    measured, at = _points(rows)
    if not measured:
        return None, "no scale of part 4 was measured with the registrar keeping up: no chart"
    plt = pyplot()
    if plt is None:
        return None, NO_MATPLOTLIB
    fig, axes = plt.subplots(1, len(_PANELS), figsize=(16, 4.2))
    xs = [p["instances"] for p in measured]
    projected = bool(at.get("projected"))
    ticks = sorted({*xs, TARGET_SCALE}) if projected else xs
    for ax, (title, ylabel, series, target) in zip(axes, _PANELS, strict=True):
        for n, (name, label) in enumerate(series):
            color = f"C{n}"
            ys = [p.get(name) for p in measured]
            ax.plot(xs, ys, "o-", color=color, label=label)
            if projected and at.get(name) is not None and ys[-1] is not None:
                ax.plot([xs[-1], TARGET_SCALE], [ys[-1], at[name]], ":", color=color)
                ax.plot([TARGET_SCALE], [at[name]], "o", mfc="none", color=color)
        if target is not None:
            ax.axhline(target, color="grey", linestyle="--", linewidth=1, label="target")
        ax.set_xscale("log")
        ax.minorticks_off()
        ax.set_xticks(ticks, [f"{t:,}" for t in ticks], fontsize=7)
        ax.set_ylim(bottom=0)
        ax.set_xlabel("instances (hollow: projected)" if projected else "instances")
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle("Agent-Reach: callers and registrar by heartbeating instances (discovery part 4)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path, ""
