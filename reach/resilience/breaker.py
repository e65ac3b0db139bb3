"""Circuit breakers: one pure state machine per target (an instance's agent_id).

::

    closed ──(a failure: ≥ failure_ratio of ≥ min_calls calls in the window failed,
              or consecutive_failures calls in a row failed)──▶ open
    open ──(open wait elapsed, or the registry reports the target healthy again)──▶ half_open
    half_open ──(half_open_successes trial calls succeeded)──▶ closed
    half_open ──(a trial call failed)──▶ open, with the wait doubled (up to open_max_sec)

Failures are judged on a window that reflects now: the ratio over the sliding window
catches a target that fails often, and a run of ``consecutive_failures`` failures in a
row (within the window) opens the breaker whatever successes came before it in the
window, so a target that stops answering is cut off within its first few failures rather
than once its earlier successes have expired. A failure the target answered itself (a
retryable error reply: overloaded, unavailable) counts toward the ratio and ends a run:
the target is answering. Only a failure can open the breaker: a success never does.

The open wait is short (``healthy_open_sec``) while the registry reports the target
healthy: its registrar's probes pass, so the caller tests it again soon and a target that
recovered is back in rotation within about half a second. Otherwise it starts at
``open_base_sec`` and doubles with each trip in a row, sparing a target that keeps failing.

The breaker never sleeps, never reads the wall clock and never decides which errors count:
the caller asks :meth:`CircuitBreaker.allow` before a call and reports the outcome with
exactly one of :meth:`~CircuitBreaker.record_success`, :meth:`~CircuitBreaker.record_failure`
(an error that says the target is in trouble: timeout, no responders, unavailable) or
:meth:`~CircuitBreaker.release` (an error that says nothing about the target's health, such
as a contract or business error, or a cancelled call). Time comes from an injected
:class:`~reach.clock.Clock`. Not thread-safe: use it from one event loop.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum

from reach.clock import Clock, system_clock
from reach.errors import CircuitOpen, ConfigurationError
from reach.resilience._window import SlidingCounts

__all__ = [
    "BreakerBoard",
    "BreakerConfig",
    "BreakerSnapshot",
    "BreakerState",
    "CircuitBreaker",
    "StateListener",
]

_log = logging.getLogger(__name__)


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


CLOSED = BreakerState.CLOSED
OPEN = BreakerState.OPEN
HALF_OPEN = BreakerState.HALF_OPEN

#: ``on_change(target, old_state, new_state)``; its return value is ignored, its errors logged
StateListener = Callable[[str, BreakerState, BreakerState], object]


@dataclass(frozen=True, slots=True)
class BreakerConfig:
    """When a breaker opens and how it recovers. Invalid values raise ConfigurationError."""

    #: length of the sliding window that failures are counted in
    window_sec: float = 10.0
    #: the window moves in steps of window_sec / window_buckets (1 s by default)
    window_buckets: int = 10
    #: fewer calls than this in the window never open the breaker on the failure ratio
    #: (too little evidence of a share)
    min_calls: int = 20
    #: the breaker opens when failures / calls in the window reach this share
    failure_ratio: float = 0.5
    #: it also opens when this many calls in a row failed within the window: a target
    #: that stops answering (hung, dead) fails every call, and waiting for its earlier
    #: successes to leave the window would keep it in rotation for the whole window.
    #: Ten in a row from a target that fails one call in three comes about once in
    #: 60,000 calls.
    consecutive_failures: int = 10
    #: wait before the first half-open; doubles on each consecutive trip
    open_base_sec: float = 2.0
    #: cap of the doubling wait; the wait falls back to open_base_sec once the breaker closes
    open_max_sec: float = 60.0
    #: the open wait at most while the registry reports the target healthy (its probes
    #: pass): a recovered target is tried again, and back in rotation, within about this
    healthy_open_sec: float = 0.5
    #: trial calls let through at once while half-open
    half_open_max_calls: int = 3
    #: successful trials needed to close. 2, not 1: one lucky call (a cached answer, a cheap
    #: request) is weak evidence that a target which just failed half its calls has
    #: recovered; two agreeing trials are still reached within one wave of concurrent trials.
    half_open_successes: int = 2
    #: a trial that never reports back (a bug, a lost task) frees its slot after this, so
    #: half-open can never get stuck; longer than any sane call timeout
    half_open_timeout_sec: float = 30.0

    def __post_init__(self) -> None:
        problems: list[str] = []

        def positive(name: str, value: float) -> None:
            if isinstance(value, bool) or not (math.isfinite(value) and value > 0):
                problems.append(f"{name}: must be a finite number > 0, got {value!r}")

        def at_least_one(name: str, value: int) -> None:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.append(f"{name}: must be an integer >= 1, got {value!r}")

        positive("window_sec", self.window_sec)
        at_least_one("window_buckets", self.window_buckets)
        at_least_one("min_calls", self.min_calls)
        at_least_one("consecutive_failures", self.consecutive_failures)
        if isinstance(self.failure_ratio, bool) or not 0 < self.failure_ratio <= 1:
            problems.append(f"failure_ratio: must be in (0, 1], got {self.failure_ratio!r}")
        positive("open_base_sec", self.open_base_sec)
        positive("open_max_sec", self.open_max_sec)
        positive("healthy_open_sec", self.healthy_open_sec)
        if not problems and self.open_max_sec < self.open_base_sec:
            problems.append(
                f"open_max_sec: must be >= open_base_sec ({self.open_base_sec}),"
                f" got {self.open_max_sec!r}"
            )
        at_least_one("half_open_max_calls", self.half_open_max_calls)
        at_least_one("half_open_successes", self.half_open_successes)
        positive("half_open_timeout_sec", self.half_open_timeout_sec)
        if problems:
            raise ConfigurationError("invalid breaker config", problems)


@dataclass(frozen=True, slots=True)
class BreakerSnapshot:
    """A breaker's state for operators (``reach doctor``, ``reach top``, metrics)."""

    target: str
    state: BreakerState
    #: calls and failures counted in the current window (closed state only)
    calls: int
    failures: int
    #: trial calls in flight (half-open only)
    trials: int
    #: monotonic time at which a call will be let through again; None if one would be now
    retry_at: float | None
    #: times the breaker opened since it was created
    trips: int
    #: trips since it last closed (drives the doubling wait)
    consecutive_trips: int


