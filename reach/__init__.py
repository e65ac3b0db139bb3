"""Agent-Reach: make AI agents reliably reachable by each other over NATS."""

from reach.agent import Agent
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
    ReachError,
    ReachTimeout,
    RegistrationRefused,
    RemoteError,
    RetriesExhausted,
    TransportError,
    Unavailable,
)
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

__all__ = [
    "Agent",
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
    "TransportError",
    "Unavailable",
    "current_call",
]
