"""This caller's view of each instance it routes to: the latency it observed and its own
calls in flight (the inputs of the routing score that come from the caller, not from the
registry; docs/architecture.md, "Routing score")."""

from __future__ import annotations

from typing import Final, final

from reach.clock import Clock, system_clock
from reach.errors import ConfigurationError
from reach.resilience.outliers import OutlierState

__all__ = ["LATENCY_STALE_SEC", "Peer", "Peers"]

#: a latency average this caller has not refreshed for this long is old news. An average
#: moves only when the instance serves, so one spike (a pause, a slow burst) could put an
#: instance below the tie band for good: no calls, no new measurement. While other
#: candidates are measured more recently, a stale instance without a call of this caller
#: in flight is scored like an unmeasured one (with the best latency observed among the
#: candidates): it gets one call, and that call's latency replaces the old average. A slow
#: instance so costs one call per this many seconds; a recovered one is back in the band
#: after it.
LATENCY_STALE_SEC: Final = 1.0


@final
class Peer:
    """This caller's view of one instance: the average latency it observed (an
    exponentially weighted moving average) and its own calls in flight to it.

    One object per agent id, held by every route to the instance (routes are rebuilt with
    each heartbeat; this is not), so a choice reads it directly: no dictionary lookup per
    candidate, and its numbers sit in the object itself."""

    __slots__ = ("agent_id", "latency_ms", "measured", "outlier", "outstanding", "seen")

    def __init__(self, agent_id: str) -> None:
        self.agent_id = agent_id
        #: the average (ms); meaningless until ``measured``
        self.latency_ms = 0.0
        self.measured = False
        #: monotonic time of the newest observation
        self.seen = 0.0
        #: this caller's calls in flight to the instance
        self.outstanding = 0
        #: its runs of bad answers, and whether it is ejected (reach.resilience.outliers)
        self.outlier = OutlierState()

    def observe(self, ms: float, alpha: float, now: float = 0.0) -> None:
        """Fold one observed latency in with weight ``alpha``, at monotonic time ``now``;
        the first is taken as is, and so is one that follows an average older than
        ``LATENCY_STALE_SEC`` (old news)."""
        if ms < 0.0:
            ms = 0.0
        if self.measured and now - self.seen < LATENCY_STALE_SEC:
            self.latency_ms += alpha * (ms - self.latency_ms)
        else:
            self.latency_ms = ms
            self.measured = True
        self.seen = now


class Peers:
    """The caller's :class:`Peer` of every instance it routes to, by agent id.

    ``alpha`` is the weight of the newest latency observation: 0.2 follows a change within
    ~10 calls while one slow call moves the average by a fifth of the difference only.
    ``clock`` times the observations (see ``LATENCY_STALE_SEC``).
    """

    __slots__ = ("_peers", "alpha", "clock")

    def __init__(self, alpha: float = 0.2, clock: Clock = system_clock) -> None:
        if isinstance(alpha, bool) or not 0 < alpha <= 1:
            raise ConfigurationError(f"alpha must be in (0, 1], got {alpha!r}")
        self.alpha = alpha
        self.clock = clock
        self._peers: dict[str, Peer] = {}

    def peer(self, agent_id: str) -> Peer:
        """The instance's peer, created on first use."""
        found = self._peers.get(agent_id)
        if found is None:
            found = self._peers[agent_id] = Peer(agent_id)
        return found

    def observe(self, agent_id: str, ms: float) -> None:
        """Fold one observed latency (ms) of ``agent_id`` in."""
        self.peer(agent_id).observe(ms, self.alpha, self.clock.monotonic())

    def fold(self, peer: Peer, ms: float) -> None:
        """Fold one observed latency (ms) into ``peer`` (the call path's way: it holds it)."""
        peer.observe(ms, self.alpha, self.clock.monotonic())

    def latency(self, agent_id: str) -> float | None:
        """The average latency (ms) observed of ``agent_id``, None if never observed."""
        found = self._peers.get(agent_id)
        return found.latency_ms if found is not None and found.measured else None

    def forget(self, agent_id: str) -> None:
        """Drop an agent's peer (it left the registry). A call still in flight to it
        holds the old object: what it reports lands there, and goes with it."""
        self._peers.pop(agent_id, None)

    def __contains__(self, agent_id: object) -> bool:
        return agent_id in self._peers

    def __len__(self) -> int:
        return len(self._peers)