class CircuitBreaker:
    """The breaker of one target; see the module docstring for the protocol."""

    __slots__ = (
        "_clock",
        "_config",
        "_consecutive_trips",
        "_next_wait",
        "_on_change",
        "_opened_until",
        "_registry_healthy",
        "_state",
        "_streak",
        "_streak_since",
        "_successes",
        "_trials",
        "_window",
        "target",
        "trips",
    )

    def __init__(
        self,
        target: str,
        config: BreakerConfig | None = None,
        clock: Clock = system_clock,
        on_change: StateListener | None = None,
    ) -> None:
        self.target = target
        self._config = config = config if config is not None else BreakerConfig()
        self._clock = clock
        self._on_change = on_change
        self._state = CLOSED
        self._window = SlidingCounts(config.window_sec, config.window_buckets)
        self._opened_until = 0.0
        self._next_wait = config.open_base_sec
        # start times of the trial calls in flight, oldest first
        self._trials: deque[float] = deque()
        self._successes = 0
        self.trips = 0
        self._consecutive_trips = 0
        # failures in a row (closed state) and when the run began
        self._streak = 0
        self._streak_since = 0.0
        # whether the registry last said the target is healthy (a breaker without a
        # registry beside it relies on its own waits alone)
        self._registry_healthy = False

    @property
    def config(self) -> BreakerConfig:
        return self._config

    @property
    def state(self) -> BreakerState:
        """The current state; an open breaker whose wait is over reads (and turns) half-open."""
        if self._state is OPEN and self._clock.monotonic() >= self._opened_until:
            self._half_open()
        return self._state

    @property
    def retry_at(self) -> float | None:
        """Monotonic time at which :meth:`allow` will let a call through again.

        None while it would now (closed, or half-open with a free trial slot). Open: when it
        half-opens. Half-open with every slot taken: when the oldest trial's slot times out,
        an upper bound since a trial that reports back frees its slot sooner.
        """
        state = self.state
        if state is OPEN:
            return self._opened_until
        if state is HALF_OPEN:
            self._expire_trials(self._clock.monotonic())
            if len(self._trials) >= self._config.half_open_max_calls:
                return self._trials[0] + self._config.half_open_timeout_sec
        return None

    def next_chance(self) -> float | None:
        """When a call waiting on this breaker should look again: None if one would be let
        through now; while open, when it half-opens; while every trial slot is taken, now,
        since a trial that reports back closes the breaker or frees its slot at any moment
        (:attr:`retry_at` gives the slots' upper bound instead, for operators)."""
        retry_at = self.retry_at
        if retry_at is not None and self._state is HALF_OPEN:
            return self._clock.monotonic()
        return retry_at

    def allow(self) -> bool:
        """May a call go to the target now? While half-open a True takes a trial slot, which
        the outcome (record_success, record_failure or release) gives back."""
        state = self._state
        if state is CLOSED:
            return True
        now = self._clock.monotonic()
        if state is OPEN:
            if now < self._opened_until:
                return False
            self._half_open()
            if self._state is not HALF_OPEN:  # a listener changed it
                return self.allow()
        trials = self._trials
        self._expire_trials(now)
        if len(trials) >= self._config.half_open_max_calls:
            return False
        trials.append(now)
        return True

    def record_success(self) -> None:
        """The call succeeded. Never opens the breaker: a success is no evidence of trouble
        (failures counted before it were checked as they came)."""
        state = self._state
        if state is CLOSED:
            self._window.add(self._clock.monotonic(), 1, 0)
            self._streak = 0
        elif state is HALF_OPEN and self._trials:
            self._trials.popleft()
            self._successes += 1
            if self._successes >= self._config.half_open_successes:
                self._close()
        # open, or half-open without trials: a call let through before the breaker opened
        # reports late; its outcome is old news

    def record_failure(self, *, answered: bool = False) -> None:
        """The call failed with an error that counts against the target's health.

        ``answered``: the target replied, with a retryable error (overloaded,
        unavailable): the failure counts toward the window's ratio, but a reply ends a
        run of failures in a row, which stands for a target that stopped answering (a
        burst of "overloaded" replies to one batch is not a hang)."""
        state = self._state
        if state is CLOSED:
            now = self._clock.monotonic()
            self._window.add(now, 1, 1)
            if answered:
                self._streak = 0
                self._check_trip(now)
                return
            if self._streak == 0 or now - self._streak_since >= self._config.window_sec:
                self._streak = 0  # a run older than the window is no evidence of now
                self._streak_since = now
            self._streak += 1
            self._check_trip(now)
        elif state is HALF_OPEN and self._trials:
            self._trip(self._clock.monotonic())

    def registry_health(self, healthy: bool) -> None:
        """What the registry says of the target now (each record the caller receives).

        While it says healthy, the open wait is at most ``healthy_open_sec``; when it says
        healthy again after saying otherwise (its registrar's probe passed again), an open
        breaker half-opens at once, so the target gets trial calls without waiting out a
        wait that grew while it was down."""
        was = self._registry_healthy
        self._registry_healthy = healthy
        if healthy and not was and self._state is OPEN:
            self._opened_until = self._clock.monotonic()

    def release(self) -> None:
        """The call ended with an error that says nothing about the target (a contract or
        business error, a cancellation): give back a trial slot, change nothing else."""
        if self._state is HALF_OPEN and self._trials:
            self._trials.popleft()

    def open_error(self) -> CircuitOpen:
        """A :class:`~reach.errors.CircuitOpen` for this target saying when to try again."""
        now = self._clock.monotonic()
        retry_at = self.retry_at
        if retry_at is None:
            retry_at = now
        return CircuitOpen(self.target, retry_at, retry_in=max(0.0, retry_at - now))

    def snapshot(self) -> BreakerSnapshot:
        retry_at = self.retry_at  # also refreshes open → half-open and expired trials
        window = self._window
        window.roll(self._clock.monotonic())
        return BreakerSnapshot(
            target=self.target,
            state=self._state,
            calls=window.first,
            failures=window.second,
            trials=len(self._trials),
            retry_at=retry_at,
            trips=self.trips,
            consecutive_trips=self._consecutive_trips,
        )

    def __repr__(self) -> str:
        return f"<CircuitBreaker {self.target} {self._state}>"

    # -- transitions ---------------------------------------------------------------------

    def _check_trip(self, now: float) -> None:
        # after failures only: a success is never what opens a breaker
        window = self._window
        calls = window.first
        config = self._config
        if self._streak >= config.consecutive_failures or (
            calls >= config.min_calls and window.second >= config.failure_ratio * calls
        ):
            self._trip(now)

    def _expire_trials(self, now: float) -> None:
        trials = self._trials
        timeout = self._config.half_open_timeout_sec
        while trials and now - trials[0] >= timeout:
            trials.popleft()

    def _trip(self, now: float) -> None:
        wait = self._next_wait
        self._next_wait = min(wait * 2, self._config.open_max_sec)
        if self._registry_healthy and wait > self._config.healthy_open_sec:
            wait = self._config.healthy_open_sec
        self._opened_until = now + wait
        self._streak = 0
        self.trips += 1
        self._consecutive_trips += 1
        self._window.reset()
        self._trials.clear()
        self._successes = 0
        self._set_state(OPEN)

    def _half_open(self) -> None:
        self._trials.clear()
        self._successes = 0
        self._set_state(HALF_OPEN)

    def _close(self) -> None:
        self._next_wait = self._config.open_base_sec
        self._consecutive_trips = 0
        self._streak = 0
        self._window.reset()
        self._trials.clear()
        self._successes = 0
        self._set_state(CLOSED)

    def _set_state(self, new: BreakerState) -> None:
        old = self._state
        self._state = new
        listener = self._on_change
        if listener is not None and old is not new:
            try:
                listener(self.target, old, new)
            except Exception:
                # a broken metrics hook must not break routing; transitions are rare
                _log.exception("breaker state listener failed for %s", self.target)


