"""Requests per second by key (a client id, an agent id).

``RateByKey`` holds each key to a rate: a token bucket per key, refilled at the rate the
caller gives with each take (so the rate may depend on the key: an agent's health
interval), up to a burst. It keeps at most ``max_tracked`` keys and forgets them all when
full: the keys are identities NATS vouches for (a client's user, the agent id on a
subject its permissions hold it to), so filling it takes that many credentials.
"""

from __future__ import annotations

from reach.clock import Clock, system_clock

__all__ = ["RateByKey"]


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
