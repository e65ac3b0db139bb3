"""Wire models: the manifest and everything the registry stores or agents send.

The same models validate a YAML file, an announce message and a KV record, and
``reach schema export`` turns them into the JSON Schema files in ``schemas/``.
"""

from __future__ import annotations

import difflib
import functools
import math
import re
import secrets
from collections.abc import Iterable, Mapping
from typing import Annotated, Any, Literal, NamedTuple, Self

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidationError,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from reach.errors import ConfigurationError
from reach.wire import codec, subjects
from reach.wire.schemacheck import checked_json_schema

__all__ = [
    "FEATURES",
    "FEATURE_BATCH",
    "AnnounceReply",
    "AnnounceRequest",
    "Bye",
    "Capability",
    "HealthSettings",
    "HealthStatus",
    "Heartbeat",
    "HeartbeatReply",
    "Instance",
    "Manifest",
    "Mode",
    "ProbeReply",
    "Readiness",
    "RegistrarRecord",
    "RoutingFacts",
    "Transition",
    "clip_reason",
    "format_validation_error",
    "parse_manifest",
]

#: pydantic's errors of a value of the wrong type: the line says what was given
_TYPE_ERRORS = frozenset({"int_type", "float_type", "bool_type", "string_type"})
_KIND = {str: "the text", int: "the integer", float: "the number", bool: "the boolean"}


def format_validation_error(
    exc: ValidationError, *, root: str = "", known: Iterable[str] = ()
) -> list[str]:
    """Turn pydantic errors into ``capabilities[0].tags[2]: message`` lines; an unknown
    field close to one of the ``known`` names says which it may have meant."""
    lines = []
    for err in exc.errors(include_url=False):
        path = root
        for part in err["loc"]:
            if isinstance(part, int):
                path += f"[{part}]"
            else:
                path += f".{part}" if path else str(part)
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown field"
            field = err["loc"][-1] if err["loc"] else ""
            close = difflib.get_close_matches(str(field), list(known), n=1, cutoff=0.75)
            if close:
                msg += f" (did you mean {close[0]}?)"
        elif err["type"] in _TYPE_ERRORS:
            value = err["input"]
            shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:39] + "…"
            msg = f"{msg}, got {_KIND.get(type(value), type(value).__name__)} {shown}"
        elif err["type"] == "too_short" and err["loc"] == ("capabilities",):
            msg = "a manifest declares at least one capability"
        elif msg.startswith("Value error, "):
            msg = msg[len("Value error, ") :]
        lines.append(f"{path or '<root>'}: {msg}")
    return lines


