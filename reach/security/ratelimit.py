"""Limits by key (a client id, an agent id): wrong secrets, and requests per second.

``FailureLimiter`` slows down wrong secrets. A pure state machine on an injected clock,
so "a wrong secret tried many times is slowed down" is tested without sleeping.
After ``max_failures`` failures in a row (failures separated by less than
``window_sec`` of quiet), every further attempt is refused without checking the secret
until a back-off passes; the back-off doubles from ``base_delay_sec`` up to
``max_delay_sec`` with each failure after that. A success forgets the key; so does
``window_sec`` without a failure. Memory is bounded: at most ``max_tracked`` keys are
kept, the one that failed least recently is forgotten first. Every operation is O(1).

``RateByKey`` holds each key to a rate: a token bucket per key, refilled at the rate the
caller gives with each take (so the rate may depend on the key: an agent's health
interval), up to a burst. It keeps at most ``max_tracked`` keys and forgets them all when
full: the keys are identities NATS vouches for (a client's user, the agent id on a
subject its permissions hold it to), so filling it takes that many credentials.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from reach.clock import Clock, system_clock

__all__ = ["FailureLimiter", "RateByKey"]


@dataclass(slots=True)
class _Streak:
    failures: int
    last_failure: float
    blocked_until: float
    next_delay: float


class FailureLimiter:
    """Per-key (client id) failure counting with doubling back-off; monotonic clock."""

    def __init__(
        self,
        *,
        max_failures: int = 5,
        window_sec: float = 900.0,
        base_delay_sec: float = 1.0,
        max_delay_sec: float = 300.0,
        max_tracked: int = 10_000,
        clock: Clock = system_clock,
    ) -> None:
        if max_failures < 1 or max_tracked < 1:
            raise ValueError("max_failures and max_tracked must be at least 1")
        if not 0 < base_delay_sec <= max_delay_sec:
            raise ValueError("need 0 < base_delay_sec <= max_delay_sec")
        if window_sec <= 0:
            raise ValueError("window_sec must be positive")
        self.max_failures = max_failures
        self.window_sec = window_sec
        self.base_delay_sec = base_delay_sec
        self.max_delay_sec = max_delay_sec
        self.max_tracked = max_tracked
        self._clock = clock
        # least recently failed first: eviction pops from the front
        self._streaks: OrderedDict[str, _Streak] = OrderedDict()

    def __len__(self) -> int:
        return len(self._streaks)

    def retry_after(self, key: str) -> float:
        """Seconds until ``key`` may try again; 0.0 means check the secret now."""
        streak = self._streaks.get(key)
        if streak is None:
            return 0.0
        now = self._clock.monotonic()
        if now >= streak.blocked_until and now - streak.last_failure > self.window_sec:
            del self._streaks[key]
            return 0.0
        return max(0.0, streak.blocked_until - now)

    def failure(self, key: str) -> float:
        """Count a wrong secret for ``key``; returns the back-off now in force (0.0 if none)."""
        now = self._clock.monotonic()
        streak = self._streaks.get(key)
        if streak is None or now - streak.last_failure > self.window_sec:
            streak = _Streak(0, now, now, self.base_delay_sec)
            self._streaks[key] = streak
        streak.failures += 1
        streak.last_failure = now
        self._streaks.move_to_end(key)
        if len(self._streaks) > self.max_tracked:
            self._streaks.popitem(last=False)
        if streak.failures < self.max_failures:
            return 0.0
        streak.blocked_until = now + streak.next_delay
        delay = streak.next_delay
        streak.next_delay = min(self.max_delay_sec, streak.next_delay * 2)
        return delay

    def success(self, key: str) -> None:
        """The right secret: forget every failure of ``key``."""
        self._streaks.pop(key, None)


class RateByKey:
    """Per key: may it do one more thing now, at ``rate`` per second, ``burst`` at once?"""

    def __init__(self, burst: float, *, max_tracked: int = 1 << 18, clock: Clock = system_clock):
        if burst < 1 or max_tracked < 1:
            raise ValueError("burst and max_tracked must be at least 1")
        self.burst = burst
        self.max_tracked = max_tracked
        self._clock = clock
        #: key → [what it may still do, when that was computed]
        self._left: dict[str, list[float]] = {}
        #: takes refused since the start
        self.refused = 0

    def take(self, key: str, rate: float) -> bool:
        """True if ``key`` may do one more thing at ``rate`` per second (it then has);
        False if it is over its rate (counted in ``refused``)."""
        now = self._clock.monotonic()
        state = self._left.get(key)
        if state is None:
            if len(self._left) >= self.max_tracked:
                self._left.clear()
            self._left[key] = [self.burst - 1.0, now]
            return True
        left = state[0] + (now - state[1]) * rate
        state[1] = now
        if left < 1.0:
            state[0] = left
            self.refused += 1
            return False
        state[0] = (left if left < self.burst else self.burst) - 1.0
        return True
