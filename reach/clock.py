"""Time as a dependency: logic that depends on time takes a Clock, so tests need not sleep."""

from __future__ import annotations

import time
from typing import Protocol

__all__ = ["Clock", "ManualClock", "SystemClock", "system_clock"]


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds on a clock that never goes back (for intervals)."""
        ...

    def time(self) -> float:
        """Unix time in seconds (for timestamps that travel between processes)."""
        ...

    def perf_counter(self) -> float:
        """Seconds on the finest clock there is, which never goes back (for latencies)."""
        ...


class SystemClock:
    monotonic = staticmethod(time.monotonic)
    perf_counter = staticmethod(time.perf_counter)
    time = staticmethod(time.time)


class ManualClock:
    """A clock that moves only when told to."""

    def __init__(self, start: float = 1_000.0, wall: float = 1_700_000_000.0) -> None:
        self._mono = start
        self._offset = wall - start

    def monotonic(self) -> float:
        return self._mono

    def time(self) -> float:
        return self._mono + self._offset

    def perf_counter(self) -> float:
        return self._mono

    def advance(self, seconds: float) -> None:
        self._mono += seconds


system_clock: Clock = SystemClock()
