"""A retry budget: retries may add at most a share of the first-attempt traffic.

Per-call limits (at most 3 retries) do not stop a retry storm: when a callee is down, every
call retries, tripling the load on whatever is left. A budget caps retries across calls:
within the sliding window, retries may be at most ``max(min_retries, ratio × calls)``. The
floor keeps a quiet caller able to retry at all; the default floor of 10 per minute matches
the alert rule "one caller retrying one callee more than 10 times within a minute".

Beyond that, up to ``min_per_sec`` retries are allowed in any one second whatever the
ratio says: a young caller (whose minute holds few calls yet) can still retry the burst of
failures of one instance that just died, while a storm stays capped at that many extra
requests a second per caller.
"""

from __future__ import annotations

import math

from reach.clock import Clock, system_clock
from reach.errors import ConfigurationError
from reach.resilience._window import SlidingCounts

__all__ = ["RetryBudget"]


class RetryBudget:
    """Call :meth:`record_call` on every first attempt and :meth:`try_spend` before a retry.

    Keep one per caller and callee (or capability). O(1) amortised, bucketed like the
    breaker; the default 60 buckets give a window that moves in 1 s steps.
    """

    __slots__ = (
        "_clock",
        "_second",
        "_second_spent",
        "_window",
        "min_per_sec",
        "min_retries",
        "ratio",
        "window_sec",
    )

    def __init__(
        self,
        *,
        ratio: float = 0.1,
        window_sec: float = 60.0,
        min_retries: int = 10,
        min_per_sec: float = 10,
        clock: Clock = system_clock,
        buckets: int = 60,
    ) -> None:
        problems: list[str] = []
        if isinstance(ratio, bool) or not (math.isfinite(ratio) and ratio >= 0):
            problems.append(f"ratio: must be a finite number >= 0, got {ratio!r}")
        if isinstance(window_sec, bool) or not (math.isfinite(window_sec) and window_sec > 0):
            problems.append(f"window_sec: must be a finite number > 0, got {window_sec!r}")
        if isinstance(min_retries, bool) or not isinstance(min_retries, int) or min_retries < 0:
            problems.append(f"min_retries: must be an integer >= 0, got {min_retries!r}")
        # typed float so that a compiled build refuses a fraction here too, with the
        # same ConfigurationError, rather than with a TypeError at the call
        if (
            isinstance(min_per_sec, bool)
            or not isinstance(min_per_sec, int | float)
            or not (math.isfinite(min_per_sec) and min_per_sec >= 0)
            or min_per_sec != int(min_per_sec)
        ):
            problems.append(f"min_per_sec: must be an integer >= 0, got {min_per_sec!r}")
        if isinstance(buckets, bool) or not isinstance(buckets, int) or buckets < 1:
            problems.append(f"buckets: must be an integer >= 1, got {buckets!r}")
        if problems:
            raise ConfigurationError("invalid retry budget", problems)
        self.ratio = ratio
        self.window_sec = window_sec
        self.min_retries = min_retries
        self.min_per_sec = int(min_per_sec)
        self._clock = clock
        # the whole second (monotonic) the per-second floor counts in, and its retries
        self._second = -1
        self._second_spent = 0
        # first = first attempts, second = retries
        self._window = SlidingCounts(window_sec, buckets)

    def record_call(self) -> None:
        """A first attempt was made (retries are not calls)."""
        self._window.add(self._clock.monotonic(), 1, 0)

    def try_spend(self) -> bool:
        """Take one retry from the budget; False (and nothing taken) if it is used up:
        the window's share is spent and so is this second's floor."""
        now = self._clock.monotonic()
        window = self._window
        slot = window.roll(now)
        second = int(now)
        if second != self._second:
            self._second = second
            self._second_spent = 0
        if (
            window.second + 1 > max(self.min_retries, self.ratio * window.first)
            and self._second_spent >= self.min_per_sec
        ):
            return False
        window.bump(slot, 0, 1)
        self._second_spent += 1
        return True

    @property
    def calls(self) -> int:
        """First attempts in the window."""
        window = self._window
        window.roll(self._clock.monotonic())
        return window.first

    @property
    def retries(self) -> int:
        """Retries spent in the window."""
        window = self._window
        window.roll(self._clock.monotonic())
        return window.second

    @property
    def available(self) -> int:
        """Retries that could be spent now (the window's share left, or this second's
        floor left if that is more)."""
        now = self._clock.monotonic()
        window = self._window
        window.roll(now)
        limit = max(self.min_retries, self.ratio * window.first)
        floor_left = self.min_per_sec - (self._second_spent if int(now) == self._second else 0)
        return max(0, math.floor(limit) - window.second, floor_left)

    def __repr__(self) -> str:
        return f"<RetryBudget retries={self.retries} calls={self.calls} ratio={self.ratio}>"
