"""Call statistics from audit events: per instance and per capability, over a window.

``reach agents`` reads the observed p99 from here, ``reach top`` its live view, and
``reach doctor`` the recent route decisions and breaker states. Their latency figures,
and the one ``reach audit tail`` prints first, are one measurement (``LATENCY``): per
instance and per capability, the same calls give the same figures.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from reach.audit.eventmodels import AuditAttempt, AuditEvent

__all__ = ["LATENCY", "CallStats", "Tally", "percentile"]

#: what the operator commands' latency figures measure (``AuditEvent.answer_ms``), said
#: in their headers in a few words: the answering attempt's round trip. A call's whole
#: time (``CallResult.latency_ms``; ``call`` in ``reach audit tail``) adds the caller's
#: own work to it: a first call's token fetch, retries and their back-off (the docs'
#: operations page says so at length)
LATENCY = "latency: round trip of the attempt that answered, as its caller timed it"


def percentile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) by nearest rank; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, int(q * len(ordered) + 0.999999) - 1))
    return ordered[rank]


@dataclass
class Tally:
    """Calls to one instance or capability within the window."""

    calls: int = 0
    ok: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    retries: int = 0
    fallbacks: int = 0
    breaker_skips: int = 0
    latencies: list[float] = field(default_factory=list)
    last_ts: float = 0.0
    last_error: str = ""

    def add(self, event: AuditEvent) -> None:
        """One call (to a capability, or to an instance when its attempts are unknown)."""
        self._count(
            event.ts, event.outcome == "ok", event.answer_ms,
            event.error or event.outcome, event.description,
        )  # fmt: skip
        if event.fallback:
            self.fallbacks += 1
        self.retries += event.retries

    def add_attempt(self, event: AuditEvent, attempt: AuditAttempt) -> None:
        """One attempt of ``event`` that went to this instance, with its own outcome and
        latency (a retried call's failure and wait belong to the instance that failed)."""
        last = event.attempts[-1] is attempt
        self._count(
            event.ts, attempt.outcome == "ok", attempt.latency_ms,
            attempt.outcome, event.description if last else "",
        )  # fmt: skip

    def _count(self, ts: float, ok: bool, latency_ms: float, kind: str, detail: str) -> None:
        self.calls += 1
        self.last_ts = max(self.last_ts, ts)
        if ok:
            self.ok += 1
            self.latencies.append(latency_ms)
        else:
            self.errors[kind] = self.errors.get(kind, 0) + 1
            self.last_error = f"{kind}: {detail}" if detail else kind

    @property
    def success_rate(self) -> float | None:
        return self.ok / self.calls if self.calls else None

    def p(self, q: float) -> float | None:
        return percentile(self.latencies, q)


class CallStats:
    """Aggregates the calls of audit events kept within ``window_sec`` of the newest: each
    call's primary event (its caller's, or its callee's when only that one recorded it),
    and the denials apart."""

    def __init__(self, window_sec: float = 60.0) -> None:
        self.window_sec = window_sec
        self._events: deque[AuditEvent] = deque()
        self.denials: deque[AuditEvent] = deque()

    def add(self, event: AuditEvent) -> None:
        if event.outcome == "denied" and event.side != "caller":
            self.denials.append(event)
        elif event.primary:
            self._events.append(event)

    def trim(self, now: float) -> None:
        for queue in (self._events, self.denials):
            while queue and queue[0].ts < now - self.window_sec:
                queue.popleft()

    @property
    def events(self) -> list[AuditEvent]:
        return list(self._events)

    def by_instance(self) -> dict[str, Tally]:
        """Per instance: every attempt it served or failed, skips of its open breaker."""
        out: dict[str, Tally] = {}
        for event in self._events:
            tried = [a for a in event.attempts if a.agent_id]
            if tried:
                for attempt in tried:
                    out.setdefault(attempt.agent_id, Tally()).add_attempt(event, attempt)
            elif event.callee:
                out.setdefault(event.callee, Tally()).add(event)
            for agent_id in event.skipped:
                out.setdefault(agent_id, Tally()).breaker_skips += 1
        return out

    def by_capability(self) -> dict[str, Tally]:
        out: dict[str, Tally] = {}
        for event in self._events:
            out.setdefault(event.capability, Tally()).add(event)
        return out

    def calls_per_sec(self, now: float) -> float:
        recent = [e for e in self._events if e.ts >= now - min(self.window_sec, 10.0)]
        return len(recent) / min(self.window_sec, 10.0)

    def open_breakers(self, now: float, within_sec: float = 30.0) -> dict[str, float]:
        """Instances recently skipped (or rejected) because a caller's breaker was open:
        agent id → when last seen."""
        seen: dict[str, float] = {}
        for event in self._events:
            if event.ts < now - within_sec:
                continue
            for agent_id in event.skipped:
                seen[agent_id] = max(seen.get(agent_id, 0.0), event.ts)
        return seen
