"""Outlier detection: an instance that answers, but badly, is set aside for a while.

A circuit breaker judges reach: timeouts, no responders, refusals to take a call. An
instance whose handler crashes on every call, or that answers every call at five times
its latency SLA, is reachable; it passes its registrar's probes, and its breaker stays
closed. Without more it keeps a full share of the calls. This policy, as Envoy's outlier
detection does for its upstream hosts, *ejects* such an instance from a caller's choices
for a while:

- **errors**: ``consecutive_errors`` answers in a row that are the handler's failure
  (``InternalError``). Business errors, contract errors and refusals are answers that say
  nothing of the instance's health: they neither count nor end a run.
- **slow**: ``consecutive_slow`` attempts in a row slower than the capability's latency
  SLA (answered late, or not answered within the attempt's timeout), the last of them at
  least ``slow_factor`` times the best average among the other candidates that answered
  this caller since the run began. A capability that is slow everywhere, because of what
  all its instances depend on, ejects nobody; nor does a stall of the caller's own
  connection, during which nobody answers.

A hung instance fails its registrar's probes too: when the registry reports it healthy
again, its ejection ends at once (its breaker goes half-open for the same reason), so it
is back as soon as it is. A new process under the same agent id starts afresh.

An ejection lasts ``base_ejection_sec`` times 2 to the power of the ejections in a row
before it (up to ``max_ejection_sec``). Back from one, the instance is on probation: its
next bad answer ejects it again, for twice as long; ``consecutive_errors`` good answers
end the probation and the doubling. At most ``max_ejected_share`` of a capability's
instances are ejected at once, and never the last one that is not: when every other
candidate is gone too, an ejected instance still takes calls.

Pure logic on an injected clock, as the breakers: the caller keeps one
:class:`OutlierState` per instance (beside its latency average) and reports each answer.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final, final

from reach.clock import Clock, system_clock
from reach.errors import ConfigurationError

__all__ = ["EJECTED_FOR", "OutlierConfig", "OutlierDetector", "OutlierState"]

_log = logging.getLogger(__name__)

#: why an instance was ejected, as :attr:`OutlierState.reason` says it
EJECTED_FOR: Final = ("errors", "slow")


@dataclass(frozen=True, slots=True)
class OutlierConfig:
    """When an instance is ejected and for how long. Invalid values raise
    ConfigurationError."""

    #: handler failures in a row that eject an instance
    consecutive_errors: int = 5
    #: answers over the latency SLA in a row that eject an instance ...
    consecutive_slow: int = 3
    #: ... when its latency average is at least this many times its best peer's
    slow_factor: float = 3.0
    #: the first ejection's length; each ejection in a row doubles it
    base_ejection_sec: float = 10.0
    max_ejection_sec: float = 300.0
    #: at most this share of a capability's instances ejected at once (at least one of
    #: two or more)
    max_ejected_share: float = 0.5

    def __post_init__(self) -> None:
        problems: list[str] = []
        for name in ("consecutive_errors", "consecutive_slow"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.append(f"{name}: must be an integer >= 1, got {value!r}")
        for name in ("slow_factor", "base_ejection_sec", "max_ejection_sec"):
            value = getattr(self, name)
            if isinstance(value, bool) or not (math.isfinite(value) and value > 0):
                problems.append(f"{name}: must be a finite number > 0, got {value!r}")
        if not problems and self.slow_factor < 1:
            problems.append(f"slow_factor: must be >= 1, got {self.slow_factor!r}")
        if not problems and self.max_ejection_sec < self.base_ejection_sec:
            problems.append(
                f"max_ejection_sec: must be >= base_ejection_sec ({self.base_ejection_sec}),"
                f" got {self.max_ejection_sec!r}"
            )
        share = self.max_ejected_share
        if isinstance(share, bool) or not 0 <= share <= 1:
            problems.append(f"max_ejected_share: must be in [0, 1], got {share!r}")
        if problems:
            raise ConfigurationError("invalid outlier detection config", problems)


@final
class OutlierState:
    """What a caller holds of one instance's answers: the runs of bad ones, and whether it
    is ejected (until when, monotonic seconds; 0: never was)."""

    __slots__ = (
        "ejected_at",
        "ejections",
        "errors",
        "good",
        "instance_id",
        "probes_pass",
        "reason",
        "run_started",
        "slow",
        "until",
    )

    def __init__(self) -> None:
        self.until = 0.0
        #: when it was ejected last (monotonic): attempts sent before then were counted
        #: already, or are the run that ejected it, and count no more
        self.ejected_at = -math.inf
        #: handler failures in a row
        self.errors = 0
        #: answers over the SLA in a row
        self.slow = 0
        #: ejections in a row (doubling the next one); 0 once a probation ended well
        self.ejections = 0
        #: good answers since the last ejection ended
        self.good = 0
        #: why it was ejected last ("errors" or "slow"), "" if never
        self.reason = ""
        #: when the run of slow attempts began (monotonic)
        self.run_started = 0.0
        #: the instance (process) the registry last described, and whether its probes
        #: passed then
        self.instance_id = ""
        self.probes_pass = True

    def ejected(self, now: float) -> bool:
        return self.until > now

    def __repr__(self) -> str:
        return (
            f"OutlierState(until={self.until:.3f}, errors={self.errors}, slow={self.slow},"
            f" ejections={self.ejections}, reason={self.reason!r})"
        )


class OutlierDetector:
    """The outlier policy of one caller: it hears each answer of an instance and says when
    it is ejected. Not thread-safe: use it from one event loop."""

    __slots__ = ("clock", "config")

    def __init__(self, config: OutlierConfig | None = None, clock: Clock = system_clock) -> None:
        self.config = config or OutlierConfig()
        self.clock = clock

    def good(self, state: OutlierState) -> None:
        """An answer that says the instance works (a result, a business error). The call
        path asks only when ``state`` holds a run or an ejection to forget."""
        state.errors = state.slow = 0
        if state.ejections:
            state.good += 1
            if state.good >= self.config.consecutive_errors:
                state.ejections = state.good = 0

    def error(
        self, state: OutlierState, agent_id: str, started: float, peers: Iterable[OutlierState]
    ) -> bool:
        """The handler failed (``InternalError``) on an attempt sent at ``started``
        (monotonic); True if that ejects the instance. ``peers``: the states of the
        capability's candidates, this one's included."""
        if started < state.ejected_at:
            return False  # in flight when it was ejected: part of the run that did it
        state.errors += 1
        state.slow = 0
        if state.errors < self._run(self.config.consecutive_errors, state):
            return False
        return self._eject(state, agent_id, "errors", peers)

    def slow(
        self,
        state: OutlierState,
        agent_id: str,
        started: float,
        observed_ms: float,
        best_peer_ms: float | None,
        peers: Iterable[OutlierState],
    ) -> bool:
        """An attempt slower than the SLA, sent at ``started`` (monotonic), its time
        ``observed_ms``; True if that ejects the instance. ``best_peer_ms``: the best
        average among the other candidates that are not ejected and answered since the
        run began (:attr:`OutlierState.run_started`, which the caller sets when
        ``state.slow`` is 0); None: none did."""
        if started < state.ejected_at:
            return False  # in flight when it was ejected: part of the run that did it
        state.slow += 1
        state.errors = 0
        if state.slow < self._run(self.config.consecutive_slow, state):
            return False
        if best_peer_ms is None or observed_ms < self.config.slow_factor * best_peer_ms:
            return False  # not an outlier: as slow as the others, or nobody to compare
        return self._eject(state, agent_id, "slow", peers)

    def registry(self, state: OutlierState, instance_id: str, healthy: bool) -> None:
        """What the registry says of the instance now: a new process under its agent id
        starts afresh; probes that pass again after failing end an ejection (a hung
        instance that resumed), its probation kept."""
        if state.instance_id and instance_id != state.instance_id:
            state.until = 0.0
            state.ejected_at = -math.inf
            state.errors = state.slow = state.ejections = state.good = 0
        elif healthy and not state.probes_pass and state.until > 0.0:
            state.until = 0.0
        state.instance_id = instance_id
        state.probes_pass = healthy

    def _run(self, threshold: int, state: OutlierState) -> int:
        """The run of bad answers that ejects: one while on probation."""
        return 1 if state.ejections else threshold

    def _eject(
        self, state: OutlierState, agent_id: str, reason: str, peers: Iterable[OutlierState]
    ) -> bool:
        config = self.config
        now = self.clock.monotonic()
        count = ejected = 0
        for peer in peers:
            count += 1
            if peer is not state and peer.until > now:
                ejected += 1
        cap = int(config.max_ejected_share * count)
        if count >= 2 and cap < 1:
            cap = 1
        if ejected + 1 > cap or ejected + 1 >= count:
            return False  # too many out already: it keeps its share
        length = min(config.max_ejection_sec, config.base_ejection_sec * 2.0**state.ejections)
        state.until = now + length
        state.ejected_at = now
        state.ejections += 1
        state.errors = state.slow = state.good = 0
        state.reason = reason
        _log.warning(
            "outlier: %s ejected from this caller's choices for %.0f s (%s)",
            agent_id,
            length,
            "its handler failed every call of a run"
            if reason == "errors"
            else "it answered over its SLA and far slower than its peers",
        )
        return True
