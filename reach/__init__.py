"""Agent-Reach: make AI agents reliably reachable by each other over NATS."""

from reach.agent import Agent
from reach.audit import (
    Alert,
    AlertRules,
    AuditEvent,
    AuditFilter,
    StreamSettings,
    WriterConfig,
    read_events,
)
from reach.client import CallResult, ReachClient
from reach.context import CallContext, current_call
from reach.errors import (
    AuthenticationFailed,
    AuthError,
    BusinessError,
    CircuitOpen,
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
from reach.fabric import Fabric
from reach.fallback import Fallback, FallbackInfo
from reach.jobs import JobHandle, JobRecord
from reach.models import (
    Capability,
    HealthSettings,
    Heartbeat,
    Instance,
    Manifest,
    Readiness,
)
from reach.registry import Registrar, RegistrarConfig
from reach.resilience import BreakerConfig, RetryBudget
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
