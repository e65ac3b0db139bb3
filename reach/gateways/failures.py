"""What a gateway tells its client of a failed fabric call: the layer that failed, and
the details the error carries, in the words every gateway uses."""

from __future__ import annotations

from typing import Any

from reach.errors import (
    AuthenticationFailed,
    AuthError,
    BusinessError,
    CircuitOpen,
    ContractError,
    NotAuthorized,
    ReachError,
    RemoteError,
    RetriesExhausted,
)

__all__ = ["failure_details", "layer_of"]


def layer_of(exc: ReachError) -> str:
    """The layer a failed call names: contract, discovery, routing, breaker,
    authentication, authorization, business, agent or config (the error tree's ``layer``,
    with the breaker, the two halves of security and the handler's refusals told apart;
    a call that ran out of retries names what its last attempt hit)."""
    if isinstance(exc, CircuitOpen):
        return "breaker"
    if isinstance(exc, AuthenticationFailed):
        return "authentication"
    if isinstance(exc, AuthError):
        return "authorization"
    if isinstance(exc, BusinessError):
        return "business"
    if isinstance(exc, RetriesExhausted) and isinstance(exc.last, ReachError):
        last = layer_of(exc.last)
        return "routing" if last in ("routing", "discovery") else last
    return exc.layer


def failure_details(exc: ReachError) -> dict[str, Any]:
    """The layer, the error's type and message, and what it carries: a contract's field
    and rule, a remote error's kind, code and agent, a refusal's clearance levels, a
    retried call's attempts."""
    details: dict[str, Any] = {
        "layer": layer_of(exc),
        "error": type(exc).__name__,
        "message": str(exc),
    }
    if isinstance(exc, ContractError):
        details.update(path=exc.path, rule=exc.rule)
    if isinstance(exc, RemoteError):
        details.update(kind=exc.remote_kind, code=exc.code, agent_id=exc.agent_id)
    if isinstance(exc, NotAuthorized):
        details.update(level_required=exc.level_required, level_held=exc.level_held)
    if isinstance(exc, RetriesExhausted):
        details["attempts"] = exc.attempts
    return details
