"""What a token says, and the names every token module shares: the algorithm, the
default issuer, audience, lifetime and leeway, and the error of a token refused.

Tokens are JWTs signed with EdDSA only (``tokens`` issues them, ``tokenverifier``
checks them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from reach.errors import AuthenticationFailed

__all__ = [
    "ALGORITHM",
    "DEFAULT_AUDIENCE",
    "DEFAULT_ISSUER",
    "DEFAULT_LEEWAY_SEC",
    "DEFAULT_TTL_SEC",
    "JOB_READERS",
    "KNOWN_ROLES",
    "MAX_TOKEN_CHARS",
    "ROLE_ADMIN",
    "ROLE_GATEWAY",
    "ROLE_JOBS",
    "ROLE_REGISTRAR",
    "Claims",
    "TokenRejected",
    "call_audience",
]

#: may manage credentials and keys
ROLE_ADMIN: Final = "admin"
#: the registrar / token issuer service
ROLE_REGISTRAR: Final = "registrar"
#: may use REACH_JOBS: an async-mode agent (writes the records of the jobs it runs) or a
#: caller that waits for jobs (reads the records of the jobs it called, no others)
ROLE_JOBS: Final = "jobs"
#: may call for others: a gateway (``reach mcp``, ``reach a2a``) exchanges the fabric
#: token of a caller that logged in through it for call tokens that name that caller,
#: with the gateway as the actor (RFC 8693 ``act``)
ROLE_GATEWAY: Final = "gateway"
KNOWN_ROLES: Final = frozenset({ROLE_ADMIN, ROLE_REGISTRAR, ROLE_JOBS, ROLE_GATEWAY})
#: the roles whose holders may read the result of a job they called (the admin's and
#: the registrar's permissions include REACH_JOBS)
JOB_READERS: Final = frozenset({ROLE_JOBS, ROLE_ADMIN, ROLE_REGISTRAR})

ALGORITHM: Final = "EdDSA"
DEFAULT_ISSUER: Final = "reach"
DEFAULT_AUDIENCE: Final = "reach"
DEFAULT_TTL_SEC: Final = 7200.0
DEFAULT_LEEWAY_SEC: Final = 30.0
#: longer strings are refused before any parsing
MAX_TOKEN_CHARS: Final = 8192


class TokenRejected(AuthenticationFailed):
    """A token failed verification; ``reason`` names the check that failed.

    Reasons: ``bad_format``, ``alg_not_allowed``, ``missing_kid``, ``unknown_kid``,
    ``bad_signature``, ``wrong_issuer``, ``wrong_audience``, ``expired``,
    ``not_yet_valid``, ``missing_claim``, ``bad_claim``, ``bad_level``, ``key_retired``,
    ``revoked``.
    """

    def __init__(self, message: str, *, reason: str) -> None:
        self.reason = reason
        super().__init__(f"token rejected: {message}")


@dataclass(frozen=True, slots=True)
class Claims:
    """What a verified token says about its holder."""

    client_id: str
    agent_id: str | None
    level: int
    roles: frozenset[str]
    exp: float
    nbf: float
    iat: float
    jti: str
    kid: str
    #: whom the token is for: the fabric's control services (DEFAULT_AUDIENCE), or the
    #: instances of one capability (``call_audience``)
    audience: tuple[str, ...] = ()
    #: the client that made the call for ``client_id`` (a gateway; RFC 8693 ``act.sub``),
    #: None when the client calls for itself
    actor: str | None = None

    def has_role(self, role: str) -> bool:
        return role in self.roles


def call_audience(capability: str, instance: str = "") -> str:
    """The audience of a token for calls to ``capability`` at one ``instance`` (its
    agent id): what that instance accepts on its own subject. A caller's fabric token
    (DEFAULT_AUDIENCE) never travels to callees, and a call token is refused by the
    registrar, the issuer, every other capability's callees and every other instance of
    its own: a callee that keeps what it was sent can present it nowhere but to itself.

    Without ``instance``: a token for the capability's queue group (any instance), used
    only when a caller knows no instance, and accepted only on the queue subject."""
    return f"call:{capability}:{instance}" if instance else f"call:{capability}"
