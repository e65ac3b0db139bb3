"""A2A Agent Cards of the fabric's agents, built from the route cache with the A2A SDK's
types: one card per agent name (all its live instances), whose skills are the
capabilities those instances serve.

A skill's id is the capability's name. A2A has no place for a skill's JSON Schemas, so
the card carries them in an extension (``SCHEMAS_EXTENSION``): per capability its input
and output schema, clearance level, latency SLA, idempotence and whether it runs as a job.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

from a2a.types import AgentCapabilities, AgentCard, AgentExtension, AgentInterface, AgentSkill

from reach.models import Capability, Instance

__all__ = [
    "JSON",
    "PROTOCOL_VERSIONS",
    "SCHEMAS_EXTENSION",
    "TEXT",
    "agents_of",
    "capabilities_of",
    "card_for",
    "index_entry",
    "runs_as_job",
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
    """Whether an instance serving ``capability`` runs it as a job (an async-mode agent)."""
    return any(
        inst.manifest.mode == "async"
        and any(cap.name == capability for cap in inst.manifest.capabilities)
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


def card_for(name: str, instances: list[Instance], url: str) -> AgentCard:
    """The Agent Card of agent ``name``, served by ``instances``, whose JSON-RPC endpoint
    is ``url``."""
    caps = capabilities_of(instances)
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
        ),
        default_input_modes=[JSON, TEXT],
        default_output_modes=[JSON],
        skills=[_skill(cap) for cap in caps],
    )


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
