"""Audit events as the writing side builds them: one typed record per event.

A caller writes one ``CallEvent`` per cross-agent call; a callee one per call whose
caller does not record it (a caller in another language, say: ``served_event``); a callee
or a registrar one per refusal (``denial_event``). Each call has one *primary* event, the
one counted as the call (``primary``): its caller's, else its callee's; the others (the
denials) add to it, and readers merge them by call id (``reach.audit.merge``).

The record is built with keyword arguments only, so two fields of the same type cannot
trade places at a call site, and its fields are read-only once built. The writer turns
it into the batch format (``reach.audit.batch``); readers decode batches into
``AuditEvent`` (``reach.audit.eventmodels``), the documented shape
(``schemas/audit-event.schema.json``), whose fields are the same.
"""

from __future__ import annotations

from typing import Final, Literal

from reach.errors import (
    AuthError,
    CircuitOpen,
    ContractError,
    Disconnected,
    DiscoveryError,
    NoResponders,
    ReachError,
    ReachTimeout,
    RemoteError,
    RetriesExhausted,
    Unavailable,
)

__all__ = [
    "ATTEMPT_FIELDS",
    "EVENT_FIELDS",
    "EVENT_VERSION",
    "REGISTRY_CAPABILITY",
    "AttemptRow",
    "CallEvent",
    "ErrorClass",
    "Outcome",
    "Side",
    "attempt",
    "denial_event",
    "error_class",
    "served_event",
]

#: version of an event's map (``AuditEvent.v``)
EVENT_VERSION = 1

#: how a call ended: served, failed, answered by a fallback after a failure, or refused
Outcome = Literal["ok", "error", "fallback", "denied"]

#: who wrote an event: the caller or the callee for calls, the side that refused for
#: denials
Side = Literal["caller", "callee", "registrar"]

#: what failed, in the operator's words (connect failure, timeout, business rejection,
#: breaker rejection, auth denial, and the rest of the error tree)
ErrorClass = Literal[
    "connect",
    "timeout",
    "business",
    "breaker",
    "denied",
    "contract",
    "unavailable",
    "discovery",
    "internal",
]


def error_class(exc: BaseException) -> ErrorClass:
    """The operator's name for what failed (a retried call: what the last attempt hit)."""
    if isinstance(exc, RetriesExhausted) and isinstance(exc.last, ReachError):
        exc = exc.last
    if isinstance(exc, AuthError):
        return "denied"
    if isinstance(exc, CircuitOpen):
        return "breaker"
    if isinstance(exc, ReachTimeout):
        return "timeout"
    if isinstance(exc, NoResponders | Disconnected):
        return "connect"
    if isinstance(exc, ContractError):
        return "contract"
    if isinstance(exc, Unavailable):
        return "unavailable"
    if isinstance(exc, DiscoveryError):
        return "discovery"
    if isinstance(exc, RemoteError):
        return "business" if exc.kind == "business" else "internal"
    return "internal"


#: capability name on audit events about the registry itself (refused announces etc.)
REGISTRY_CAPABILITY = "_registry"

#: the fields of an event, in the order a batch's rows hold them (a batch names them, so
#: readers do not guess); ``CallEvent`` has exactly these attributes
EVENT_FIELDS: tuple[str, ...] = (
    "side",
    "ts",
    "capability",
    "call_id",
    "trace_id",
    "caller",
    "caller_agent",
    "actor",
    "callee",
    "outcome",
    "error",
    "code",
    "description",
    "latency_ms",
    "candidates",
    "n_candidates",
    "skipped",
    "attempts",
    "fallback",
    "fallback_reason",
    "primary",
)
#: the fields of one attempt, in ``AttemptRow`` order
ATTEMPT_FIELDS: tuple[str, ...] = ("agent_id", "score", "outcome", "latency_ms")

#: one attempt of a call, in ATTEMPT_FIELDS order: the instance tried ('' = the
#: capability's queue group), its routing score, "ok" or the error class of the attempt,
#: and its latency. The call path keeps its route in this shape (``CallResult.route``);
#: ``attempt`` builds one by name.
AttemptRow = tuple[str, float | None, str, float]


def attempt(
    *, agent_id: str = "", score: float | None = None, outcome: str = "ok", latency_ms: float = 0.0
) -> AttemptRow:
    """One attempt, by field name."""
    return (agent_id, score, outcome, latency_ms)