class BreakerBoard:
    """The breakers of one caller, by target, created on first use."""

    __slots__ = ("_breakers", "_clock", "_config", "_healthy", "_on_change")

    def __init__(
        self,
        config: BreakerConfig | None = None,
        clock: Clock = system_clock,
        on_change: StateListener | None = None,
    ) -> None:
        self._config = config if config is not None else BreakerConfig()
        self._clock = clock
        self._on_change = on_change
        self._breakers: dict[str, CircuitBreaker] = {}
        # targets the registry reports healthy now (a breaker created later starts so)
        self._healthy: set[str] = set()

    @property
    def config(self) -> BreakerConfig:
        return self._config

    @property
    def clock(self) -> Clock:
        return self._clock

    def get(self, target: str) -> CircuitBreaker:
        """The breaker of ``target``, created closed if it has none yet."""
        breaker = self._breakers.get(target)
        if breaker is None:
            breaker = CircuitBreaker(target, self._config, self._clock, self._on_change)
            if target in self._healthy:
                breaker.registry_health(True)
            self._breakers[target] = breaker
        return breaker

    def peek(self, target: str) -> CircuitBreaker | None:
        """The breaker of ``target`` if it has one, without creating it."""
        return self._breakers.get(target)

    def forget(self, target: str) -> None:
        """Drop a target's breaker (the instance left the registry)."""
        self._breakers.pop(target, None)
        self._healthy.discard(target)

    def registry_health(self, target: str, healthy: bool) -> None:
        """What the registry says of ``target`` now (see :meth:`CircuitBreaker.registry_health`),
        kept for a breaker created later."""
        if healthy:
            self._healthy.add(target)
        else:
            self._healthy.discard(target)
        breaker = self._breakers.get(target)
        if breaker is not None:
            breaker.registry_health(healthy)

    def __len__(self) -> int:
        return len(self._breakers)

    def __contains__(self, target: object) -> bool:
        return target in self._breakers

    def snapshot(self) -> dict[str, BreakerSnapshot]:
        return {target: b.snapshot() for target, b in self._breakers.items()}

    def open_count(self) -> int:
        """Breakers not closed (open or half-open) right now."""
        return sum(1 for b in self._breakers.values() if b.snapshot().state != "closed")

    def earliest_retry_at(self, targets: Iterable[str]) -> float:
        """The earliest monotonic time at which one of ``targets`` may let a call through
        (:meth:`CircuitBreaker.next_chance`): now if one does already (a target without a
        breaker is closed) or holds a trial whose outcome is awaited, and now for no
        targets (nothing to wait for), so the result always fits
        ``CircuitOpen(retry_at=...)``."""
        now = self._clock.monotonic()
        earliest: float | None = None
        for target in targets:
            breaker = self._breakers.get(target)
            retry_at = None if breaker is None else breaker.next_chance()
            if retry_at is None:
                return now
            if earliest is None or retry_at < earliest:
                earliest = retry_at
        return now if earliest is None else earliest
