"""Logging refused logins without letting a flood write the log.

The first few refusals of each interval get a line each (a typo, a stale credentials
file: worth seeing at once); the rest are counted and told in one summary line when the
interval ends: "refused N logins for M client ids in the last 10 s (top: ...)". However
many attempts come, that is at most ``first + 1`` lines per interval, and the counters
keep at most ``max_ids`` client ids. A pure state machine on an injected clock; ``run()``
is the task that ends intervals while no refusal comes.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter

from reach.clock import Clock, system_clock

__all__ = ["RefusalLog"]


class RefusalLog:
    """Refusals of ``what`` ("logins", "tokens") logged on ``logger`` at WARNING."""

    def __init__(
        self,
        logger: logging.Logger,
        what: str = "logins",
        *,
        who: str = "client ids",
        interval_sec: float = 10.0,
        first: int = 5,
        top: int = 3,
        max_ids: int = 1024,
        clock: Clock = system_clock,
    ) -> None:
        if interval_sec <= 0 or first < 0 or top < 0 or max_ids < 1:
            raise ValueError("need interval_sec > 0, first >= 0, top >= 0, max_ids >= 1")
        self._log = logger
        self.what = what
        #: what the ids counted are ("client ids", "agent ids")
        self.who = who
        self.interval_sec = interval_sec
        self.first = first
        self.top = top
        self.max_ids = max_ids
        self._clock = clock
        #: refusals since the start (for metrics)
        self.total = 0
        self._started = clock.monotonic()
        self._count = 0
        self._ids: Counter[str] = Counter()
        self._more_ids = False  # ids beyond max_ids were refused too
        self._reasons: Counter[str] = Counter()

    def refused(self, client_id: str, reason: str) -> None:
        """One refusal of ``client_id`` (as the client gave it) for ``reason``."""
        self.roll()
        self.total += 1
        self._count += 1
        shown = client_id[:64]
        if shown in self._ids or len(self._ids) < self.max_ids:
            self._ids[shown] += 1
        else:
            self._more_ids = True
        if reason in self._reasons or len(self._reasons) < 16:
            self._reasons[reason] += 1
        if self._count <= self.first:
            self._log.warning("%s refused for %r: %s", self.what, shown, reason)

    def roll(self) -> None:
        """End the interval if it is over: its summary, if some refusals were not logged."""
        now = self._clock.monotonic()
        if now - self._started < self.interval_sec:
            return
        if self._count > self.first:
            self._log.warning("%s", self.summary(now - self._started))
        self._started = now
        self._count = 0
        self._ids.clear()
        self._more_ids = False
        self._reasons.clear()

    def summary(self, elapsed: float) -> str:
        ids = f"{len(self._ids)}{'+' if self._more_ids else ''}"
        top = ", ".join(f"{cid!r} x{n}" for cid, n in self._ids.most_common(self.top))
        reasons = ", ".join(f"{r} x{n}" for r, n in self._reasons.most_common())
        return (
            f"refused {self._count} {self.what} for {ids} {self.who} in the last"
            f" {elapsed:.0f} s (top: {top}; {reasons})"
        )

    async def run(self) -> None:
        """End intervals on time while no refusal comes (run it as a task)."""
        while True:
            await asyncio.sleep(self.interval_sec)
            self.roll()
