"""A2A Agent Cards of the fabric's agents, built from the route cache with the A2A SDK's
types: one card per agent name (all its live instances), whose skills are the
capabilities those instances serve.

A skill's id is the capability's name. A2A has no place for a skill's JSON Schemas, so
the card carries them in an extension (``SCHEMAS_EXTENSION``): per capability its input
and output schema, clearance level, latency SLA, idempotence and whether it runs as a job.

A card is served in the form of the A2A version its reader speaks (``card_version``):
1.0 (only 1.0's fields, so a strict 1.0 parser takes it) or 0.3 (``url``,
``preferredTransport``, ``protocolVersion``, ``security``), never a mix of the two;
``card_response`` gives it an ``ETag`` and a short ``Cache-Control``, and answers
``If-None-Match`` with 304.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from typing import Any, NamedTuple

from a2a.compat.v0_3.conversions import to_compat_agent_card
from a2a.types import (
    AgentCapabilities,
    AgentCard,
    AgentExtension,
    AgentInterface,
    AgentSkill,
    ClientCredentialsOAuthFlow,
    HTTPAuthSecurityScheme,
    OAuth2SecurityScheme,
    OAuthFlows,
    SecurityRequirement,
    SecurityScheme,
    StringList,
)
from google.protobuf.json_format import MessageToDict  # type: ignore[import-untyped]
from starlette.responses import Response

from reach.wire.models import Capability, Instance

__all__ = [
    "CARD_CACHE_CONTROL",
    "JSON",
    "LEGACY_CARD_PATH",
    "PROTOCOL_VERSIONS",
    "SCHEMAS_EXTENSION",
    "TEXT",
    "TOKEN_PATH",
    "Security",
    "agents_of",
    "capabilities_of",
    "card_document",
    "card_for",
    "card_response",
    "card_version",
    "index_entry",
    "runs_as_job",
    "security_of",
    "whole_numbers",
]

JSON = "application/json"
TEXT = "text/plain"
#: the A2A protocol versions an agent's JSON-RPC endpoint speaks: 1.0 (``SendMessage``,
#: ``GetTask``) and 0.3's method names (``message/send``, ``tasks/get``)
PROTOCOL_VERSIONS = ("1.0", "0.3")
#: the card extension that carries each skill's contract
SCHEMAS_EXTENSION = "urn:agent-reach:a2a:capability-contracts:v1"
#: at most this many of a schema's ``examples`` become a skill's examples
MAX_EXAMPLES = 5
#: where A2A before 0.3 put the card (0.3 and 1.0: ``/.well-known/agent-card.json``)
LEGACY_CARD_PATH = "/.well-known/agent.json"
#: how long a card may be reused unchecked: short, as cards change when agents come and go
CARD_CACHE_CONTROL = "public, max-age=30"
#: the OAuth token endpoint of the gateway's login, under its base URL
TOKEN_PATH = "/oauth/token"

_NUMBERS = re.compile(r"\d+")


def whole_numbers(value: Any) -> Any:
    """``value`` with its integral floats as ints: ``google.protobuf.Value``, which holds
    A2A's data parts and extension parameters, has only doubles."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    if isinstance(value, dict):
        return {k: whole_numbers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [whole_numbers(v) for v in value]
    return value


def agents_of(instances: Iterable[Instance]) -> dict[str, list[Instance]]:
    """Instances by agent name, names sorted, each name's instances by agent id."""
    by_name: dict[str, list[Instance]] = {}
    for inst in sorted(instances, key=lambda i: (i.manifest.agent_name, i.agent_id)):
        by_name.setdefault(inst.manifest.agent_name, []).append(inst)
    return by_name


def _version_key(version: str) -> tuple[tuple[int, ...], bool]:
    """Orders semantic versions: by the numbers of the core, a release above its
    pre-releases (build metadata ignored)."""
    core, _, pre = version.split("+", 1)[0].partition("-")
    return tuple(int(n) for n in _NUMBERS.findall(core)), not pre


def _newest_first(instances: Iterable[Instance]) -> list[Instance]:
    return sorted(instances, key=lambda i: _version_key(i.manifest.version), reverse=True)


def capabilities_of(instances: Iterable[Instance]) -> list[Capability]:
    """The capabilities the instances serve, by name; where instances of several versions
    describe one differently, the newest version's description wins."""
    found: dict[str, Capability] = {}
    for inst in _newest_first(instances):
        for cap in inst.manifest.capabilities:
            found.setdefault(cap.name, cap)
    return [found[name] for name in sorted(found)]


def runs_as_job(instances: Iterable[Instance], capability: str) -> bool:
    """Whether an instance serving ``capability`` runs it as a job (its mode is async)."""
    return any(
        inst.manifest.capability(capability) is not None
        and inst.manifest.mode_of(capability) == "async"
        for inst in instances
    )


def _examples(schema: dict[str, Any]) -> list[str]:
    """A JSON Schema's ``examples`` as JSON texts (a skill's examples are strings)."""
    examples = schema.get("examples")
    if not isinstance(examples, list):
        return []
    return [json.dumps(e, sort_keys=True, separators=(",", ":")) for e in examples[:MAX_EXAMPLES]]


def _skill(cap: Capability) -> AgentSkill:
    terms = [f"clearance level {cap.security_level}", f"SLA {cap.latency_sla_ms:g} ms"]
    if cap.idempotent:
        terms.append("idempotent")
    about = cap.description or f"The fabric capability {cap.name}."
    return AgentSkill(
        id=cap.name,
        name=cap.name,
        description=f"{about} ({', '.join(terms)})",
        tags=list(cap.tags) or [cap.name],
        examples=_examples(cap.input_schema),
        input_modes=[JSON, TEXT],
        output_modes=[JSON],
    )


def _contracts(instances: list[Instance], caps: list[Capability]) -> AgentExtension:
    params = {
        cap.name: {
            "input_schema": cap.input_schema,
            "output_schema": cap.output_schema,
            "security_level": cap.security_level,
            "latency_sla_ms": cap.latency_sla_ms,
            "idempotent": cap.idempotent,
            "job": runs_as_job(instances, cap.name),
        }
        for cap in caps
    }
    return AgentExtension(
        uri=SCHEMAS_EXTENSION,
        description="each skill's capability contract: JSON Schemas, clearance, SLA",
        required=False,
        params=params,
    )


class Security(NamedTuple):
    """A card's security schemes (by name) and requirements (any one of them will do)."""

    schemes: dict[str, SecurityScheme]
    requirements: list[SecurityRequirement]


def security_of(base_url: str, login: bool) -> Security:
    """What a card says of the gateway's login, at ``base_url``: with it, an OAuth 2
    client-credentials flow whose token endpoint is ``<base_url>/oauth/token`` and the
    bearer token that flow gives (a client holding a token already needs only the
    latter); without, nothing."""
    if not login:
        return Security({}, [])
    flow = ClientCredentialsOAuthFlow(
        token_url=base_url.rstrip("/") + TOKEN_PATH,
        scopes={"a2a": "call the fabric's agents through this gateway"},
    )
    oauth2 = OAuth2SecurityScheme(
        description="a client's id and secret exchanged for a bearer token",
        flows=OAuthFlows(client_credentials=flow),
    )
    bearer = HTTPAuthSecurityScheme(description="the token of the gateway's login", scheme="Bearer")
    return Security(
        {
            "oauth2": SecurityScheme(oauth2_security_scheme=oauth2),
            "bearer": SecurityScheme(http_auth_security_scheme=bearer),
        },
        [SecurityRequirement(schemes={name: StringList()}) for name in ("oauth2", "bearer")],
    )


def card_for(
    name: str,
    instances: list[Instance],
    url: str,
    security: Security | None = None,
    *,
    clearance: int = 4,
) -> AgentCard:
    """The Agent Card of agent ``name``, served by ``instances``, whose JSON-RPC endpoint
    is ``url``, under ``security`` (none by default), with the skills a caller of
    ``clearance`` may call. Under a login the card says that an extended card, with the
    skills of the caller who asks, is there (``GetExtendedAgentCard``)."""
    caps = [cap for cap in capabilities_of(instances) if cap.security_level <= clearance]
    newest = _newest_first(instances)[0].manifest.version if instances else "0.0.0"
    count = f"{len(instances)} live instance{'s' if len(instances) != 1 else ''}"
    description = (
        f"The Agent-Reach agent {name} ({count}). Each skill is one of its capabilities;"
        " a message to a skill is a fabric call to that capability, routed to its best"
        " instance, with retries."
    )
    return AgentCard(
        name=name,
        description=description,
        version=newest,
        supported_interfaces=[
            AgentInterface(url=url, protocol_binding="JSONRPC", protocol_version=version)
            for version in PROTOCOL_VERSIONS
        ],
        capabilities=AgentCapabilities(
            streaming=False,
            push_notifications=False,
            extensions=[_contracts(instances, caps)],
            extended_agent_card=security is not None and bool(security.schemes),
        ),
        default_input_modes=[JSON, TEXT],
        default_output_modes=[JSON],
        skills=[_skill(cap) for cap in caps],
        security_schemes=security.schemes if security else {},
        security_requirements=security.requirements if security else [],
    )


def card_version(requested: str | None, legacy_path: bool) -> str:
    """The A2A version of the card to serve: the version the request names (its
    ``A2A-Version`` header or parameter), 0.3 for a 0.x; without one, 0.3 at the path
    only A2A before 1.0 uses (``LEGACY_CARD_PATH``), else 1.0, the form A2A defines for
    ``/.well-known/agent-card.json``."""
    if requested and requested.strip():
        return "0.3" if requested.strip().startswith("0.") else "1.0"
    return "0.3" if legacy_path else "1.0"


def card_document(card: AgentCard, version: str) -> dict[str, Any]:
    """``card`` as the JSON of A2A ``version`` ("1.0" or "0.3")."""
    if version == "0.3":
        compat = to_compat_agent_card(card)
        return dict(whole_numbers(compat.model_dump(mode="json", exclude_none=True)))
    return dict(whole_numbers(MessageToDict(card)))


def _matches(if_none_match: str, etag: str) -> bool:
    """Whether an ``If-None-Match`` header names ``etag`` (weak comparison, RFC 9110)."""
    candidates = [c.strip().removeprefix("W/") for c in if_none_match.split(",")]
    return "*" in candidates or etag in candidates


def card_response(document: dict[str, Any], if_none_match: str | None) -> Response:
    """A card's HTTP answer: its JSON with an ``ETag`` (a hash of the body), a short
    ``Cache-Control`` and ``Vary: A2A-Version`` (the body depends on it), or 304 when
    ``if_none_match`` names that ETag."""
    body = json.dumps(document, ensure_ascii=False, separators=(",", ":")).encode()
    etag = f'"{hashlib.sha256(body).hexdigest()[:32]}"'
    headers = {"ETag": etag, "Cache-Control": CARD_CACHE_CONTROL, "Vary": "A2A-Version"}
    if if_none_match and _matches(if_none_match, etag):
        return Response(status_code=304, headers=headers)
    return Response(body, media_type=JSON, headers=headers)


def index_entry(name: str, instances: list[Instance], url: str, card_url: str) -> dict[str, Any]:
    """What the gateway's index says of one agent."""
    return {
        "name": name,
        "url": url,
        "card_url": card_url,
        "version": _newest_first(instances)[0].manifest.version if instances else "",
        "instances": len(instances),
        "skills": [cap.name for cap in capabilities_of(instances)],
    }