_TAG_RE = re.compile(r"^[a-z0-9]+(?:-[a-z0-9]+)*$")
# semver.org's grammar
_SEMVER_RE = re.compile(
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-((?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(?:\.(?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*))?"
    r"(?:\+([0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*))?$"
)


def _subject_token(value: str) -> str:
    if not subjects.is_token(value):
        raise PydanticCustomError(
            "subject_token",
            "must be 1-128 letters, digits, '_' or '-' (a NATS subject token), got {value}",
            {"value": repr(value)},
        )
    return value


def _tag(value: str) -> str:
    if not _TAG_RE.fullmatch(value):
        raise PydanticCustomError(
            "tag_format",
            "must be lowercase words joined by '-', got {value}",
            {"value": repr(value)},
        )
    return value


def _semver(value: str) -> str:
    if not _SEMVER_RE.fullmatch(value):
        raise PydanticCustomError(
            "semver", "must be a semantic version like 1.2.3, got {value}", {"value": repr(value)}
        )
    return value


#: a capability's latency SLA at most (a day): a call's deadline is computed from it
MAX_SLA_MS = 24 * 3600 * 1000.0


#: characters of a reason (readiness, status, transition, bye) kept: the registrar copies
#: reasons into the record, which must stay small however long an agent's exception is
MAX_REASON = 500


def clip_reason(value: str) -> str:
    """``value`` cut to ``MAX_REASON`` characters (the last one an ellipsis)."""
    return value if len(value) <= MAX_REASON else value[: MAX_REASON - 1] + "…"


#: free text explaining a state, clipped to ``MAX_REASON`` characters
Reason = Annotated[str, AfterValidator(clip_reason)]

# WithJsonSchema: the exported schemas carry the same rules for agents in other languages.
SubjectToken = Annotated[
    str,
    AfterValidator(_subject_token),
    WithJsonSchema({"type": "string", "pattern": subjects.TOKEN_RE.pattern}),
]
Tag = Annotated[
    str, AfterValidator(_tag), WithJsonSchema({"type": "string", "pattern": _TAG_RE.pattern})
]
#: how a capability answers: with its result (sync), or with a job whose result is kept
#: in REACH_JOBS (async)
Mode = Literal["sync", "async"]
SemVer = Annotated[
    str, AfterValidator(_semver), WithJsonSchema({"type": "string", "pattern": _SEMVER_RE.pattern})
]
JsonSchema = Annotated[dict[str, Any], AfterValidator(checked_json_schema)]
HealthStatus = Literal["healthy", "degraded", "unhealthy"]

#: Wire features beyond the base protocol, announced by the instances that speak them.
#: "batch": the instance reads batches of requests (``envelope-batch``); callers send a
#: batch only to an instance that announced it.
FEATURE_BATCH = "batch"
#: the features this implementation's agents speak
FEATURES: tuple[str, ...] = (FEATURE_BATCH,)
_FEATURES_HELP = (
    'wire features the instance speaks beyond the base protocol ("batch"); unknown ones'
    " are kept and ignored"
)


class _Model(BaseModel):
    # no NaN or infinity anywhere: JSON has none, and an infinite SLA or time is a bug
    # that would surface far away (a deadline no one can compute, a record no one reads).
    # Each model builds its validator when first used, not at import: a process uses a
    # few of them (`reach validate` the manifest's alone), and building all of them is
    # most of what importing this module costs.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, defer_build=True)

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Self:
        """A copy with ``update`` applied; values computed once from the fields
        (``functools.cached_property``) are computed again for the copy, not copied."""
        copied = super().model_copy(update=update, deep=deep)
        for name in _computed_once(type(self)):
            copied.__dict__.pop(name, None)
        return copied


@functools.cache
def _computed_once(cls: type) -> tuple[str, ...]:
    """The ``functools.cached_property`` attributes of a class (its bases' included)."""
    return tuple(
        name
        for klass in cls.__mro__
        for name, value in vars(klass).items()
        if isinstance(value, functools.cached_property)
    )


class HealthSettings(_Model):
    """How the registrar watches an instance."""

    # strict numbers here and in Capability and Manifest: "2" in a manifest is refused as
    # `version: 1.0` is, not read as 2 (a number written as text is a mistake to point at)
    interval_sec: StrictFloat = Field(
        15.0, gt=0, le=3600, description="heartbeat and probe interval"
    )
    timeout_sec: StrictFloat = Field(3.0, gt=0, le=600, description="probe reply timeout")
    failures_before_unhealthy: StrictInt = Field(
        2, ge=1, le=100, description="consecutive probe failures or missed heartbeats"
    )


class Capability(_Model):
    """One thing an agent can do, with its contract and service level."""

    name: SubjectToken
    description: str = ""
    input_schema: JsonSchema = Field(default_factory=dict)
    output_schema: JsonSchema = Field(default_factory=dict)
    tags: list[Tag] = Field(default_factory=list, max_length=32)
    qps: StrictFloat | None = Field(None, gt=0, description="declared sustainable calls per second")
    latency_sla_ms: StrictFloat = Field(
        1000.0, gt=0, le=MAX_SLA_MS, description="P95 latency under good conditions"
    )
    # When in doubt, level high: a capability nobody classified is treated as a core asset.
    security_level: StrictInt = Field(4, ge=1, le=4)
    idempotent: StrictBool = False
    mode: Mode | None = Field(
        None,
        description=(
            "sync: the call waits for the handler's result; async: the call returns a job"
            " at once and the result is kept in REACH_JOBS. Unset: the agent's mode"
        ),
    )
    vendor: str | None = None
    version: SemVer | None = None


class Manifest(_Model):
    """An agent's business card, announced to the registrar."""

    agent_id: SubjectToken = Field(
        default="", description='unique per live instance; empty means "<agent_name>-<random>"'
    )
    agent_name: SubjectToken
    version: SemVer
    mode: Mode = Field("sync", description="the mode of the capabilities that do not say")
    capabilities: list[Capability] = Field(min_length=1)
    max_concurrency: StrictInt = Field(64, ge=1, le=100_000, description="calls handled at once")
    health: HealthSettings = Field(default_factory=HealthSettings)

    @model_validator(mode="before")
    @classmethod
    def _default_agent_id(cls, data: Any) -> Any:
        if (
            isinstance(data, dict)
            and not data.get("agent_id")
            and isinstance(data.get("agent_name"), str)
        ):
            # 119 + "-" + 8 hex digits stays within the 128 a subject token may have
            data = {**data, "agent_id": f"{data['agent_name'][:119]}-{secrets.token_hex(4)}"}
        return data

    @field_validator("capabilities")
    @classmethod
    def _unique_capabilities(cls, capabilities: list[Capability]) -> list[Capability]:
        seen: set[str] = set()
        for cap in capabilities:
            if cap.name in seen:
                raise PydanticCustomError(
                    "duplicate_capability",
                    "capability {name} is declared twice",
                    {"name": repr(cap.name)},
                )
            seen.add(cap.name)
        return capabilities

    def capability(self, name: str) -> Capability | None:
        for cap in self.capabilities:
            if cap.name == name:
                return cap
        return None

    def mode_of(self, name: str) -> Mode:
        """The mode of capability ``name``: its own, else the agent's."""
        cap = self.capability(name)
        return cap.mode if cap is not None and cap.mode is not None else self.mode

    @functools.cached_property
    def runs_jobs(self) -> bool:
        """Whether any of its capabilities runs as a job (it needs REACH_JOBS)."""
        return any((cap.mode or self.mode) == "async" for cap in self.capabilities)

    @functools.cached_property
    def highest_level(self) -> int:
        """The highest ``security_level`` among its capabilities (0 with none): the
        clearance a credential needs to serve them all (computed once: the registrar asks
        on every heartbeat)."""
        return max((cap.security_level for cap in self.capabilities), default=0)

    @functools.cached_property
    def stable(self) -> bool:
        """A release version (no pre-release part) is preferred by routing (computed once:
        routing asks for every candidate of every call)."""
        return "-" not in self.version.split("+", 1)[0]


#: readinesses without gauges already validated, by (ready, reason)
_READINESS_SEEN: dict[tuple[bool, str], Readiness] = {}
_READINESS_SEEN_MAX = 1024


class Readiness(_Model):
    """An agent's own view of whether it can do useful work (pools, queues, dependencies)."""

    ready: bool = True
    reason: Reason = Field("", description="why not ready (clipped to 500 characters)")
    details: dict[Reason, float | int | Reason | bool] = Field(
        default_factory=dict, max_length=32, description="gauges behind the answer (32 at most)"
    )

    @model_validator(mode="wrap")
    @classmethod
    def _without_gauges(
        cls, value: Any, handler: ModelWrapValidatorHandler[Readiness]
    ) -> Readiness:
        # most heartbeats and probe replies carry a readiness without gauges: validated
        # once per (ready, reason), then the same frozen answer (every field checked by
        # type here is what validation would give back unchanged)
        if type(value) is not dict or len(value) != 3:
            return handler(value)
        ready, reason, details = value.get("ready"), value.get("reason"), value.get("details")
        if type(ready) is not bool or type(reason) is not str or type(details) is not dict:
            return handler(value)
        if details:
            return handler(value)
        key = (ready, reason)
        known = _READINESS_SEEN.get(key)
        if known is None:
            if len(_READINESS_SEEN) >= _READINESS_SEEN_MAX:
                _READINESS_SEEN.clear()
            known = _READINESS_SEEN[key] = handler(value)
        return known

    @field_validator("details", mode="before")
    @classmethod
    def _finite_gauges(cls, value: Any) -> Any:
        # a gauge that came out NaN or infinite (0/0 in a ratio) is said as text: the
        # readiness still counts, and the record stays JSON
        if isinstance(value, dict):
            return {
                k: repr(v) if isinstance(v, float) and not math.isfinite(v) else v
                for k, v in value.items()
            }
        return value


class Heartbeat(_Model):
    """Sent by an instance every health interval on ``reach.v1.hb.<agent_id>``."""

    agent_id: SubjectToken
    instance_id: str = Field(min_length=1, max_length=64)
    seq: int = Field(ge=0)
    sent_at: float = Field(description="Unix seconds")
    in_flight: int = Field(ge=0)
    max_concurrency: int = Field(ge=1)
    last_completion_at: float | None = None
    completed: int = Field(0, ge=0, description="calls completed since start")
    memory_bytes: int = Field(0, ge=0)
    readiness: Readiness = Field(default_factory=Readiness)


class HeartbeatReply(_Model):
    ok: bool
    reason: str = ""
    #: the registrar no longer knows this instance (evicted): announce again
    reannounce: bool = False


class AnnounceRequest(_Model):
    """Sent on ``reach.v1.announce.<agent_id>``; the registrar answers with AnnounceReply."""

    manifest: Manifest
    instance_id: str = Field(min_length=1, max_length=64)
    started_at: float
    readiness: Readiness = Field(default_factory=Readiness)
    features: list[SubjectToken] = Field(
        default_factory=list, max_length=16, description=_FEATURES_HELP
    )


class AnnounceReply(_Model):
    accepted: bool
    reason: str = ""
    agent_id: str = ""
    registrar_id: str = ""


class Bye(_Model):
    """Graceful deregistration on ``reach.v1.bye.<agent_id>``."""

    agent_id: SubjectToken
    instance_id: str = Field(min_length=1, max_length=64)
    reason: Reason = "shutdown"


class ProbeReply(_Model):
    """An instance's answer to ``reach.v1.probe.<agent_id>``."""

    agent_id: str
    instance_id: str
    in_flight: int = Field(ge=0)
    max_concurrency: int = Field(ge=1)
    last_completion_at: float | None = None
    completed: int | None = Field(None, ge=0, description="calls completed since start")
    readiness: Readiness = Field(default_factory=Readiness)


class Transition(_Model):
    """A health change the registrar saw, kept on the record for ``reach doctor``."""

    at: float
    status: HealthStatus
    reason: Reason


class RoutingFacts(NamedTuple):
    """The facts of a registry record that routing scores (``Instance.routing_facts``)."""

    agent_id: str
    status: HealthStatus
    stable: bool
    in_flight: int
    max_concurrency: int
    #: latency_sla_ms of each capability the instance offers
    sla_ms: dict[str, float]


class Instance(_Model):
    """The registry record of one live agent instance (KV key ``agent.<agent_id>``)."""

    manifest: Manifest
    instance_id: str
    status: HealthStatus = "healthy"
    status_reason: Reason = ""
    registered_at: float
    last_heartbeat_at: float
    last_probe_at: float | None = None
    last_probe_ms: float | None = None
    consecutive_failures: int = 0
    in_flight: int = 0
    max_concurrency: int = 1
    completed: int = 0
    last_completion_at: float | None = None
    memory_bytes: int = 0
    readiness: Readiness = Field(default_factory=Readiness)
    registrar_id: str = ""
    transitions: list[Transition] = Field(default_factory=list)
    features: list[SubjectToken] = Field(
        default_factory=list, max_length=16, description=_FEATURES_HELP
    )

    @functools.cached_property
    def agent_id(self) -> str:
        """The manifest's agent id (kept: the registrar asks for it on every message)."""
        return self.manifest.agent_id

    @functools.cached_property
    def routing_facts(self) -> RoutingFacts:
        """What routing reads of this record on every call, gathered once: a record never
        changes (a heartbeat brings a new one), and touching these few values instead of
        the manifest's objects keeps a choice among thousands of instances cheap."""
        manifest = self.manifest
        return RoutingFacts(
            manifest.agent_id,
            self.status,
            manifest.stable,
            self.in_flight,
            self.max_concurrency,
            {cap.name: cap.latency_sla_ms for cap in manifest.capabilities},
        )

    @functools.cached_property
    def batches(self) -> bool:
        """Whether it reads batches of requests (asked on every call: computed once)."""
        return FEATURE_BATCH in self.features

    @property
    def load(self) -> float:
        """In-flight calls as a share of declared concurrency (0..1+)."""
        return self.in_flight / self.max_concurrency

    def age(self, now: float) -> float:
        return now - self.registered_at


class RegistrarRecord(_Model):
    """A live registrar (KV key ``registrar.<id>``), refreshed while it runs."""

    registrar_id: str
    started_at: float
    seen_at: float
    interval_sec: float
    store_problem: str = Field(
        "",
        max_length=4096,
        description=(
            "what the fabric's servers report wrong with its JetStream store (its disk"
            " full, JetStream disabled after a store error), said in the answer to a"
            " registrar ping; left out when nothing is (and from the record in the bucket)"
        ),
    )

    def encode(self) -> bytes:
        """Its msgpack form, ``store_problem`` left out when empty (a reader of a release
        before it refuses fields it does not know)."""
        value = self.model_dump(mode="json", exclude_defaults=True)
        data: bytes = codec.encode(value, checked=False)
        return data


def parse_manifest(data: Any, *, source: str = "manifest") -> Manifest:
    """Validate a manifest, raising ConfigurationError that lists every problem with its path."""
    try:
        return Manifest.model_validate(data)
    except ValidationError as exc:
        lines = format_validation_error(exc, known=_manifest_fields())
        # the checks across capabilities run only once each capability is valid: said
        # here too, so that one run lists every problem
        for line in _duplicate_names(data):
            if line not in lines:
                lines.append(line)
        raise ConfigurationError(f"invalid {source}", lines) from None


def _manifest_fields() -> set[str]:
    """Every field name a manifest may hold, at any depth."""
    return {name for model in (Manifest, Capability, HealthSettings) for name in model.model_fields}


def _duplicate_names(data: Any) -> list[str]:
    """The duplicate-capability lines of ``data`` as given (not validated)."""
    capabilities = data.get("capabilities") if isinstance(data, dict) else None
    if not isinstance(capabilities, list):
        return []
    names = [c.get("name") for c in capabilities if isinstance(c, dict)]
    twice = sorted({n for n in names if isinstance(n, str) and names.count(n) > 1})
    return [f"capabilities: capability {name!r} is declared twice" for name in twice]
