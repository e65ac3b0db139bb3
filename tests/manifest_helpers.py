"""The annotated manifest example of docs/architecture.md ("The manifest"), for the tests
that validate, export and check manifests."""

from __future__ import annotations

from pathlib import Path

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
