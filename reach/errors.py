"""The one exception tree of Agent-Reach.

Every error names the layer that failed, so a caller can tell a missing agent from a
contract mismatch from a routing failure without reading logs::

    ReachError                                   .retryable decides retries, in one place
    ├── ConfigurationError (also ValueError)     bad manifest, bad option
    ├── ContractError                            payload does not match the schema; names the field
    │   └── CodecError                           bytes that are not a valid Agent-Reach message
    ├── DiscoveryError
    │   ├── NotFound                             no instance offers the capability
    │   ├── NoHealthyInstance                    instances exist, none can take the call
    │   └── RegistrationRefused                  the registrar refused an announce
    │       └── ClearanceExceeded                a capability above the credential's clearance
    ├── TransportError                           (retryable)
    │   ├── NoResponders                         nobody listens on the subject
    │   ├── ReachTimeout (also TimeoutError)     no reply before the deadline
    │   ├── Disconnected                         the NATS connection is gone
    │   │   └── LoginUnanswered                  no login gate answered the login in time
    │   └── StoreFull                            the JetStream store takes no writes (disk full)
    ├── Unavailable                              (retryable) instance alive but not taking calls
    ├── CircuitOpen(target, retry_at)            every candidate's breaker is open
    ├── RetriesExhausted(attempts, last)         last (= __cause__) is the last error
    ├── AuthError
    │   ├── AuthenticationFailed                 bad credentials, bad or expired token
    │   ├── NotAuthorized(level_required, level_held)
    │   └── PermissionDenied                     NATS refused these credentials a subject
    └── RemoteError(kind, code, description, agent_id)
        ├── BusinessError                        the handler refused the request
        └── InternalError                        the handler crashed
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

__all__ = [
    "AuthError",
    "AuthenticationFailed",
    "BusinessError",
    "CircuitOpen",
    "ClearanceExceeded",
    "CodecError",
    "ConfigurationError",
    "ContractError",
    "Disconnected",
    "DiscoveryError",
    "InternalError",
    "LoginUnanswered",
    "NoHealthyInstance",
    "NoResponders",
    "NotAuthorized",
    "NotFound",
    "PermissionDenied",
    "ReachError",
    "ReachTimeout",
    "RegistrationRefused",
    "RemoteError",
    "RetriesExhausted",
    "StoreFull",
    "TransportError",
    "Unavailable",
]


class ReachError(Exception):
    """Base of every Agent-Reach error."""

    #: whether trying again (on another instance) can succeed; read by the retry policy only
    retryable: ClassVar[bool] = False
    #: the reachability layer that failed: discovery, contract, routing, security, agent, config
    layer: ClassVar[str] = "fabric"
    #: the error kind carried on the wire in replies
    kind: ClassVar[str] = "internal"
    #: set when a call made inside a handler raised it: the capability that call was to.
    #: Unhandled, it reaches the handler's own caller as an internal error of the handler
    #: ("dependency_failed"), never as its own kind: a dependency's "unavailable" would
    #: make every caller up the chain retry (retries multiply per hop), and a contract or
    #: auth error of the handler's call is the handler's fault, not its caller's
    dependency: str | None = None


class ConfigurationError(ReachError, ValueError):
    """A manifest, option or file is invalid. ``errors`` lists every problem with its path."""

    layer = "config"

    def __init__(self, message: str, errors: Sequence[str] = ()) -> None:
        self.errors = list(errors) or [message]
        super().__init__(message if not errors else message + ":\n  " + "\n  ".join(errors))


class ContractError(ReachError):
    """The payload does not match the capability's schema; ``path`` names the field."""

    layer = "contract"
    kind = "contract"

    def __init__(self, message: str, *, path: str = "", rule: str = "") -> None:
        self.path = path
        self.rule = rule
        super().__init__(message)


class CodecError(ContractError):
    """Bytes that cannot be decoded, or a value that breaks the codec's limits."""


class DiscoveryError(ReachError):
    layer = "discovery"
    kind = "unavailable"


class NotFound(DiscoveryError):
    """No registered instance offers the capability (or has the agent id)."""


class NoHealthyInstance(DiscoveryError):
    """Instances are registered, but none is healthy enough to take the call."""


class RegistrationRefused(DiscoveryError):
    """The registrar refused an announce; ``reason`` says why."""

    def __init__(self, reason: str, *, agent_id: str = "") -> None:
        self.reason = reason
        self.agent_id = agent_id
        super().__init__(f"registration of {agent_id or 'agent'} refused: {reason}")


class ClearanceExceeded(RegistrationRefused):
    """The registrar refused an announce because the manifest offers ``capability`` at
    ``security_level``, above the ``clearance`` of the credential announcing it: an agent
    serves no capability above its credential's level. Never retried: serve the
    capability with a credential of that level, or lower the capability's level."""

    layer = "security"
    kind = "denied"

    def __init__(
        self,
        reason: str,
        *,
        capability: str,
        security_level: int,
        clearance: int,
        agent_id: str = "",
    ) -> None:
        self.capability = capability
        self.security_level = security_level
        self.clearance = clearance
        super().__init__(reason, agent_id=agent_id)


