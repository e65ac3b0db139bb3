"""Small inline-SVG charts of a capability's last minutes (no script, no image files).

The markup is built here from numbers and escaped labels, and handed to the templates as
markup already safe to insert.
"""

from __future__ import annotations

import time
from html import escape

from markupsafe import Markup

from reach.console.rollup import Bucket

__all__ = ["ERROR_COLOURS", "calls_chart", "errors_chart"]

WIDTH, HEIGHT = 600, 90
#: one colour per error kind (others grey), the same in the chart and its legend
ERROR_COLOURS = {
    "timeout": "#d97706",
    "connect": "#7c3aed",
    "business": "#2563eb",
    "breaker": "#dc2626",
    "contract": "#db2777",
    "unavailable": "#0891b2",
    "discovery": "#65a30d",
    "internal": "#111827",
    "denied": "#9333ea",
    "fallback": "#ca8a04",
}


def _frame(body: list[str], label: str, top: float, first: float, last: float) -> Markup:
    start = time.strftime("%H:%M:%S", time.localtime(first))
    end = time.strftime("%H:%M:%S", time.localtime(last))
    parts = [
        f'<svg class="chart" viewBox="0 0 {WIDTH} {HEIGHT + 16}" width="{WIDTH}"'
        f' height="{HEIGHT + 16}" role="img" aria-label="{escape(label)}">',
        f"<title>{escape(label)}</title>",
        f'<line x1="0" y1="{HEIGHT}" x2="{WIDTH}" y2="{HEIGHT}" stroke="#9ca3af"/>',
        *body,
        f'<text x="2" y="10" font-size="10" fill="#374151">{escape(f"{top:.3g}")}</text>',
        f'<text x="0" y="{HEIGHT + 13}" font-size="10" fill="#6b7280">{start}</text>',
        f'<text x="{WIDTH}" y="{HEIGHT + 13}" font-size="10" fill="#6b7280"'
        f' text-anchor="end">{end}</text>',
        "</svg>",
    ]
    return Markup("".join(parts))


def calls_chart(series: list[tuple[float, Bucket]], bucket_sec: float) -> Markup:
    """Calls/s per bucket: the ones that succeeded in green, the others in red above."""
    if not series:
        return Markup("")
    top = max(max(b.calls for _, b in series) / bucket_sec, 1.0)
    bar = WIDTH / len(series)
    body = []
    for i, (start, bucket) in enumerate(series):
        ok_h = HEIGHT * bucket.ok / bucket_sec / top
        bad_h = HEIGHT * (bucket.calls - bucket.ok) / bucket_sec / top
        x = i * bar
        stamp = time.strftime("%H:%M:%S", time.localtime(start))
        tip = f"{stamp}: {bucket.calls / bucket_sec:.1f} calls/s, {bucket.ok} ok"
        body.append(
            f"<g><title>{escape(tip)}</title>"
            f'<rect x="{x:.1f}" y="{HEIGHT - ok_h:.1f}" width="{max(bar - 1, 1):.1f}"'
            f' height="{ok_h:.1f}" fill="#16a34a"/>'
            f'<rect x="{x:.1f}" y="{HEIGHT - ok_h - bad_h:.1f}" width="{max(bar - 1, 1):.1f}"'
            f' height="{bad_h:.1f}" fill="#dc2626"/></g>'
        )
    label = f"calls per second, {bucket_sec:g} s bars (green ok, red not)"
    return _frame(body, label, top, series[0][0], series[-1][0] + bucket_sec)


def errors_chart(series: list[tuple[float, Bucket]], bucket_sec: float) -> Markup:
    """Failed calls per bucket, stacked by error kind (``ERROR_COLOURS``)."""
    if not series:
        return Markup("")
    top = max(max(sum(b.errors.values()) for _, b in series), 1)
    bar = WIDTH / len(series)
    body = []
    for i, (start, bucket) in enumerate(series):
        y = float(HEIGHT)
        for kind, count in sorted(bucket.errors.items()):
            h = HEIGHT * count / top
            y -= h
            stamp = time.strftime("%H:%M:%S", time.localtime(start))
            body.append(
                f'<rect x="{i * bar:.1f}" y="{y:.1f}" width="{max(bar - 1, 1):.1f}"'
                f' height="{h:.1f}" fill="{ERROR_COLOURS.get(kind, "#6b7280")}">'
                f"<title>{escape(f'{stamp}: {count} {kind}')}</title></rect>"
            )
    label = f"failed calls per {bucket_sec:g} s, by error kind"
    return _frame(body, label, float(top), series[0][0], series[-1][0] + bucket_sec)
