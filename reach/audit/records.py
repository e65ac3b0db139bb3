"""Audit events as readers see them: pydantic models of the rows ``reach.audit.events``
writes, and the documented shape of the stream (``schemas/audit-event.schema.json``).

Apart from the writing side, which runs on every call (and is compiled, ``make build``).
"""

from __future__ import annotations

import contextlib
from typing import Any, Literal

import msgpack
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from reach.audit.events import EVENT_VERSION, ErrorClass, Outcome, decode_raw

__all__ = ["AuditAttempt", "AuditBatch", "AuditEvent", "decode_batch"]


class _Model(BaseModel):
    # readers accept events from newer writers: unknown keys are ignored
    model_config = ConfigDict(extra="ignore", frozen=True)


class AuditAttempt(_Model):
    """One attempt of a call: where it went, how it was scored, how it ended."""

    agent_id: str = Field("", description="instance tried ('' = the capability's queue group)")
    score: float | None = Field(None, description="routing score when chosen (None: not ranked)")
    outcome: str = Field("ok", description="'ok' or the error class of this attempt")
    latency_ms: float = 0.0


class AuditEvent(_Model):
    """One audit record (stream REACH_AUDIT, subject ``reach.v1.audit.<capability>``)."""

    v: int = EVENT_VERSION
    side: Literal["caller", "callee", "registrar"] = Field(
        "caller", description="who wrote it: the caller for calls, the denier for denials"
    )
    ts: float = Field(description="start of the call, Unix seconds")
    capability: str
    call_id: str = ""
    trace_id: str = ""
    caller: str = Field("", description="client id of the caller ('' on an open fabric)")
    caller_agent: str | None = Field(None, description="agent id when called from a handler")
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

    @property
    def retries(self) -> int:
        return max(0, len(self.attempts) - 1)


class AuditBatch(_Model):
    """One message on ``reach.v1.audit.<capability>``: the events of one capability as
    rows. ``fields`` names the columns of each row (see ``AuditEvent`` for their meaning)
    and ``attempt_fields`` the columns of each entry of a row's ``attempts``.

    ``calls`` and ``notable`` come before ``events`` so a reader that only counts (the
    alert watcher) can stop there when no row needs a closer look."""

    v: int = EVENT_VERSION
    fields: list[str]
    attempt_fields: list[str]
    calls: dict[str, int] | None = Field(
        None, description="calls recorded by callers (side 'caller'), by capability"
    )
    notable: int | None = Field(None, description="caller rows with retries or a breaker rejection")
    events: list[list[Any]]


def decode_batch(data: bytes) -> tuple[list[AuditEvent], int]:
    """Events of one stream message, and how many of its rows were not valid events."""
    try:
        batch = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception:
        return [], 1
    rows = batch.get("events") if isinstance(batch, dict) else None
    if not isinstance(rows, list):
        return [], 1
    events: list[AuditEvent] = []
    for item in decode_raw(data):
        with contextlib.suppress(ValidationError):
            events.append(AuditEvent.model_validate(item))
    return events, len(rows) - len(events)
