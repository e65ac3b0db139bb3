"""The payload every stack sends (about 200 bytes of msgpack) and its JSON Schema."""

from __future__ import annotations

from typing import Any

import msgpack

__all__ = ["PAYLOAD", "PAYLOAD_SCHEMA", "payload_bytes"]

#: a realistic request: ids, enums, numbers, a list and a nested object
PAYLOAD: dict[str, Any] = {
    "request_id": "req-7f3a9c2e41d8",
    "industry": "electric-vehicles",
    "time_range": "2025Q3",
    "region": "emea",
    "include_charts": True,
    "max_items": 25,
    "min_revenue": 1500000.0,
    "segments": ["battery", "charging"],
    "requested_by": {"team": "market-intel", "user": "analyst-042"},
}

#: what a careful team would declare for it: types, required fields, bounds, no extras
PAYLOAD_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "request_id": {"type": "string", "minLength": 1, "maxLength": 64},
        "industry": {"type": "string", "minLength": 1, "maxLength": 64},
        "time_range": {"type": "string", "pattern": "^[0-9]{4}(Q[1-4])?$"},
        "region": {"type": "string", "enum": ["amer", "apac", "emea", "global"]},
        "include_charts": {"type": "boolean"},
        "max_items": {"type": "integer", "minimum": 1, "maximum": 1000},
        "min_revenue": {"type": "number", "minimum": 0},
        "segments": {"type": "array", "items": {"type": "string"}, "maxItems": 32},
        "requested_by": {
            "type": "object",
            "properties": {"team": {"type": "string"}, "user": {"type": "string"}},
            "required": ["team", "user"],
        },
    },
    "required": ["request_id", "industry", "time_range"],
    "additionalProperties": False,
}


def payload_bytes() -> int:
    """Size of the payload as msgpack (what raw nats-py sends; Agent-Reach adds its envelope)."""
    return len(msgpack.packb(PAYLOAD, use_bin_type=True))
