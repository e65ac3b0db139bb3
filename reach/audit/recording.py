"""A caller's record of its calls: one audit event per call, and its metrics and span.

A call keeps its trail as it goes (``CallTrail``: where it started, the candidates it
was routed among, every attempt); once it ends, ``CallRecorder`` turns the trail and
the outcome into a ``CallEvent`` for the audit writer (queued, never waited for), ends
the call's span and counts it in the call metrics.

A gateway calls for the clients that logged in through it (``acting_for`` of
``reach.security.membership``): the event of such a call names that client as its caller and
the gateway as its actor, so the trail says who asked for the call and who made it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from reach.agent.context import current_call
from reach.audit.events import AttemptRow, CallEvent, ErrorClass, Outcome, error_class
from reach.audit.writer import AuditWriter
from reach.caller.routing import RouteEntry
from reach.clock import Clock
from reach.errors import ReachError, RemoteError
from reach.resilience.fallback import FallbackInfo
from reach.security.membership import acting_session
from reach.telemetry import Span, Telemetry, end_span, trace_id_of
from reach.wire.envelope import RequestMeta

__all__ = ["CallRecorder", "CallTrail", "FirstNames"]

#: the agent ids of the first few candidates of a call, by capability, tags and the
#: candidates the route cache gave the call (it keeps the names with its index)
FirstNames = Callable[[str, tuple[str, ...], Sequence[RouteEntry]], tuple[str, ...]]


class CallTrail:
    """What a call leaves for its audit event as it goes: when it started, the candidates
    it was routed among, the instances it passed over, each attempt, and who answered.
    The caller's state of a call (``reach.caller.callstate.CallState``) extends it."""

    __slots__ = (
        "candidates",
        "capability",
        "last_target",
        "route",
        "skipped",
        "span",
        "started_at",
        "tags",
    )

    def __init__(
        self,
        capability: str,
        started_at: float,
        candidates: Sequence[RouteEntry],
        tags: tuple[str, ...] = (),
    ) -> None:
        self.capability = capability
        #: wall time the call started (the event's ``ts``)
        self.started_at = started_at
        #: the instances the call was routed among, and the tags each of them carries
        self.candidates = candidates
        self.tags = tags
        #: the instance tried last (or that answered); "" for the capability's queue group
        self.last_target = ""
        #: per attempt: (agent id, score, "ok" or error class, latency ms)
        self.route: list[AttemptRow] = []
        #: instances passed over because their breaker was open
        self.skipped: list[str] = []
        #: the call's CLIENT span, when tracing is on
        self.span: Span | None = None


