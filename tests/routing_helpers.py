"""Registry records for the routing, route cache and alert tests: an instance of
``echo_agent`` with the facts routing looks at (status, version, load, capabilities, SLA)."""

from __future__ import annotations

from typing import Any

from reach.wire.models import Instance, Manifest


def instance(
    agent_id: str,
    *,
    status: str = "healthy",
    version: str = "1.0.0",
    in_flight: int = 0,
    max_concurrency: int = 64,
    capabilities: tuple[str, ...] = ("echo",),
    sla_ms: float = 500.0,
) -> Instance:
    manifest = Manifest.model_validate(
        {
            "agent_id": agent_id,
            "agent_name": "echo_agent",
            "version": version,
            "max_concurrency": max_concurrency,
            "capabilities": [{"name": c, "latency_sla_ms": sla_ms} for c in capabilities],
        }
    )
    fields: dict[str, Any] = {
        "manifest": manifest,
        "instance_id": f"{agent_id}-i",
        "status": status,
        "registered_at": 1.0,
        "last_heartbeat_at": 1.0,
        "in_flight": in_flight,
        "max_concurrency": max_concurrency,
    }
    return Instance.model_validate(fields)
