"""Resilience on the call path: circuit breakers, a retry budget and tenacity strategies.

Pure logic with time injected (:mod:`reach.clock`): nothing here sleeps, talks to NATS or
decides which errors count; the caller does, and reports outcomes.
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
from reach.resilience.budget import RetryBudget

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
