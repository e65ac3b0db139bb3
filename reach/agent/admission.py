"""Admission by declared rate: a capability's ``qps`` as a token bucket.

A call over the rate its capability declared is answered ``unavailable`` at once
(``reach.agent.serving``), so its caller goes to another instance rather than queueing here.
"""

from __future__ import annotations

from reach.clock import Clock

__all__ = ["QpsBucket"]


class QpsBucket:
    """One capability's declared qps (None: no limit), with a burst of one second's worth."""

    def __init__(self, qps: float | None, clock: Clock) -> None:
        self._rate = qps
        self._burst = max(1.0, qps or 0.0)
        self._tokens = self._burst
        self._clock = clock
        self._last = clock.monotonic()

    def take(self) -> bool:
        if self._rate is None:
            return True
        now = self._clock.monotonic()
        self._tokens = min(self._burst, self._tokens + (now - self._last) * self._rate)
        self._last = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False
