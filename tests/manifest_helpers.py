"""Manifests for the tests: the annotated example of docs/architecture.md ("The
manifest"), for the tests that validate, export and check manifests, and manifests
whose SLA or schema no caller could follow."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .calls_helpers import capability

ARCHITECTURE = Path(__file__).resolve().parent.parent / "docs" / "architecture.md"

#: verbatim from docs/architecture.md (a test holds the two equal)
MANIFEST_EXAMPLE = """\
agent_id: agent-report-gen-001      # optional: omitted → "<agent_name>-<random>"; unique per live instance
agent_name: report_generator
version: 2.3.1
mode: async                          # sync | async
capabilities:
  - name: generate_industry_report   # letters, digits, '_' and '-' (a NATS subject token)
    description: Structured report for an industry and time range
    input_schema:                    # JSON Schema
      type: object
      properties:
        industry: {type: string}
        time_range: {type: string}
        include_charts: {type: boolean}
      required: [industry, time_range]
    output_schema:
      type: object
      properties:
        report_id: {type: string}
        status: {type: string}
        download_url: {type: string}
    tags: [report-generate, industry, analytics]
    qps: 10
    latency_sla_ms: 5000
    security_level: 2                # 1..4
    idempotent: false
health:
  interval_sec: 15
  timeout_sec: 3
  failures_before_unhealthy: 2
"""  # noqa: E501 (verbatim from docs/architecture.md)


#: the longest latency SLA a manifest may declare, a day (reach.wire.models.MAX_SLA_MS),
#: spelled out: the tests hold the code to the documented limit
MAX_SLA_MS = 24 * 3600 * 1000.0


def manifest_with_sla(sla: float) -> dict[str, Any]:
    return {
        "agent_id": "slow-1",
        "agent_name": "slow",
        "version": "1.0.0",
        "capabilities": [capability("work", sla_ms=sla)],
    }


def manifest_with_schema(agent_id: str, bound: float) -> dict[str, Any]:
    return {
        "agent_id": agent_id,
        "agent_name": "nan",
        "version": "1.0.0",
        "capabilities": [
            {
                "name": "work",
                "security_level": 1,
                "input_schema": {
                    "type": "object",
                    "properties": {"x": {"type": "number", "maximum": bound}},
                },
            }
        ],
        "health": {"interval_sec": 3600, "timeout_sec": 5},
    }
