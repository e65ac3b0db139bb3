"""What a call returns: ``CallResult``."""

from __future__ import annotations

from typing import Any, Final

from reach.agent.jobs import JobHandle
from reach.audit.events import AttemptRow
from reach.resilience.fallback import FallbackInfo
from reach.wire.plain import Plain

__all__ = ["CallResult"]

#: CallResult's fields, in the constructor's order
_RESULT_FIELDS = (
    "value",
    "capability",
    "call_id",
    "agent_id",
    "attempts",
    "latency_ms",
    "fallback",
    "job",
    "route",
)


class CallResult(Plain):
    """What a call returned, who served it, and how (read-only).

    A plain class with read-only attributes rather than a frozen dataclass: one is built
    for every call, and compiled (``make build``) its constructor costs a fraction of a
    frozen dataclass's. Compiled, assigning to an attribute raises AttributeError.
    """

    __slots__ = _RESULT_FIELDS
    _NAMES = _RESULT_FIELDS

    def __init__(
        self,
        value: Any,
        capability: str,
        call_id: str,
        agent_id: str,
        attempts: int,
        latency_ms: float,
        fallback: FallbackInfo | None = None,
        job: JobHandle | None = None,
        route: tuple[AttemptRow, ...] = (),
    ) -> None:
        self.value: Final = value
        self.capability: Final = capability
        self.call_id: Final = call_id
        self.agent_id: Final = agent_id
        self.attempts: Final = attempts
        self.latency_ms: Final = latency_ms
        self.fallback: Final = fallback
        #: for async-mode capabilities: the accepted job (``await result.job.result()``)
        self.job: Final = job
        #: every attempt: (agent id, routing score or None, "ok" or error class, latency ms)
        self.route: Final = route

    @property
    def from_fallback(self) -> bool:
        return self.fallback is not None
