"""What a call does when an attempt fails: retries, breakers, fallbacks.

- ``retry``: the retry policy: which failures are retried, when, and how often;
- ``backoff``: the wait between attempts and when to stop (tenacity strategies);
- ``retrybudget``: retries as a bounded share of first attempts, against retry storms;
- ``breaker``: a circuit breaker per instance;
- ``fallback``: what a call may fall back to (``Fallback``), ``fallbacks``: how it does.

The policies (``backoff``, ``retrybudget``, ``breaker``, ``fallback``) are pure logic
with time injected (:mod:`reach.clock`); ``retry`` and ``fallbacks`` run them for a call.
Only the policies are imported here.
"""

from reach.resilience.backoff import stop_at_deadline, stop_for_call, wait_backoff
from reach.resilience.breaker import (
    BreakerBoard,
    BreakerConfig,
    BreakerSnapshot,
    BreakerState,
    CircuitBreaker,
    StateListener,
)
from reach.resilience.retrybudget import RetryBudget

__all__ = [
    "BreakerBoard",
    "BreakerConfig",
    "BreakerSnapshot",
    "BreakerState",
    "CircuitBreaker",
    "RetryBudget",
    "StateListener",
    "stop_at_deadline",
    "stop_for_call",
    "wait_backoff",
]
