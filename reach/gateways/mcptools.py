"""Capabilities as MCP tools, and call outcomes as MCP tool results.

One tool per capability on the fabric. Its name is the capability's name: capability
names are 1-128 letters, digits, ``_`` or ``-``, which MCP allows in tool names as they
are, so the mapping is the identity both ways. Its input schema is the capability's
``input_schema``; MCP wants a tool's arguments to be a JSON object, so a capability
whose input is not an object (a string, an array) takes it under one argument,
``input``. Its output schema is the capability's ``output_schema`` when that describes
an object (what MCP's structured content is); other answers come back as
``{"result": value}``.

Several instances may offer a capability; the tool shows the contract of the newest
manifest version (the lowest agent id among equals), so the listing does not change
with the order in which instances come and go.

A failed call is a tool error (``isError``) whose text starts with the layer that
failed (``contract``, ``discovery``, ``routing``, ``breaker``, ``authentication``,
``authorization``, ``business``, ``agent``, ``config``), so a model, or the person
reading its transcript, can tell a bad argument from a fabric that cannot reach the
agent; the structured content carries the same as ``{"error": {...}}``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from mcp_types import CallToolResult, TextContent, Tool, ToolAnnotations

from reach.errors import (
    ContractError,
    ReachError,
)
from reach.gateways.failures import failure_details
from reach.wire.models import Capability, Manifest

__all__ = [
    "WRAPPED_ARGUMENT",
    "ToolSpec",
    "answer",
    "catalogue",
    "payload_of",
    "refusal",
    "tool_of",
]

#: the one argument of a tool whose capability does not take a JSON object
WRAPPED_ARGUMENT = "input"


@dataclass(frozen=True)
class ToolSpec:
    """A capability as an MCP tool: the tool, and how its arguments become the payload."""

    capability: str
    tool: Tool
    #: the payload is the ``input`` argument (the capability does not take an object)
    wrapped: bool
    #: the clearance a caller needs to see and call the tool (the capability's level)
    level: int = 1


def _takes_object(schema: Mapping[str, Any]) -> bool:
    """Whether a schema describes JSON objects only (an empty schema: anything, so an
    object too, which is what MCP sends)."""
    kind = schema.get("type")
    if kind is None:
        return not schema or "properties" in schema or "required" in schema
    return bool(kind == "object")


def tool_of(cap: Capability) -> ToolSpec:
    """The MCP tool of one capability."""
    schema = dict(cap.input_schema)
    wrapped = not _takes_object(schema)
    if wrapped:
        input_schema: dict[str, Any] = {
            "type": "object",
            "properties": {WRAPPED_ARGUMENT: schema},
            "required": [WRAPPED_ARGUMENT],
            "additionalProperties": False,
        }
    else:
        input_schema = {"type": "object", **schema}
    output = cap.output_schema
    tool = Tool(
        name=cap.name,
        description=cap.description or f"the {cap.name} capability of the Agent-Reach fabric",
        input_schema=input_schema,
        output_schema=dict(output) if output and output.get("type") == "object" else None,
        annotations=ToolAnnotations(idempotent_hint=cap.idempotent),
    )
    return ToolSpec(cap.name, tool, wrapped, cap.security_level)


def _version_key(version: str) -> tuple[int, int, int, int, str]:
    """Semantic-version order: numbers first, a release after its pre-releases."""
    core, _, _build = version.partition("+")
    release, dash, pre = core.partition("-")
    parts = [int(p) if p.isdigit() else 0 for p in release.split(".")[:3]]
    parts += [0] * (3 - len(parts))
    return parts[0], parts[1], parts[2], 0 if dash else 1, pre


def catalogue(manifests: Iterable[Manifest]) -> dict[str, ToolSpec]:
    """The tools of the capabilities the manifests offer, by tool name, in name order."""
    chosen: dict[str, tuple[tuple[int, int, int, int, str], Capability]] = {}
    for manifest in sorted(manifests, key=lambda m: m.agent_id):
        key = _version_key(manifest.version)
        for cap in manifest.capabilities:
            held = chosen.get(cap.name)
            if held is None or key > held[0]:  # among equals the lowest agent id stays
                chosen[cap.name] = (key, cap)
    return {name: tool_of(chosen[name][1]) for name in sorted(chosen)}


def payload_of(spec: ToolSpec, arguments: Mapping[str, Any] | None) -> Any:
    """The payload of a call to ``spec``'s capability from a tool call's arguments."""
    args = dict(arguments or {})
    if not spec.wrapped:
        return args
    if set(args) != {WRAPPED_ARGUMENT}:
        raise ContractError(
            f"$: the {spec.capability} tool takes exactly one argument, {WRAPPED_ARGUMENT!r}"
            f" (got {sorted(args)})",
            path="$",
            rule="required",
        )
    return args[WRAPPED_ARGUMENT]


def _plain(value: Any) -> Any:
    """``value`` as JSON (bytes and other non-JSON values the codec decodes as text)."""
    return json.loads(json.dumps(value, ensure_ascii=False, default=str))


def answer(value: Any) -> CallToolResult:
    """A served call's tool result: the answer as structured content and as JSON text."""
    plain = _plain(value)
    structured = plain if isinstance(plain, dict) else {"result": plain}
    text = json.dumps(plain, ensure_ascii=False, sort_keys=True)
    return CallToolResult(content=[TextContent(text=text)], structured_content=structured)


def refusal(exc: ReachError) -> CallToolResult:
    """A failed call's tool error: the layer that failed first in its text."""
    details = failure_details(exc)
    text = f"{details['layer']} error ({details['error']}): {details['message']}"
    return CallToolResult(
        content=[TextContent(text=text)], structured_content={"error": details}, is_error=True
    )
