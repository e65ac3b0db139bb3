"""A failed reply as the caller raises it: the error of the documented tree for its
``kind`` and ``code`` (docs/protocol.md, "Errors").

The kind decides the error; a few ``denied`` codes decide it within the kind (who may
make the call, rather than who made it). A code is a name, optionally followed by
arguments after colons (``insufficient_level:3:2``); the table is looked up by the name.
A code this side does not know stands for its kind's error, so a callee may add codes
without breaking callers. A contract error names its field in the reply's ``err.path``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from reach.errors import (
    AuthenticationFailed,
    BusinessError,
    ContractError,
    InternalError,
    NotAuthorized,
    ReachError,
    ReachTimeout,
    Unavailable,
)
from reach.wire.envelope import Reply

__all__ = ["AUTHORIZATION_CODES", "KIND_ERRORS", "code_name", "remote_error"]

#: the ``denied`` codes that say the caller may not make this call (NotAuthorized); every
#: other ``denied`` code says its token or request was not accepted (AuthenticationFailed)
AUTHORIZATION_CODES: Final = frozenset(
    {
        "not_authorized",  # any refusal of authorization, levels unsaid
        "insufficient_level",  # insufficient_level:<level required>:<level held>
        "wrong_agent",  # a token bound to another agent_id
        "capability_not_allowed",  # a credential that does not list the capability
        "not_admin",  # an admin's request without the admin role
        "no_jobs_role",  # a job whose result the caller may not read (the jobs role)
    }
)

_Build = Callable[[Reply, str], ReachError]


def code_name(code: str) -> str:
    """The name of a code: what comes before its first colon."""
    return code.split(":", 1)[0]


def _contract(reply: Reply, by: str) -> ReachError:
    return ContractError(f"{reply.description} (at {by})", path=reply.path, rule=reply.code)


def _business(reply: Reply, by: str) -> ReachError:
    return BusinessError(reply.description, code=reply.code, agent_id=by)


def _unavailable(reply: Reply, by: str) -> ReachError:
    return Unavailable(f"{by}: {reply.description}")


def _timeout(reply: Reply, by: str) -> ReachError:
    return ReachTimeout(f"{by}: {reply.description}")


def _denied(reply: Reply, by: str) -> ReachError:
    code = reply.code
    message = f"{by}: {reply.description}"
    if code_name(code) not in AUTHORIZATION_CODES:
        error = AuthenticationFailed(message)
        error.code = code
        error.agent_id = by
        return error
    required = held = 0
    args = code.split(":")[1:]
    if len(args) == 2 and all(arg.isdigit() for arg in args):
        required, held = int(args[0]), int(args[1])
    return NotAuthorized(message, level_required=required, level_held=held, code=code, agent_id=by)


def _internal(reply: Reply, by: str) -> ReachError:
    return InternalError(reply.description, code=reply.code, agent_id=by)


#: the error each kind stands for (``denied``: by its code, see AUTHORIZATION_CODES)
KIND_ERRORS: Final[dict[str, _Build]] = {
    "contract": _contract,
    "business": _business,
    "unavailable": _unavailable,
    "timeout": _timeout,
    "denied": _denied,
    "internal": _internal,
}


def remote_error(reply: Reply, target: str) -> ReachError:
    """The exception of the one documented tree for a failed reply from ``target`` (the
    reply's ``by``, when it names the instance that answered)."""
    build = KIND_ERRORS.get(reply.kind, _internal)  # (unpack_reply refuses other kinds)
    return build(reply, reply.by or target)