class CallEvent:
    """One audit event: a call as its caller saw it, or a refusal as the refusing side
    saw it. Built once, by keyword, and not changed after (``AuditEvent`` documents each
    field)."""

    __slots__ = (
        "actor",
        "attempts",
        "call_id",
        "callee",
        "caller",
        "caller_agent",
        "candidates",
        "capability",
        "code",
        "description",
        "error",
        "fallback",
        "fallback_reason",
        "latency_ms",
        "n_candidates",
        "outcome",
        "primary",
        "side",
        "skipped",
        "trace_id",
        "ts",
    )

    def __init__(
        self,
        *,
        ts: float,
        capability: str,
        outcome: Outcome,
        side: Side = "caller",
        call_id: str = "",
        trace_id: str = "",
        caller: str = "",
        caller_agent: str | None = None,
        actor: str | None = None,
        callee: str = "",
        error: ErrorClass | None = None,
        code: str = "",
        description: str = "",
        latency_ms: float = 0.0,
        candidates: tuple[str, ...] = (),
        n_candidates: int = 0,
        skipped: tuple[str, ...] = (),
        attempts: tuple[AttemptRow, ...] = (),
        fallback: str | None = None,
        fallback_reason: str = "",
        primary: bool = True,
    ) -> None:
        #: who wrote it
        self.side: Final[Side] = side
        #: start of the call, Unix seconds
        self.ts: Final = ts
        self.capability: Final = capability
        self.call_id: Final = call_id
        self.trace_id: Final = trace_id
        #: client id of the caller, and the agent whose handler made the call, if any
        self.caller: Final = caller
        self.caller_agent: Final = caller_agent
        #: client id of the gateway that made the call for ``caller`` (an MCP or A2A
        #: gateway the caller logged in through), None when the caller made it itself
        self.actor: Final = actor
        #: the instance that answered (or was tried last)
        self.callee: Final = callee
        self.outcome: Final[Outcome] = outcome
        self.error: Final[ErrorClass | None] = error
        self.code: Final = code
        self.description: Final = description
        self.latency_ms: Final = latency_ms
        #: the first candidates by name, and how many there were
        self.candidates: Final = candidates
        self.n_candidates: Final = n_candidates
        #: instances passed over because their breaker was open
        self.skipped: Final = skipped
        self.attempts: Final = attempts
        #: where a fallback answer came from (cache, backup, default), and why
        self.fallback: Final = fallback
        self.fallback_reason: Final = fallback_reason
        #: the event counted as the call (see the module's docstring); False for denials,
        #: which add to their call's primary event
        self.primary: Final = primary

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in EVENT_FIELDS)
        return f"CallEvent({fields})"


def denial_event(
    *,
    side: Literal["callee", "registrar"],
    ts: float,
    capability: str,
    callee: str,
    call_id: str,
    code: str,
    description: str,
    caller: str = "",
    caller_agent: str | None = None,
    actor: str | None = None,
    trace_id: str = "",
) -> CallEvent:
    """The audit event of a refusal, written by the side that refused."""
    return CallEvent(
        side=side,
        ts=ts,
        capability=capability,
        call_id=call_id,
        trace_id=trace_id,
        caller=caller,
        caller_agent=caller_agent,
        actor=actor,
        callee=callee,
        outcome="denied",
        error="denied",
        code=code,
        description=description,
        primary=False,
    )


def served_event(
    *,
    ts: float,
    capability: str,
    callee: str,
    call_id: str,
    caller: str,
    caller_agent: str | None,
    trace_id: str,
    latency_ms: float,
    kind: str = "ok",
    code: str = "",
    description: str = "",
    actor: str | None = None,
) -> CallEvent:
    """The callee's event of a call it answered whose caller does not record it (the
    call's primary event): ``kind`` is "ok" or the error kind of its reply; ``actor``
    the gateway its call token names as making the call for ``caller``."""
    ok = kind == "ok"
    return CallEvent(
        side="callee",
        ts=ts,
        capability=capability,
        call_id=call_id,
        trace_id=trace_id,
        caller=caller,
        caller_agent=caller_agent,
        actor=actor,
        callee=callee,
        outcome="ok" if ok else "error",
        error=None if ok else _KIND_CLASS.get(kind, "internal"),
        code=code,
        description=description,
        latency_ms=latency_ms,
    )


#: the error class of a reply's error kind, as a callee answers it
_KIND_CLASS: dict[str, ErrorClass] = {
    "contract": "contract",
    "business": "business",
    "unavailable": "unavailable",
    "denied": "denied",
    "timeout": "timeout",
    "internal": "internal",
}
