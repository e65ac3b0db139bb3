"""Agent-Reach: make AI agents reliably reachable by each other over NATS.

The public names below are imported on first use (``from reach import Agent`` imports
what an agent needs, and no more): ``import reach`` alone loads nothing else, so a
process that needs one part (the CLI, a test helper, the error classes) does not pay for
NATS, pydantic models, JSON Schema, OpenTelemetry and the rest at start.
"""

import typing as _typing

from reach import lazy as _lazy

if _typing.TYPE_CHECKING:
    from reach.agent import Agent
    from reach.audit.alerts import (
        Alert,
        AlertRules,
    )
    from reach.audit.config import WriterConfig
    from reach.audit.reader import (
        AuditFilter,
        read_events,
    )
    from reach.audit.records import AuditEvent
    from reach.audit.streams import StreamSettings
    from reach.client import (
        CallResult,
        ReachClient,
    )
    from reach.context import (
        CallContext,
        current_call,
    )
    from reach.errors import (
        AuthenticationFailed,
        AuthError,
        BusinessError,
        CircuitOpen,
        ClearanceExceeded,
        CodecError,
        ConfigurationError,
        ContractError,
        Disconnected,
        DiscoveryError,
        InternalError,
        NoHealthyInstance,
        NoResponders,
        NotAuthorized,
        NotFound,
        PermissionDenied,
        ReachError,
        ReachTimeout,
        RegistrationRefused,
        RemoteError,
        RetriesExhausted,
        TransportError,
        Unavailable,
    )
    from reach.fabric.root import Fabric
    from reach.fallback import (
        Fallback,
        FallbackInfo,
    )
    from reach.jobs import (
        JobHandle,
        JobRecord,
    )
    from reach.models import (
        Capability,
        HealthSettings,
        Heartbeat,
        Instance,
        Manifest,
        Readiness,
    )
    from reach.registry.config import RegistrarConfig
    from reach.registry.registrar import Registrar
    from reach.resilience.breaker import BreakerConfig
    from reach.resilience.budget import RetryBudget
    from reach.runtime import tune_gc
    from reach.telemetry import Telemetry

__all__ = [
    "Agent",
    "Alert",
    "AlertRules",
    "AuditEvent",
    "AuditFilter",
    "AuthError",
    "AuthenticationFailed",
    "BreakerConfig",
    "BusinessError",
    "CallContext",
    "CallResult",
    "Capability",
    "CircuitOpen",
    "ClearanceExceeded",
    "CodecError",
    "ConfigurationError",
    "ContractError",
    "Disconnected",
    "DiscoveryError",
    "Fabric",
    "Fallback",
    "FallbackInfo",
    "HealthSettings",
    "Heartbeat",
    "Instance",
    "InternalError",
    "JobHandle",
    "JobRecord",
    "Manifest",
    "NoHealthyInstance",
    "NoResponders",
    "NotAuthorized",
    "NotFound",
    "PermissionDenied",
    "ReachClient",
    "ReachError",
    "ReachTimeout",
    "Readiness",
    "Registrar",
    "RegistrarConfig",
    "RegistrationRefused",
    "RemoteError",
    "RetriesExhausted",
    "RetryBudget",
    "StreamSettings",
    "Telemetry",
    "TransportError",
    "Unavailable",
    "WriterConfig",
    "current_call",
    "read_events",
    "tune_gc",
]

#: each public name and the module it is imported from
_EXPORTS: dict[str, str] = {
    "Agent": "reach.agent",
    "Alert": "reach.audit.alerts",
    "AlertRules": "reach.audit.alerts",
    "AuditEvent": "reach.audit.records",
    "AuditFilter": "reach.audit.reader",
    "AuthError": "reach.errors",
    "AuthenticationFailed": "reach.errors",
    "BreakerConfig": "reach.resilience.breaker",
    "BusinessError": "reach.errors",
    "CallContext": "reach.context",
    "CallResult": "reach.client",
    "Capability": "reach.models",
    "CircuitOpen": "reach.errors",
    "ClearanceExceeded": "reach.errors",
    "CodecError": "reach.errors",
    "ConfigurationError": "reach.errors",
    "ContractError": "reach.errors",
    "Disconnected": "reach.errors",
    "DiscoveryError": "reach.errors",
    "Fabric": "reach.fabric.root",
    "Fallback": "reach.fallback",
    "FallbackInfo": "reach.fallback",
    "HealthSettings": "reach.models",
    "Heartbeat": "reach.models",
    "Instance": "reach.models",
    "InternalError": "reach.errors",
    "JobHandle": "reach.jobs",
    "JobRecord": "reach.jobs",
    "Manifest": "reach.models",
    "NoHealthyInstance": "reach.errors",
    "NoResponders": "reach.errors",
    "NotAuthorized": "reach.errors",
    "NotFound": "reach.errors",
    "PermissionDenied": "reach.errors",
    "ReachClient": "reach.client",
    "ReachError": "reach.errors",
    "ReachTimeout": "reach.errors",
    "Readiness": "reach.models",
    "Registrar": "reach.registry.registrar",
    "RegistrarConfig": "reach.registry.config",
    "RegistrationRefused": "reach.errors",
    "RemoteError": "reach.errors",
    "RetriesExhausted": "reach.errors",
    "RetryBudget": "reach.resilience.budget",
    "StreamSettings": "reach.audit.streams",
    "Telemetry": "reach.telemetry",
    "TransportError": "reach.errors",
    "Unavailable": "reach.errors",
    "WriterConfig": "reach.audit.config",
    "current_call": "reach.context",
    "read_events": "reach.audit.reader",
    "tune_gc": "reach.runtime",
}

if not _typing.TYPE_CHECKING:  # type checkers read the imports above instead
    __getattr__, __dir__ = _lazy.exports(__name__, _EXPORTS, globals(), __all__)
