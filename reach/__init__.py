"""Agent-Reach: make AI agents reliably reachable by each other over NATS.

What an agent author writes: ``Agent`` and its capabilities, ``ReachClient`` and what a
call returns, the manifest's models, fallbacks, and the call being served; the errors
are in :mod:`reach.errors`. What operators run lives in its own package:
:mod:`reach.fabric` (``Fabric``: a fabric's servers and services), :mod:`reach.registry`
(the registrar), :mod:`reach.audit` (the audit stream, alerts).

The names below are imported on first use (``from reach import Agent`` imports what an
agent needs, and no more): ``import reach`` alone loads nothing else, so a process that
needs one part (the CLI, a test helper, the error classes) does not pay for NATS,
pydantic models, JSON Schema, OpenTelemetry and the rest at start.
"""

import typing as _typing

from reach import lazy as _lazy

if _typing.TYPE_CHECKING:
    from reach.agent.agent import Agent as Agent
    from reach.agent.context import CallContext as CallContext
    from reach.agent.context import current_call as current_call
    from reach.agent.jobs import JobHandle as JobHandle
    from reach.caller.client import ReachClient as ReachClient
    from reach.caller.result import CallResult as CallResult
    from reach.resilience.breaker import BreakerConfig as BreakerConfig
    from reach.resilience.fallback import Fallback as Fallback
    from reach.resilience.fallback import FallbackInfo as FallbackInfo
    from reach.resilience.retrybudget import RetryBudget as RetryBudget
    from reach.wire.models import Capability as Capability
    from reach.wire.models import HealthSettings as HealthSettings
    from reach.wire.models import Instance as Instance
    from reach.wire.models import Manifest as Manifest

#: each public name and the module it is imported from
_EXPORTS: dict[str, str] = {
    "Agent": "reach.agent.agent",
    "BreakerConfig": "reach.resilience.breaker",
    "CallContext": "reach.agent.context",
    "CallResult": "reach.caller.result",
    "Capability": "reach.wire.models",
    "Fallback": "reach.resilience.fallback",
    "FallbackInfo": "reach.resilience.fallback",
    "HealthSettings": "reach.wire.models",
    "Instance": "reach.wire.models",
    "JobHandle": "reach.agent.jobs",
    "Manifest": "reach.wire.models",
    "ReachClient": "reach.caller.client",
    "RetryBudget": "reach.resilience.retrybudget",
    "current_call": "reach.agent.context",
}
__all__ = list(_EXPORTS)

if not _typing.TYPE_CHECKING:  # type checkers read the imports above instead
    __getattr__, __dir__ = _lazy.exports(__name__, _EXPORTS, globals(), __all__)
