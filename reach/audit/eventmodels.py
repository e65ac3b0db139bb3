"""Audit events as readers see them: pydantic models of what the writer's batches hold
(``reach.audit.batch``), and the documented shape of the stream
(``schemas/audit-event.schema.json``).

Apart from the writing side, which runs on every call (``reach.audit.events.CallEvent``,
compiled by ``make build``): a model per event would cost the call path more than the
rest of auditing.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from reach.audit.decode import decode_events
from reach.audit.events import EVENT_VERSION, ErrorClass, Outcome, Side

__all__ = [
    "AuditAttempt",
    "AuditBatch",
    "AuditEvent",
    "AuditNotice",
    "AuditPlain",
    "decode_batch",
    "decode_notice",
]


class _Model(BaseModel):
    # readers accept events from newer writers: unknown keys are ignored. Each model
    # builds its validator when first used: a reader uses some of them
    model_config = ConfigDict(extra="ignore", frozen=True, defer_build=True)


class AuditAttempt(_Model):
    """One attempt of a call: where it went, how it was scored, how it ended."""

    agent_id: str = Field("", description="instance tried ('' = the capability's queue group)")
    score: float | None = Field(None, description="routing score when chosen (None: not ranked)")
    outcome: str = Field("ok", description="'ok' or the error class of this attempt")
    latency_ms: float = 0.0


class AuditEvent(_Model):
    """One audit record (stream REACH_AUDIT, subject
    ``reach.v1.audit.<capability>.<writer>``: the writer is the subject's, see
    ``reach.audit.provenance``)."""

    v: int = EVENT_VERSION
    side: Side = Field(
        "caller",
        description="who wrote it: the caller or the callee for calls, the denier for denials",
    )
    ts: float = Field(description="start of the call, Unix seconds")
    capability: str
    call_id: str = ""
    trace_id: str = ""
    caller: str = Field("", description="client id of the caller ('' on an open fabric)")
    caller_agent: str | None = Field(None, description="agent id when called from a handler")
    actor: str | None = Field(
        None,
        description="client id of the gateway (reach mcp, reach a2a) that made the call for"
        " the caller, who logged in through it: the call token names it (RFC 8693 act.sub);"
        " null when the caller made the call itself",
    )
    callee: str = Field("", description="agent id that answered (or was last tried)")
    outcome: Outcome
    error: ErrorClass | None = None
    code: str = ""
    description: str = ""
    latency_ms: float = 0.0
    candidates: list[str] = Field(
        default_factory=list, description="instances considered (first 16)"
    )
    n_candidates: int = 0
    skipped: list[str] = Field(
        default_factory=list, description="instances skipped because their breaker was open"
    )
    attempts: list[AuditAttempt] = Field(default_factory=list)
    fallback: str | None = Field(None, description="cache, backup or default when one answered")
    fallback_reason: str = ""
    primary: bool = Field(
        True,
        description="the event counted as the call: its caller's, else its callee's (a"
        " caller that does not record its calls); denials add to it under the same call_id",
    )

    @property
    def retries(self) -> int:
        return max(0, len(self.attempts) - 1)

    @property
    def answer_ms(self) -> float:
        """The latency every operator command shows (``reach.audit.stats.LATENCY``): the
        round trip of the attempt that answered, as the caller timed it. A callee's own
        event has no attempts: its handling time; a call no attempt answered: the whole
        call's time."""
        if self.attempts and self.attempts[-1].outcome == "ok":
            return self.attempts[-1].latency_ms
        return self.latency_ms


