"""One call across its attempts: what routing, the attempts and the retry policy share."""

from __future__ import annotations

from collections.abc import Sequence

from reach.audit.recording import CallTrail
from reach.caller.routing import Aperture, RouteEntry
from reach.deadline import Deadline

__all__ = ["CallState", "has_other"]


class CallState(CallTrail):
    """State of one call across its attempts (the audit's part in ``CallTrail``)."""

    __slots__ = (
        "aperture",
        "attempt_timeout",
        "attempts",
        "deadline",
        "failed",
        "issuer_silent",
        "retry_timeouts",
        "score",
    )

    def __init__(
        self,
        capability: str,
        deadline: Deadline,
        attempt_timeout: float,
        started_at: float,
        candidates: Sequence[RouteEntry],
        tags: tuple[str, ...] = (),
    ) -> None:
        super().__init__(capability, started_at, candidates, tags)
        #: by when the call must be answered (every attempt, every retry's wait)
        self.deadline = deadline
        #: one attempt waits at most 1.5 × SLA, so a slow instance leaves time for another
        self.attempt_timeout = attempt_timeout
        self.attempts = 0
        #: instances this call failed on (not chosen again, but while the fabric settles)
        self.failed: set[str] = set()
        #: a timed-out attempt may be retried: the capability is idempotent or keyed
        self.retry_timeouts = False
        #: the token issuer did not answer for an attempt's instance: no retry waits for it
        self.issuer_silent = False
        #: routing score of the instance chosen last (None: the only candidate, not ranked)
        self.score: float | None = None
        #: this client's working set among the candidates, if they are its index's own
        self.aperture: Aperture | None = None


def has_other(state: CallState) -> bool:
    """Is there a healthy-looking candidate this call has not failed on yet?"""
    return any(e.agent_id not in state.failed and not e.unhealthy for e in state.candidates)
