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
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Profile", "flat_report", "profiler_name"]

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
            tree = renderers.ConsoleRenderer(time="percent_of_total", short_mode=True)
            session = self._profiler.last_session
            report = (
                flat_report(session.frame_records, session.duration, session.cpu_time)
                + "\n== call tree (pyinstrument) ==\n"
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
        return str(report)


@dataclass(frozen=True)
class _Frame:
    function: str
    file: str
    line: str

    @classmethod
    def parse(cls, identifier: str) -> _Frame:
        # pyinstrument: "function\0file\0first_line[\1c<class>][\1l<line>]"
        parts = identifier.split("\x00")
        function = parts[0]
        file = parts[1] if len(parts) > 1 else ""
        attrs = parts[2].split("\x01") if len(parts) > 2 else [""]
        cls_name = next((a[1:] for a in attrs[1:] if a.startswith("c")), "")
        if cls_name and "." not in function:
            function = f"{cls_name}.{function}"
        return cls(function, _short(file), attrs[0])

    @property
    def builtin(self) -> bool:
        return self.file.startswith("<")

    @property
    def label(self) -> str:
        return f"{self.function}  {self.file}" + (f":{self.line}" if not self.builtin else "")


def _short(path: str) -> str:
    for marker in ("site-packages/", "/lib/python3.", "/work/main/"):
        if marker in path:
            tail = path.split(marker, 1)[1]
            return tail.split("/", 1)[1] if marker == "/lib/python3." else tail
    return path


def _package(file: str) -> str:
    if file.startswith("reach/"):
        return "reach (Agent-Reach)"
    if file.startswith("bench/"):
        return "bench (load generator)"
    if file.startswith("nats/"):
        return "nats-py"
    if file.startswith(("asyncio/", "selectors.py")):
        return "asyncio (event loop)"
    return file.split("/", 1)[0].removesuffix(".py") if "/" in file else f"stdlib {file}"


def _most(totals: dict[str, float], count: int) -> list[tuple[str, float]]:
    return sorted(totals.items(), key=lambda item: -item[1])[:count]


def flat_report(records: Sequence[tuple[list[str], float]], duration: float, cpu: float) -> str:
    """Self time by package and by function from pyinstrument's raw samples.

    A builtin's time is charged to the package of the Python function that called it
    (``isinstance`` inside ``check_value`` is Agent-Reach's time). Samples waiting in
    the selector are idle time and left out of the percentages.
    """
    by_function: dict[str, float] = defaultdict(float)
    by_package: dict[str, float] = defaultdict(float)
    idle = 0.0
    for stack, seconds in records:
        frames = [_Frame.parse(ident) for ident in stack]
        leaf = frames[-1]
        # waiting in epoll (sampled as the builtin or as its Python caller in selectors.py)
        if leaf.file == "selectors.py" or (leaf.builtin and leaf.function.endswith("poll")):
            idle += seconds
            continue
        by_function[leaf.label] += seconds
        owner = next((f for f in reversed(frames) if not f.builtin), leaf)
        by_package[_package(owner.file)] += seconds
    busy = sum(by_function.values()) or 1e-9
    lines = [
        f"== {duration:.2f} s wall, {cpu:.2f} s CPU, {idle / max(duration, 1e-9):.0%} of samples"
        " idle in the selector; percentages below are of the busy samples ==",
        "",
        "-- self time by package --",
        *(f"{t / busy:6.1%}  {name}" for name, t in _most(by_package, len(by_package))),
        "",
        "-- self time by function --",
        *(f"{t / busy:6.1%}  {name}" for name, t in _most(by_function, _TOP)),
    ]
    return "\n".join(lines) + "\n"
