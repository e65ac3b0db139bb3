"""JSON Schema files for every wire model, so agents in any language can speak Agent-Reach.

``export_schemas(directory)`` writes one ``<name>.schema.json`` per model; the files in
the repository's ``schemas/`` directory are its output and a test keeps them in step.

The msgpack envelope of :mod:`reach.wire.envelope` is plain dicts in the hot path; the
``RequestEnvelope``/``ReplyEnvelope`` models below mirror its keys for documentation
only (a test checks they agree with what ``pack_request``/``pack_ok``/``pack_error``
produce).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, RootModel, model_validator
from pydantic.config import JsonDict
from pydantic.json_schema import SkipJsonSchema

from reach.agent.jobs import JobRecord
from reach.audit.alerts import Alert
from reach.audit.eventmodels import AuditAttempt, AuditBatch, AuditEvent, AuditNotice
from reach.security.tokenexchange import TokenReply, TokenRequest
from reach.wire.envelope import MAX_BATCH_ITEMS
from reach.wire.models import (
    AnnounceReply,
    AnnounceRequest,
    Bye,
    Capability,
    HealthSettings,
    Heartbeat,
    HeartbeatReply,
    Instance,
    Manifest,
    ProbeReply,
    Readiness,
    RegistrarRecord,
    Transition,
)

__all__ = [
    "JSON_SCHEMA_DIALECT",
    "SCHEMA_BASE_URL",
    "WIRE_SCHEMAS",
    "EnvelopeError",
    "ErrorKind",
    "ReplyEnvelope",
    "RequestEnvelope",
    "WireSchema",
    "export_schemas",
    "render_schema",
]

JSON_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"
SCHEMA_BASE_URL = "https://agent-reach.dev/schemas/v1/"

#: the error kinds a failed reply may carry (``reach.wire.envelope.ERROR_KINDS``)
ErrorKind = Literal["business", "contract", "denied", "internal", "timeout", "unavailable"]


def _absent_when_unset(schema: JsonDict) -> None:
    # The key is omitted when unset; "default": null would contradict its non-null type.
    schema.pop("default", None)


class _Envelope(BaseModel):
    # Mirrors a msgpack map; unknown keys are ignored by the decoder, so allow them here too.
    model_config = ConfigDict(extra="allow", frozen=True, populate_by_name=True)


class RequestEnvelope(_Envelope):
    """The msgpack map around every call body on reach.v1.cap.<capability>[.<agent_id>].

    Optional keys are omitted, never sent as nil. The body stays msgpack bin bytes so
    the callee checks token and deadline before it decodes the payload.
    """

    v: Literal[1] = Field(description="protocol version; a callee refuses any other value")
    id: str = Field(
        min_length=1,
        max_length=128,
        description="call id, unique per logical call and kept across retries",
    )
    b: bytes = Field(
        b"",
        description="the request body: a msgpack-encoded value carried as msgpack bin bytes",
    )
    tok: str | SkipJsonSchema[None] = Field(
        None,
        json_schema_extra=_absent_when_unset,
        max_length=4096,
        description="the caller's access token",
    )
    dl: int | SkipJsonSchema[None] = Field(
        None,
        json_schema_extra=_absent_when_unset,
        description="absolute deadline in Unix milliseconds; the callee stops working past it",
    )
    ik: str | SkipJsonSchema[None] = Field(
        None,
        json_schema_extra=_absent_when_unset,
        max_length=4096,
        description="idempotency key: a callee runs a call with a key it has seen only once",
    )
    at: int = Field(1, ge=1, le=100, description="attempt number, 1 for the first try")
    tp: str | SkipJsonSchema[None] = Field(
        None,
        json_schema_extra=_absent_when_unset,
        max_length=4096,
        description="W3C trace context 'traceparent'",
    )
    ts: str | SkipJsonSchema[None] = Field(
        None,
        json_schema_extra=_absent_when_unset,
        max_length=4096,
        description="W3C trace context 'tracestate'",
    )
    from_: str | SkipJsonSchema[None] = Field(
        None,
        json_schema_extra=_absent_when_unset,
        alias="from",
        max_length=4096,
        description="the caller's agent id",
    )
    au: bool = Field(
        False,
        description="true: the caller records this call in REACH_AUDIT itself; absent or"
        " false: the callee records it (and says so with 'aud' in its ok reply)",
    )


class EnvelopeError(_Envelope):
    """Why a call failed: the 'err' map of a reply whose 'ok' is false."""

    kind: ErrorKind = Field(
        description=(
            "the error kind: 'contract' (input does not match the schema), 'business'"
            " (the handler refused), 'unavailable' (not ready, retry elsewhere), 'denied'"
            " (token or security level), 'timeout' (deadline passed), 'internal' (handler crashed)"
        )
    )
    code: str = Field(
        "",
        description="a short machine-readable code: a name, optionally followed by arguments"
        " after colons ('insufficient_level:3:2'); docs/protocol.md lists them",
    )
    desc: str = Field("", max_length=4096, description="a human-readable description")
    path: str = Field(
        "",
        max_length=4096,
        description="the field a contract error is about, as 'items[2].n' ('<root>': the"
        " whole payload); left out when there is none",
    )


class ReplyEnvelope(_Envelope):
    """The msgpack map around every call reply: a body 'b' when 'ok', else 'err'."""

    model_config = ConfigDict(
        json_schema_extra={
            "if": {"properties": {"ok": {"const": False}}},
            "then": {"required": ["err"]},
        }
    )

    v: Literal[1] = Field(description="protocol version")
    ok: bool = Field(description="true: the handler returned 'b'; false: 'err' says why not")
    b: bytes = Field(
        b"",
        description="the reply body when ok: a msgpack-encoded value carried as msgpack bin bytes",
    )
    err: EnvelopeError | SkipJsonSchema[None] = Field(
        None,
        json_schema_extra=_absent_when_unset,
        description="the failure (only when ok is false)",
    )
    by: str = Field("", description="the instance that answered")
    job: str = Field(
        "",
        max_length=128,
        description="set when an async-mode agent accepted the call as a job: its job id"
        " (the result appears in the KV bucket REACH_JOBS under key job.<job_id>)",
    )
    aud: bool = Field(
        False,
        description="true: the callee recorded this call in REACH_AUDIT (its request did not"
        " say 'au')",
    )

    @model_validator(mode="after")
    def _error_when_not_ok(self) -> ReplyEnvelope:
        if not self.ok and self.err is None:
            raise ValueError("a failed reply must carry 'err'")
        return self


_Token = Annotated[str, Field(min_length=1, max_length=32)]


class EnvelopeBatch(RootModel[list[tuple[_Token, bytes]]]):
    """Calls that travel together: a msgpack array of [token, request envelope] pairs (a
    caller's requests to one subject in one turn of its event loop), or of [token, reply
    envelope] pairs on the batch's reply subject. Each request is served as if it came
    alone; a reply that is a single envelope (a map) answers every request of the batch."""

    root: list[tuple[_Token, bytes]] = Field(min_length=1, max_length=MAX_BATCH_ITEMS)


@dataclass(frozen=True)
class WireSchema:
    """One exported schema: its file stem and the model it describes."""

    name: str
    model: type[BaseModel]
    description: str = ""

    @property
    def filename(self) -> str:
        return f"{self.name}.schema.json"


WIRE_SCHEMAS: tuple[WireSchema, ...] = (
    WireSchema("manifest", Manifest),
    WireSchema("capability", Capability),
    WireSchema("health-settings", HealthSettings),
    WireSchema("readiness", Readiness),
    WireSchema("announce-request", AnnounceRequest),
    WireSchema(
        "announce-reply",
        AnnounceReply,
        "The registrar's answer on reach.v1.announce.<agent_id>: accepted, or refused with a"
        " reason.",
    ),
    WireSchema("heartbeat", Heartbeat),
    WireSchema(
        "heartbeat-reply",
        HeartbeatReply,
        "The registrar's answer to a heartbeat or a bye; reannounce=true means the instance is"
        " no longer registered (evicted) and must announce again.",
    ),
    WireSchema("bye", Bye),
    WireSchema("probe-reply", ProbeReply),
    WireSchema("transition", Transition),
    WireSchema("instance", Instance),
    WireSchema("registrar-record", RegistrarRecord),
    WireSchema("request-envelope", RequestEnvelope),
    WireSchema("reply-envelope", ReplyEnvelope),
    WireSchema("envelope-error", EnvelopeError),
    WireSchema("envelope-batch", EnvelopeBatch),
    WireSchema(
        "token-request",
        TokenRequest,
        "A client's credentials on reach.v1.auth.token (never logged, never stored).",
    ),
    WireSchema(
        "token-reply",
        TokenReply,
        "The issuer's answer: an EdDSA-signed JWT, its expiry, the clearance level and the"
        " agent_id it is bound to.",
    ),
    WireSchema("job-record", JobRecord),
    WireSchema("audit-batch", AuditBatch),
    WireSchema(
        "audit-event",
        AuditEvent,
        "One audit event, as readers see it: in a batch (audit-batch) it is a row whose"
        " columns the batch's `fields` name.",
    ),
    WireSchema("audit-attempt", AuditAttempt),
    WireSchema("audit-notice", AuditNotice),
    WireSchema("alert", Alert),
)


def render_schema(entry: WireSchema) -> str:
    """The exact text of one schema file: sorted keys, 2-space indent, trailing newline."""
    schema: dict[str, Any] = entry.model.model_json_schema(by_alias=True, mode="validation")
    schema["$schema"] = JSON_SCHEMA_DIALECT
    schema["$id"] = SCHEMA_BASE_URL + entry.filename
    if entry.description and "description" not in schema:
        schema["description"] = entry.description
    return json.dumps(schema, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def export_schemas(directory: str | Path) -> list[Path]:
    """Write every wire schema into ``directory`` (created if needed); return the paths."""
    target = Path(directory)
    target.mkdir(parents=True, exist_ok=True)
    written = []
    for entry in WIRE_SCHEMAS:
        path = target / entry.filename
        path.write_bytes(render_schema(entry).encode("utf-8"))  # "\n" on every OS
        written.append(path)
    return written
