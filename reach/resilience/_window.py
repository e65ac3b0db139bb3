"""A time-bucketed sliding window holding two counters, shared by the breaker and the budget."""

from __future__ import annotations

__all__ = ["SlidingCounts"]


class SlidingCounts:
    """Two running counts (``first``, ``second``) over the last ``window_sec`` seconds.

    The window is split into ``buckets`` equal buckets; a count expires when its bucket falls
    out of the window, so it lives between ``window_sec - window_sec/buckets`` and
    ``window_sec`` seconds. Adding is O(1); expiring costs one step per elapsed bucket, capped
    at ``buckets`` (after a long idle spell everything is cleared at once).
    """

    __slots__ = ("_firsts", "_head", "_n", "_seconds", "_width", "first", "second")

    def __init__(self, window_sec: float, buckets: int) -> None:
        self._n = buckets
        self._width = window_sec / buckets
        self._firsts = [0] * buckets
        self._seconds = [0] * buckets
        self._head = -1  # absolute number of the newest bucket; -1 = never used
        self.first = 0
        self.second = 0

    def roll(self, now: float) -> int:
        """Expire buckets that left the window at ``now``; return the slot for ``now``."""
        idx = int(now // self._width)
        steps = idx - self._head
        if steps > 0:
            n = self._n
            if steps >= n:
                self.reset()
            else:
                firsts, seconds = self._firsts, self._seconds
                for k in range(self._head + 1, idx + 1):
                    slot = k % n
                    self.first -= firsts[slot]
                    self.second -= seconds[slot]
                    firsts[slot] = 0
                    seconds[slot] = 0
            self._head = idx
        # a clock that went back (it should not) counts into the newest bucket
        return self._head % self._n

    def bump(self, slot: int, first: int, second: int) -> None:
        """Add to the bucket ``slot`` returned by :meth:`roll` just before."""
        self._firsts[slot] += first
        self._seconds[slot] += second
        self.first += first
        self.second += second

    def add(self, now: float, first: int, second: int) -> None:
        # ``bump(roll(now), ...)``, without the calls while ``now`` is in the newest bucket
        head = self._head
        slot = self.roll(now) if int(now // self._width) != head else head % self._n
        self._firsts[slot] += first
        self._seconds[slot] += second
        self.first += first
        self.second += second

    def reset(self) -> None:
        for slot in range(self._n):
            self._firsts[slot] = 0
            self._seconds[slot] = 0
        self.first = 0
        self.second = 0
