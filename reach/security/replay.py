"""Refusing a replayed call: every request carries a deadline, and a callee remembers the
calls it served until their deadlines pass.

A call's bytes can be sent again by whoever saw them: the instance that received it (or
anyone on the wire). A copy sent to another instance is refused there: its call token is
for the first instance only (``call_audience``). A copy sent to the same instance is
refused while its deadline lives, since the callee remembers its (client, call id,
attempt); once the deadline has passed it is refused as late. The client is part of it:
a copy carries its sender's token, and another client that reuses a call id (it cannot
know whose call it is) must not make the real caller's next attempt look replayed. So a
callee needs a deadline on every call (one without gets the callee's own: now plus the
capability's default timeout) and a bound on how far ahead one may lie.

A pure state machine on an injected clock.
"""

from __future__ import annotations

from collections import OrderedDict

from reach.clock import Clock, system_clock

__all__ = ["MAX_AHEAD_SEC", "MAX_REMEMBERED", "RecentCalls"]

#: the furthest ahead a call's deadline may lie (the longest timeout a caller may set)
MAX_AHEAD_SEC = 24 * 3600.0
#: calls remembered at most; past it the one remembered longest is forgotten first
MAX_REMEMBERED = 1_000_000


class RecentCalls:
    """The (client, call id, attempt) served, each kept until its deadline (Unix seconds)."""

    __slots__ = ("_clock", "_max", "_seen")

    def __init__(self, *, clock: Clock = system_clock, max_remembered: int = MAX_REMEMBERED):
        if max_remembered < 1:
            raise ValueError("max_remembered must be at least 1")
        self._clock = clock
        self._max = max_remembered
        #: in arrival order; deadlines mostly grow with it, so the front expires first
        self._seen: OrderedDict[tuple[str, str, int], float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._seen)

    def first_time(self, client: str, call_id: str, attempt: int, deadline: float) -> bool:
        """Remember ``client``'s call until ``deadline``; False if it was seen (a replay)."""
        seen = self._seen
        key = (client, call_id, attempt)
        if key in seen:
            return False
        self._forget_expired()
        seen[key] = deadline
        if len(seen) > self._max:
            seen.popitem(last=False)
        return True

    def _forget_expired(self) -> None:
        # from the front until one still lives: one with a later deadline that arrived
        # earlier keeps those behind it a little longer, never less long
        seen = self._seen
        now = self._clock.time()
        while seen:
            key = next(iter(seen))
            if seen[key] > now:
                return
            seen.popitem(last=False)
