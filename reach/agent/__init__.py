"""The agent: the callee's side of a call, one concern a module.

- ``agent``: ``Agent``, what an agent author writes: a manifest, handlers, ``serve``;
- ``joining``: joining a fabric: the connection, its security, the announce;
- ``presence``: heartbeats and the announce kept current while the agent serves;
- ``serving``: a request from its arrival to its reply (token, contract, handler);
- ``endpoint``: a capability as served: its handler, compiled contract and errors;
- ``admission``: admission by the capability's declared rate (``qps``);
- ``replycache``: replies kept by idempotency key, so that a retried call runs once;
- ``jobs``: async-mode calls: accepted at once, run, their results kept in REACH_JOBS;
- ``context``: ``current_call``, the call being served, which nested calls inherit;
- ``microsvc``: the agent as a NATS micro service (``$SRV.PING``/``INFO``/``STATS``).

The names below are imported on first use.
"""

import typing as _typing

from reach import lazy as _lazy

if _typing.TYPE_CHECKING:
    from reach.agent.agent import Agent as Agent
    from reach.agent.context import CallContext as CallContext
    from reach.agent.context import current_call as current_call

#: each public name and the module it is imported from
_EXPORTS: dict[str, str] = {
    "Agent": "reach.agent.agent",
    "CallContext": "reach.agent.context",
    "current_call": "reach.agent.context",
}
__all__ = list(_EXPORTS)

if not _typing.TYPE_CHECKING:  # type checkers read the imports above instead
    __getattr__, __dir__ = _lazy.exports(__name__, _EXPORTS, globals(), __all__)