class CallRecorder:
    """Turns finished calls into audit events, metrics and ended spans.

    ``audit``: the writer (None: no audit); ``caller``: the client id events name as the
    caller (set once the client knows it), unless the call is made for another client
    (``parties``); ``names``: the first candidates by name."""

    def __init__(self, telemetry: Telemetry, clock: Clock, names: FirstNames) -> None:
        self.audit: AuditWriter | None = None
        self.telemetry = telemetry
        self.caller = ""
        self._clock = clock
        self._names = names

    def parties(self) -> tuple[str, str | None]:
        """Who the event of a call made here names: its caller, and its actor. A call
        made for a client that logged in through this one (a gateway's, in
        ``acting_for``) names that client as the caller and the gateway as the actor:
        the client whose session acts for it, else this client, which made the call (no
        actor when that is the caller itself)."""
        acting = acting_session()
        if acting is None:
            return self.caller, None
        gateway = acting.actor
        caller = acting.client_id
        actor = gateway.client_id if gateway is not None else self.caller
        return caller, actor if actor != caller else None

    def served(
        self, trail: CallTrail, meta: RequestMeta, latency_ms: float, route: tuple[AttemptRow, ...]
    ) -> None:
        """A call that returned a value (its route given once, shared with its result).
        A plain one, the common case (answered at its first attempt by the instance it
        went to, nothing skipped, no span, no metrics), goes to the writer's columns by
        its fields, with no event built."""
        if trail.span is not None or self.telemetry.metrics_on:
            self._write(self.event(trail, meta, latency_ms, route), None, trail.span)
            return
        audit = self.audit
        if audit is None:
            return
        if len(route) == 1 and not trail.skipped:
            agent_id, score, outcome, attempt_ms = route[0]
            callee = trail.last_target
            # (a NaN score would read back as None from the columns: a row keeps it)
            if outcome == "ok" and agent_id == callee and (score is None or score == score):
                candidates = trail.candidates
                caller, actor = self.parties()
                audit.record_plain(
                    capability=trail.capability, ts=trail.started_at, call_id=meta.call_id,
                    trace_id=trace_id_of(meta.traceparent), caller=caller,
                    caller_agent=meta.caller, callee=callee, latency_ms=latency_ms,
                    candidates=self._names(trail.capability, trail.tags, candidates),
                    n_candidates=len(candidates), score=score, attempt_latency_ms=attempt_ms,
                    actor=actor,
                )  # fmt: skip
                return
        audit.record(self.event(trail, meta, latency_ms, route))

    def failed(
        self,
        capability: str,
        trail: CallTrail | None,
        meta: RequestMeta | None,
        latency_ms: float,
        exc: ReachError,
        fallback: FallbackInfo | None = None,
    ) -> None:
        """A call that failed (``fallback``: then answered by it). Without a trail it
        failed before it was sent: its payload broke the contract, say."""
        error = error_class(exc)
        if self.audit is None and not self.telemetry.metrics_on:
            end_span(trail.span if trail is not None else None, error)
            return
        outcome: Outcome = "error" if fallback is None else "fallback"
        code = getattr(exc, "code", "") or ""
        description = exc.description if isinstance(exc, RemoteError) else str(exc)
        if trail is not None and meta is not None:
            event = self.event(
                trail,
                meta,
                latency_ms,
                tuple(trail.route),
                outcome,
                error,
                code,
                description,
                fallback,
            )
            self._write(event, error, trail.span)
            return
        parent = current_call()
        caller, actor = self.parties()
        event = CallEvent(
            ts=self._clock.time() - latency_ms / 1000,
            capability=capability,
            caller=caller,
            caller_agent=parent.agent_id if parent is not None else None,
            actor=actor,
            outcome=outcome,
            error=error,
            code=code,
            description=description,
            latency_ms=latency_ms,
            fallback=fallback.source if fallback is not None else None,
            fallback_reason=fallback.reason if fallback is not None else "",
        )
        self._write(event, error, None)

    def event(
        self,
        trail: CallTrail,
        meta: RequestMeta,
        latency_ms: float,
        route: tuple[AttemptRow, ...],
        outcome: Outcome = "ok",
        error: ErrorClass | None = None,
        code: str = "",
        description: str = "",
        fallback: FallbackInfo | None = None,
    ) -> CallEvent:
        """The caller's audit event of a call (the writer keeps a plain call, answered at
        the first attempt, as a few column slots)."""
        candidates = trail.candidates
        caller, actor = self.parties()
        return CallEvent(
            ts=trail.started_at,
            capability=trail.capability,
            call_id=meta.call_id,
            trace_id=trace_id_of(meta.traceparent),
            caller=caller,
            caller_agent=meta.caller,  # the agent whose handler made this call, if any
            actor=actor,
            callee=trail.last_target,
            outcome=outcome,
            error=error,
            code=code,
            description=description,
            latency_ms=latency_ms,
            # the first few by name and how many: not a walk over every instance
            candidates=self._names(trail.capability, trail.tags, candidates),
            n_candidates=len(candidates),
            skipped=tuple(trail.skipped),
            attempts=route,
            fallback=fallback.source if fallback is not None else None,
            fallback_reason=fallback.reason if fallback is not None else "",
        )

    def _write(self, event: CallEvent, error: ErrorClass | None, span: Span | None) -> None:
        """The event to the writer (queued, never waited for) and the metrics; the span
        ends."""
        end_span(span, error)
        if self.audit is not None:
            self.audit.record(event)
        if self.telemetry.metrics_on:
            self.telemetry.record_call(event)
