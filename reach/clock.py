"""Time as a dependency: logic that depends on time takes a Clock, so tests need not sleep.

A ``Clock`` reads the time and sleeps on it: code that waits between tries (retries and
their backoff) sleeps with ``clock.sleep``, so that on a ``ManualClock`` a test runs a
whole retry schedule at once and reads what it slept.
"""

from __future__ import annotations

import asyncio
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

    async def sleep(self, seconds: float) -> None:
        """Wait ``seconds`` on this clock (zero or less: yield to the event loop once)."""
        ...


class SystemClock:
    monotonic = staticmethod(time.monotonic)
    perf_counter = staticmethod(time.perf_counter)
    time = staticmethod(time.time)
    sleep = staticmethod(asyncio.sleep)


class ManualClock:
    """A clock that moves only when told to: by ``advance``, or by a sleep on it.

    ``sleep(seconds)`` moves the clock ``seconds`` ahead at once, then yields to the event
    loop once, and notes the sleep in ``slept``: a retry schedule runs without waiting,
    the clock reads afterwards what it would after the real sleeps, and a test can read
    the schedule. Sleepers never wait for one another: two tasks sleeping at once each
    move the clock, as if they had slept one after the other.
    """

    def __init__(self, start: float = 1_000.0, wall: float = 1_700_000_000.0) -> None:
        self._mono = start
        self._offset = wall - start
        #: every sleep on this clock, in seconds, in order
        self.slept: list[float] = []

    def monotonic(self) -> float:
        return self._mono

    def time(self) -> float:
        return self._mono + self._offset

    def perf_counter(self) -> float:
        return self._mono

    def advance(self, seconds: float) -> None:
        self._mono += seconds

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        if seconds > 0:
            self._mono += seconds
        await asyncio.sleep(0)


system_clock: Clock = SystemClock()
