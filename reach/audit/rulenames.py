"""The names of the alert rules (``reach.audit.alerts``), apart from the rules: what
``reach alerts --rule`` offers is known without loading the engine and its models."""

from __future__ import annotations

from typing import Literal, get_args

__all__ = ["RULES", "RuleName"]

RuleName = Literal[
    "retry_storm",
    "unhealthy",
    "breaker_rejections",
    "instance_errors",
    "new_agent_probe_failed",
    "audit_dropped",
    "store_full",
]
RULES: tuple[str, ...] = get_args(RuleName)
