"""An on/off profiler of the current thread, written as a text report when stopped.

pyinstrument (sampling, low overhead) when it is installed, else the standard library's
cProfile (deterministic: slower, but it counts calls). Neither is a dependency of the
project: ``pip install pyinstrument`` for the better picture.
"""

from __future__ import annotations

import cProfile
import importlib
import io
import pstats
from pathlib import Path
from typing import Any

__all__ = ["Profile", "profiler_name"]

#: pyinstrument's sampling interval: fine enough for calls of a few hundred microseconds
_INTERVAL = 0.0005
_TOP = 40


def _pyinstrument() -> Any | None:
    try:
        return importlib.import_module("pyinstrument")
    except ImportError:
        return None


def profiler_name() -> str:
    return "pyinstrument" if _pyinstrument() is not None else "cProfile"


class Profile:
    """``start()``, then ``stop()`` writes the report to ``out`` (and returns it)."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self._pyi = _pyinstrument()
        self._profiler: Any = None

    def start(self) -> None:
        if self._pyi is not None:
            # async_mode disabled: sample what the thread really does, event loop included
            self._profiler = self._pyi.Profiler(interval=_INTERVAL, async_mode="disabled")
            self._profiler.start()
        else:
            self._profiler = cProfile.Profile()
            self._profiler.enable()

    def stop(self) -> str:
        if self._profiler is None:
            return ""
        if self._pyi is not None:
            self._profiler.stop()
            renderers = importlib.import_module("pyinstrument.renderers")
            flat = renderers.ConsoleRenderer(flat=True, time="percent_of_total", flat_time="self")
            tree = renderers.ConsoleRenderer(time="percent_of_total", short_mode=True)
            report = (
                "== self time by function (pyinstrument, % of samples) ==\n"
                + _head(self._profiler.output(flat), _TOP)
                + "\n== call tree ==\n"
                + self._profiler.output(tree)
            )
        else:
            self._profiler.disable()
            buf = io.StringIO()
            stats = pstats.Stats(self._profiler, stream=buf)
            buf.write("== self time by function (cProfile, tottime) ==\n")
            stats.sort_stats("tottime").print_stats(_TOP)
            buf.write("\n== cumulative time ==\n")
            stats.sort_stats("cumulative").print_stats(_TOP)
            report = buf.getvalue()
        self._profiler = None
        self.out.write_text(report)
        return report


def _head(text: str, lines: int) -> str:
    kept = text.splitlines()[: lines + 8]  # the renderer's header lines come first
    return "\n".join(kept) + "\n"