class TransportError(ReachError):
    """The message did not make it there and back."""

    retryable = True
    layer = "routing"
    kind = "unavailable"


class NoResponders(TransportError):
    """Nobody is subscribed to the subject."""


class ReachTimeout(TransportError, TimeoutError):
    """No reply arrived before the deadline."""

    kind = "timeout"


class Disconnected(TransportError):
    """The connection to NATS is closed or was lost during the call."""


class LoginUnanswered(Disconnected):
    """The server did not answer the login in time, or refused it only when its own wait
    for the login gate ended: no verdict on the credentials, a gate away (trying again
    can succeed)."""


class StoreFull(TransportError):
    """A write to JetStream (an audit batch, a registry record, an alert) was not stored
    because the fabric's JetStream store takes no writes: the disk under it is full (the
    server's "no space left on device", or its storage limit reached), or the server
    disabled JetStream after a store error. ``problem`` is what the fabric's servers
    report. Writes succeed again once space is freed and the server recovers (``reach
    up`` restarts a server of its own once its store has room); until then writers keep
    what they could not write (the audit writer in memory and its spool)."""

    def __init__(self, message: str, *, problem: str) -> None:
        self.problem = problem
        super().__init__(message)


class Unavailable(ReachError):
    """The instance is alive but does not take the call now (not ready, over capacity)."""

    retryable = True
    layer = "routing"
    kind = "unavailable"


class CircuitOpen(ReachError):
    """Every candidate's breaker is open; ``retry_at`` (monotonic s) says when one half-opens."""

    layer = "routing"
    kind = "unavailable"

    def __init__(self, target: str, retry_at: float, *, retry_in: float = 0.0) -> None:
        self.target = target
        self.retry_at = retry_at
        self.retry_in = retry_in
        super().__init__(f"circuit open for {target}; next trial in {retry_in:.2f}s")


class RetriesExhausted(ReachError):
    """Every allowed attempt failed; ``last`` (also ``__cause__``) is the last error."""

    layer = "routing"
    kind = "unavailable"

    def __init__(self, message: str, *, attempts: int, last: BaseException | None = None) -> None:
        self.attempts = attempts
        self.last = last
        super().__init__(message)
        # set here, not only by ``raise … from``: the call path is compiled with mypyc,
        # which does not implement ``from`` (the cause would be lost)
        self.__cause__ = last


class AuthError(ReachError):
    layer = "security"
    kind = "denied"
    #: the code of the ``denied`` reply it stands for ("" when this side decided):
    #: ``authentication_failed``, ``replayed``, ``insufficient_level:3:2``, …
    code: str = ""
    #: the instance or service whose reply it stands for ("" when this side decided)
    agent_id: str = ""


class AuthenticationFailed(AuthError):
    """Credentials or token were rejected."""


class NotAuthorized(AuthError):
    """The caller may not make this call: its clearance is below the capability's security
    level (``level_required`` > ``level_held``), or the callee refused it for another
    reason of authorization (both levels 0: the callee did not say them)."""

    def __init__(
        self,
        message: str,
        *,
        level_required: int = 0,
        level_held: int = 0,
        code: str = "",
        agent_id: str = "",
    ) -> None:
        self.level_required = level_required
        self.level_held = level_held
        self.code = code
        self.agent_id = agent_id
        super().__init__(message)


class PermissionDenied(AuthError):
    """The NATS server refused these credentials a publish or subscription (its
    permissions, set by ``reach up``'s auth callout): what would otherwise look like a
    timeout. An operator command run with an agent's or a caller's credentials, say."""


class RemoteError(ReachError):
    """The callee's handler failed; carries what it said."""

    layer = "agent"

    def __init__(self, kind: str, code: str, description: str, *, agent_id: str = "") -> None:
        self.remote_kind = kind
        self.code = code
        self.description = description
        self.agent_id = agent_id
        where = f" at {agent_id}" if agent_id else ""
        super().__init__(f"{kind} error{where}: [{code}] {description}")


class BusinessError(RemoteError):
    """The handler refused the request for a business reason; retrying will not help.

    Raise it from a handler: ``raise BusinessError("no data for 1999", code="no_data")``.
    """

    kind = "business"

    def __init__(self, description: str, *, code: str = "rejected", agent_id: str = "") -> None:
        super().__init__("business", code, description, agent_id=agent_id)


class InternalError(RemoteError):
    """The handler crashed."""

    kind = "internal"

    def __init__(self, description: str, *, code: str = "crash", agent_id: str = "") -> None:
        super().__init__("internal", code, description, agent_id=agent_id)
