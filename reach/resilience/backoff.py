"""Tenacity strategies for the retry rule: "200 ms × 2^n plus 0–100 ms jitter, at most 3
retries, never past the deadline".

::

    AsyncRetrying(
        wait=wait_backoff(),
        stop=stop_for_call(deadline),  # = stop_after_attempt(4) | stop_at_deadline(deadline)
        retry=retry_if_exception(lambda e: isinstance(e, ReachError) and e.retryable),
        sleep=clock.sleep,  # the deadline's clock: a ManualClock in tests, no real waiting
    )

:class:`stop_at_deadline` reads ``retry_state.upcoming_sleep``, which tenacity sets before it
asks the stop strategy (tenacity >= 8.3; 9.x is what we test against).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import TYPE_CHECKING

from tenacity.stop import stop_after_attempt, stop_base
from tenacity.wait import wait_base

from reach.deadline import Deadline
from reach.errors import ConfigurationError

if TYPE_CHECKING:
    from tenacity import RetryCallState

__all__ = ["stop_at_deadline", "stop_for_call", "wait_backoff"]

# 2**40 × 0.2 s is ~7000 years: enough for any attempt count, and no float overflow
_MAX_EXPONENT = 40


class wait_backoff(wait_base):  # lowercase like tenacity's own strategies
    """Wait ``base × 2^(n-1) + jitter × rng()`` seconds after the n-th failed attempt:
    0.2, 0.4, 0.8 s plus up to 0.1 s by default. The jitter spreads the retries of callers
    that failed together, so they do not hit the next instance in step."""

    def __init__(
        self, base: float = 0.2, jitter: float = 0.1, rng: Callable[[], float] = random.random
    ) -> None:
        if not base >= 0 or not jitter >= 0:
            raise ConfigurationError(f"backoff base and jitter must be >= 0, got {base}, {jitter}")
        self.base = base
        self.jitter = jitter
        self.rng = rng

    def __call__(self, retry_state: RetryCallState) -> float:
        return self.delay(retry_state.attempt_number)

    def delay(self, retry: int) -> float:
        """The sleep before the ``retry``-th retry (1-based), outside tenacity."""
        exponent = min(max(retry - 1, 0), _MAX_EXPONENT)
        return self.base * (1 << exponent) + self.jitter * self.rng()


class stop_at_deadline(stop_base):
    """Stop when the coming sleep would end at or past the deadline, or would leave less than
    ``min_attempt_sec`` for the attempt.

    ``deadline`` None: no deadline, never stop for it.
    """

    def __init__(self, deadline: Deadline | None, *, min_attempt_sec: float = 0.0) -> None:
        self.deadline = deadline
        self.min_attempt_sec = min_attempt_sec

    def __call__(self, retry_state: RetryCallState) -> bool:
        deadline = self.deadline
        if deadline is None:
            return False
        return retry_state.upcoming_sleep + self.min_attempt_sec >= deadline.remaining()


def stop_for_call(
    deadline: Deadline | None, *, max_retries: int = 3, min_attempt_sec: float = 0.0
) -> stop_base:
    """Our stop rule: after ``max_retries`` retries (``max_retries + 1`` attempts) or at the
    deadline, whichever comes first."""
    if max_retries < 0:
        raise ConfigurationError(f"max_retries must be >= 0, got {max_retries}")
    return stop_after_attempt(max_retries + 1) | stop_at_deadline(
        deadline, min_attempt_sec=min_attempt_sec
    )
