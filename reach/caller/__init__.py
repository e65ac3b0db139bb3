"""The caller's side of a call, one concern a module; ``client.ReachClient`` puts them
together.

- ``client``: ``ReachClient``, what a caller writes;
- ``result``: ``CallResult``, what a call returns;
- ``callstate``: ``CallState``, one call across its attempts;
- ``plan``: call planning: candidates, deadline, contract pre-check, the encoded request;
- ``attempt``: one attempt: the instance chosen, its call token, request/reply, the
  error of a failed reply, breakers and latency told what happened;
- ``routing``: the routing score and the instance chosen from it;
- ``peers``: what this caller observed of each instance (latency, calls in flight);
- ``routecache``: the registry records a caller uses, kept current by KV watches.

What a call does when an attempt fails (retries, backoff, the retry budget, breakers,
fallbacks) is in ``reach.resilience``; the call's audit event is written by
``reach.audit.recording``; an async-mode call's job is looked up through
``reach.agent.jobs``. The names below are imported on first use.
"""

import typing as _typing

from reach import lazy as _lazy

if _typing.TYPE_CHECKING:
    from reach.caller.client import ReachClient as ReachClient
    from reach.caller.result import CallResult as CallResult
    from reach.caller.routecache import RouteCache as RouteCache

#: each public name and the module it is imported from
_EXPORTS: dict[str, str] = {
    "CallResult": "reach.caller.result",
    "ReachClient": "reach.caller.client",
    "RouteCache": "reach.caller.routecache",
}
__all__ = list(_EXPORTS)

if not _typing.TYPE_CHECKING:  # type checkers read the imports above instead
    __getattr__, __dir__ = _lazy.exports(__name__, _EXPORTS, globals(), __all__)
