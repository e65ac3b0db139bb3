"""Audit events: one per cross-agent call, written by the caller; denials by the denier.

On the hot path an event is a plain dict (building a model per call costs more than
the rest of the audit path); readers decode it into :class:`AuditEvent`, which is also
the documented shape (``schemas/audit-event.schema.json``). Events travel in batches:
one stream message holds a msgpack array of events of one capability, so the stream
is written a few times a second instead of once per call.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Literal

import msgpack
from pydantic import BaseModel, ConfigDict, Field, ValidationError

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
    "EVENT_VERSION",
    "REGISTRY_CAPABILITY",
    "AuditAttempt",
    "AuditEvent",
    "ErrorClass",
    "Outcome",
    "decode_batch",
    "decode_raw",
    "denial_event",
    "encode_batch",
    "error_class",
]

EVENT_VERSION = 1

#: how a call ended: served, failed, or answered by a fallback after a failure
Outcome = Literal["ok", "error", "fallback", "denied"]

#: what failed, in the operator's words (DESIGN: connect failure, timeout, business
#: rejection, breaker rejection, auth denial — and the rest of the tree)
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
    if isinstance(exc, RetriesExhausted) and isinstance(exc.__cause__, ReachError):
        exc = exc.__cause__
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


#: capability name on audit events about the registry itself (refused announces etc.)
REGISTRY_CAPABILITY = "_registry"


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
    trace_id: str = "",
) -> dict[str, Any]:
    """The audit event of a refusal, written by the side that refused."""
    return {
        "v": EVENT_VERSION,
        "side": side,
        "ts": ts,
        "capability": capability,
        "call_id": call_id,
        "trace_id": trace_id,
        "caller": caller,
        "caller_agent": caller_agent,
        "callee": callee,
        "outcome": "denied",
        "error": "denied",
        "code": code,
        "description": description,
        "latency_ms": 0.0,
        "candidates": [],
        "n_candidates": 0,
        "skipped": [],
        "attempts": [],
        "fallback": None,
        "fallback_reason": "",
    }


def encode_batch(events: Sequence[dict[str, Any]]) -> bytes:
    data: bytes = msgpack.packb(events, use_bin_type=True)
    return data


def decode_raw(data: bytes) -> list[dict[str, Any]]:
    """The event maps of one stream message, unvalidated (for fast consumers that read a
    few keys with ``.get``); anything that is not a map is left out."""
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception:
        return []
    items: Iterable[Any] = raw if isinstance(raw, list) else [raw]
    return [item for item in items if isinstance(item, dict)]


def decode_batch(data: bytes) -> tuple[list[AuditEvent], int]:
    """Events of one stream message, and how many entries were not valid events."""
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception:
        return [], 1
    items: Iterable[Any] = raw if isinstance(raw, list) else [raw]
    events: list[AuditEvent] = []
    bad = 0
    for item in items:
        try:
            events.append(AuditEvent.model_validate(item))
        except ValidationError:
            bad += 1
    return events, bad