class AuditPlain(_Model):
    """The plain calls of a batch as columns: calls answered at the first attempt by the
    instance they went to, with nothing skipped and no fallback. Slot ``i`` of every
    column is one event; doubles are little-endian IEEE 754, indexes little-endian
    unsigned 16-bit. Its events have side ``caller``, outcome ``ok``, no error, and one
    attempt: ``{"agent_id": callee, "score", "outcome": "ok", "latency_ms":
    attempt_latency_ms}``."""

    n: int = Field(ge=0, description="events in the columns")
    capability: str
    side: Literal["caller", "callee"] = Field(
        "caller",
        description="whose events: a caller's, or a callee's (no candidates, no score, no"
        " attempts: candidates index an empty set, scores are NaN, attempt latency is latency)",
    )
    ts: bytes = Field(description="start of each call, Unix seconds (n doubles)")
    call_id: list[str]
    trace_id: bytes | list[str] = Field(
        description="16 bytes per event (32 lowercase hex digits), or the ids as text"
    )
    caller: bytes = Field(description="n indexes into values")
    caller_agent: bytes = Field(description="n indexes into values (null: not from a handler)")
    actor: bytes | None = Field(
        None,
        description="n indexes into values (null: no gateway made the call for its caller);"
        " absent when no call of the columns had an actor (from batch version 4)",
    )
    callee: bytes = Field(description="n indexes into values")
    latency_ms: bytes = Field(description="n doubles")
    candidates: bytes = Field(description="n indexes into candidate_sets")
    score: bytes = Field(description="n doubles, routing score of the instance (NaN: none)")
    attempt_latency_ms: bytes = Field(description="n doubles, latency of the one attempt")
    values: list[str | None] = Field(description="the names the index columns point to")
    candidate_sets: list[tuple[list[str], int]] = Field(
        description="[first candidates by name, how many there were]"
    )


class AuditBatch(_Model):
    """One message on ``reach.v1.audit.<capability>.<writer>``: the events of one capability.
    ``events`` holds rows: ``fields`` names the columns of each row (see ``AuditEvent``
    for their meaning) and ``attempt_fields`` the columns of each entry of a row's
    ``attempts``. Plain calls may be columns in ``plain`` instead, and ``positions``
    then says where each row falls among all the batch's events (the plain ones fill the
    other places, in order); a callee's plain events may be columns in ``served``, at
    ``served_positions``; columns carry ``actor`` when a call had one. A batch without
    positions lists the columns' events, then the rows, then the callee's columns'. A row
    has the fields its batch names: a field missing from ``fields`` reads as its default,
    so a writer may write only the fields it knows (a batch of rows alone is the
    simplest).

    ``calls`` and ``notable`` come before the events so a reader that only counts (the
    alert watcher) can stop there when no row needs a closer look."""

    v: Literal[4] = Field(description="the batch layout's version; readers refuse any other")
    fields: list[str]
    attempt_fields: list[str]
    calls: dict[str, int] | None = Field(
        None,
        description="calls in the batch by capability: its primary events (a caller's, or a"
        " callee's of a call its caller does not record)",
    )
    notable: int | None = Field(
        None, description="caller rows with retries, a breaker rejection or a failed handler"
    )
    positions: list[int] | None = Field(
        None, description="place of each row among all the events (with plain)"
    )
    plain: AuditPlain | None = None
    served: AuditPlain | None = Field(None, description="a callee's plain events (side 'callee')")
    served_positions: list[int] | None = Field(
        None, description="place of each of the callee's plain events among all the events"
    )
    events: list[list[Any]]


class AuditNotice(_Model):
    """One message on ``reach.v1.audited.<capability>.<writer>`` (core NATS, not stored): the
    writer of a batch says, once REACH_AUDIT acked it, where it is and what it holds. The
    registrars' alert rules count calls from these and fetch a batch (by ``seq``) only
    when ``notable`` says some of its rows need a closer look: no consumer on the stream."""

    seq: int = Field(ge=1, description="the batch's sequence in REACH_AUDIT")
    calls: dict[Annotated[str, Field(min_length=1)], Annotated[int, Field(ge=1)]] = Field(
        description="calls in the batch by capability (its primary events, see AuditBatch)"
    )
    notable: int = Field(
        ge=0, description="caller rows with retries, a breaker rejection or a failed handler"
    )
    dropped: int = Field(
        0,
        ge=0,
        description="events the writer dropped since its last notice (its memory and spool"
        " were full, or they could not be packed): the alert rules raise audit_dropped",
    )


def decode_notice(data: bytes) -> AuditNotice:
    """A notice from its JSON; ValueError (a pydantic ValidationError) names what is wrong."""
    return AuditNotice.model_validate_json(data, strict=True)


def decode_batch(data: bytes) -> tuple[list[AuditEvent], int]:
    """Events of one stream message, and how many of them were not valid events;
    ``BatchVersionError`` (a ``CodecError``) for a batch of another version."""
    decoded = decode_events(data)
    events: list[AuditEvent] = []
    bad = decoded.bad
    for item in decoded.events:
        try:
            events.append(AuditEvent.model_validate(item))
        except ValidationError:
            bad += 1
    return events, bad
