"""The circuit breaker as a pure state machine, driven by a manual clock (no sleeps)."""

from __future__ import annotations

import pytest

from reach.clock import ManualClock
from reach.errors import CircuitOpen, ConfigurationError
from reach.resilience import (
    BreakerBoard,
    BreakerConfig,
    BreakerSnapshot,
    BreakerState,
    CircuitBreaker,
)

CLOSED, OPEN, HALF_OPEN = BreakerState.CLOSED, BreakerState.OPEN, BreakerState.HALF_OPEN


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


def make(clock: ManualClock, **config: float) -> CircuitBreaker:
    return CircuitBreaker("agent-a", BreakerConfig(**config), clock)  # type: ignore[arg-type]


def ratio_only(clock: ManualClock) -> CircuitBreaker:
    """A breaker that opens on the failure ratio alone (no run of failures long enough)."""
    return make(clock, consecutive_failures=1000)


def calls(breaker: CircuitBreaker, *, ok: int = 0, failed: int = 0) -> None:
    for _ in range(ok):
        assert breaker.allow()
        breaker.record_success()
    for _ in range(failed):
        assert breaker.allow()
        breaker.record_failure()


def trip(breaker: CircuitBreaker) -> None:
    config = breaker.config
    calls(breaker, failed=min(config.min_calls, config.consecutive_failures))
    assert breaker.state is OPEN


def half_open(breaker: CircuitBreaker, clock: ManualClock) -> None:
    retry_at = breaker.retry_at
    assert retry_at is not None
    clock.advance(retry_at - clock.monotonic())
    assert breaker.state is HALF_OPEN


# -- config ------------------------------------------------------------------------------


def test_defaults_follow_the_design() -> None:
    config = BreakerConfig()
    assert (config.window_sec, config.min_calls, config.failure_ratio) == (10.0, 20, 0.5)
    assert (config.consecutive_failures, config.healthy_open_sec) == (10, 0.5)
    assert (config.half_open_max_calls, config.half_open_successes) == (3, 2)


@pytest.mark.parametrize(
    "bad",
    [
        {"window_sec": 0},
        {"window_sec": float("nan")},
        {"window_buckets": 0},
        {"min_calls": 0},
        {"consecutive_failures": 0},
        {"healthy_open_sec": 0},
        {"failure_ratio": 0},
        {"failure_ratio": 1.5},
        {"open_base_sec": -1},
        {"open_base_sec": 10, "open_max_sec": 5},
        {"open_max_sec": float("inf")},
        {"half_open_max_calls": 0},
        {"half_open_successes": 0},
        {"half_open_timeout_sec": 0},
    ],
)
def test_bad_config_is_refused_on_construction(bad: dict[str, float]) -> None:
    with pytest.raises(ConfigurationError) as info:
        BreakerConfig(**bad)  # type: ignore[arg-type]
    assert any(next(iter(bad)) in line for line in info.value.errors)


# -- closed → open -----------------------------------------------------------------------


def test_opens_at_the_failure_ratio_once_min_calls_are_reached(clock: ManualClock) -> None:
    breaker = ratio_only(clock)
    calls(breaker, ok=10, failed=9)
    assert breaker.state is CLOSED
    calls(breaker, failed=1)  # 10 of 20 = 50 %
    assert breaker.state is OPEN
    assert not breaker.allow()


def test_stays_closed_below_min_calls_even_if_all_fail(clock: ManualClock) -> None:
    breaker = ratio_only(clock)
    calls(breaker, failed=19)
    assert breaker.state is CLOSED
    assert breaker.allow()


def test_stays_closed_below_the_failure_ratio(clock: ManualClock) -> None:
    breaker = ratio_only(clock)
    calls(breaker, ok=11, failed=9)
    for _ in range(29):
        calls(breaker, ok=1, failed=1)
    calls(breaker, ok=1)  # 38 of 79 < 50 %
    assert breaker.state is CLOSED


def test_a_success_never_opens_it(clock: ManualClock) -> None:
    breaker = ratio_only(clock)
    calls(breaker, failed=10, ok=9)
    assert breaker.state is CLOSED
    calls(breaker, ok=1)  # 10 failures of 20 calls, but the last one succeeded
    assert breaker.state is CLOSED
    calls(breaker, failed=1)  # the next failure is judged: 11 of 21
    assert breaker.state is OPEN


def test_failures_in_a_row_open_it_whatever_came_before(clock: ManualClock) -> None:
    breaker = make(clock)
    calls(breaker, ok=500)  # a busy target, healthy until now
    clock.advance(0.1)
    calls(breaker, failed=9)
    assert breaker.state is CLOSED
    calls(breaker, failed=1)  # 10 in a row: 10 of 510 in the window, but all of the newest
    assert breaker.state is OPEN


def test_a_success_breaks_the_run_of_failures(clock: ManualClock) -> None:
    breaker = make(clock)
    calls(breaker, ok=500)
    calls(breaker, failed=9)
    calls(breaker, ok=1)
    calls(breaker, failed=9)
    assert breaker.state is CLOSED


def test_failures_the_target_answered_count_for_the_ratio_but_make_no_run(
    clock: ManualClock,
) -> None:
    """A burst of "overloaded" replies (one batch refused) is an answering target: no run
    of silence; enough of them still open it by the ratio."""
    breaker = make(clock)
    calls(breaker, ok=100)
    for _ in range(30):
        assert breaker.allow()
        breaker.record_failure(answered=True)
    assert breaker.state is CLOSED
    calls(breaker, failed=9)  # a run starts after the last answer
    assert breaker.state is CLOSED
    for _ in range(61):  # 100 of 200 failed: the ratio
        assert breaker.allow()
        breaker.record_failure(answered=True)
    assert breaker.state is OPEN


def test_a_run_of_failures_older_than_the_window_starts_again(clock: ManualClock) -> None:
    breaker = make(clock)
    calls(breaker, failed=5)
    clock.advance(10.0)
    calls(breaker, failed=5)  # 10 in a row, but spread over more than the window
    assert breaker.state is CLOSED


def test_failures_expire_as_the_window_slides(clock: ManualClock) -> None:
    breaker = ratio_only(clock)
    calls(breaker, failed=19)
    clock.advance(10.0)
    calls(breaker, failed=1)  # the 19 are out of the window
    assert breaker.state is CLOSED
    assert breaker.snapshot().failures == 1


def test_failures_within_the_window_still_count(clock: ManualClock) -> None:
    breaker = ratio_only(clock)
    calls(breaker, failed=10)
    clock.advance(5.0)
    calls(breaker, ok=9)
    clock.advance(4.9)
    assert breaker.snapshot().calls == 19
    calls(breaker, failed=1)
    assert breaker.state is OPEN


def test_only_part_of_the_window_expires(clock: ManualClock) -> None:
    breaker = ratio_only(clock)
    calls(breaker, failed=10)  # t = 0
    clock.advance(6.0)
    calls(breaker, ok=9)
    calls(breaker, failed=1)  # t = 6: 11 of 20 failed
    assert breaker.state is OPEN

    breaker = ratio_only(clock)
    calls(breaker, failed=9)
    clock.advance(6.0)
    calls(breaker, ok=9)
    clock.advance(5.0)  # the failures leave, the successes stay
    snap = breaker.snapshot()
    assert (snap.calls, snap.failures) == (9, 0)


# -- open → half-open → closed / open --------------------------------------------------


def test_open_breaker_half_opens_after_the_base_wait(clock: ManualClock) -> None:
    breaker = make(clock)
    trip(breaker)
    assert breaker.retry_at == clock.monotonic() + 2.0
    clock.advance(1.99)
    assert not breaker.allow()
    assert breaker.state is OPEN
    clock.advance(0.01)
    assert breaker.state is HALF_OPEN
    assert breaker.allow()


def test_half_open_lets_at_most_n_trials_at_once(clock: ManualClock) -> None:
    breaker = make(clock)
    trip(breaker)
    half_open(breaker, clock)
    assert [breaker.allow() for _ in range(5)] == [True, True, True, False, False]
    assert breaker.retry_at is not None  # every slot taken
    breaker.release()
    assert breaker.retry_at is None
    assert breaker.allow()
    assert not breaker.allow()


def test_half_open_closes_after_the_required_successful_trials(clock: ManualClock) -> None:
    breaker = make(clock)
    trip(breaker)
    half_open(breaker, clock)
    assert breaker.allow()
    assert breaker.allow()
    breaker.record_success()
    assert breaker.state is HALF_OPEN
    breaker.record_success()
    assert breaker.state is CLOSED
    assert breaker.allow()
    assert breaker.snapshot().calls == 0  # a fresh window after closing


def test_sequential_trials_also_close_it(clock: ManualClock) -> None:
    breaker = make(clock, half_open_max_calls=1)
    trip(breaker)
    half_open(breaker, clock)
    assert breaker.allow()
    assert not breaker.allow()
    breaker.record_success()
    assert breaker.allow()
    breaker.record_success()
    assert breaker.state is CLOSED


def test_a_failed_trial_reopens_it_with_a_longer_wait(clock: ManualClock) -> None:
    breaker = make(clock)
    trip(breaker)
    half_open(breaker, clock)
    assert breaker.allow()
    assert breaker.allow()
    breaker.record_success()
    breaker.record_failure()
    assert breaker.state is OPEN
    assert breaker.retry_at == clock.monotonic() + 4.0
    # the other trial reports late: old news, the breaker stays open
    breaker.record_success()
    assert breaker.state is OPEN


def test_the_wait_doubles_up_to_the_cap_and_resets_after_closing(clock: ManualClock) -> None:
    breaker = make(clock, open_base_sec=2.0, open_max_sec=10.0)
    trip(breaker)
    waits = []
    for _ in range(5):
        retry_at = breaker.retry_at
        assert retry_at is not None
        waits.append(retry_at - clock.monotonic())
        half_open(breaker, clock)
        assert breaker.allow()
        breaker.record_failure()
    assert waits == [2.0, 4.0, 8.0, 10.0, 10.0]
    assert breaker.snapshot().consecutive_trips == 6

    half_open(breaker, clock)
    calls(breaker, ok=2)
    assert breaker.state is CLOSED
    trip(breaker)
    assert breaker.retry_at == clock.monotonic() + 2.0
    snap = breaker.snapshot()
    assert (snap.trips, snap.consecutive_trips) == (7, 1)


def test_half_open_cannot_get_stuck_when_trials_never_report(clock: ManualClock) -> None:
    breaker = make(clock, half_open_timeout_sec=30.0)
    trip(breaker)
    half_open(breaker, clock)
    for _ in range(3):
        assert breaker.allow()  # callers that crash and never report
    assert not breaker.allow()
    assert breaker.retry_at == clock.monotonic() + 30.0
    clock.advance(29.9)
    assert not breaker.allow()
    clock.advance(0.1)
    assert breaker.allow()
    breaker.record_success()
    assert breaker.allow()
    breaker.record_success()
    assert breaker.state is CLOSED


def test_release_frees_a_trial_slot_without_changing_state(clock: ManualClock) -> None:
    breaker = make(clock, half_open_max_calls=1)
    trip(breaker)
    half_open(breaker, clock)
    for _ in range(5):  # e.g. contract errors: say nothing about the target's health
        assert breaker.allow()
        breaker.release()
        assert breaker.state is HALF_OPEN
    assert breaker.allow()
    breaker.record_success()
    breaker.release()  # a stray release with no trial in flight takes nothing
    assert breaker.allow()
    breaker.record_success()
    assert breaker.state is CLOSED


def test_release_while_closed_changes_nothing(clock: ManualClock) -> None:
    breaker = make(clock)
    assert breaker.allow()
    breaker.release()
    assert breaker.snapshot().calls == 0
    assert breaker.state is CLOSED


def test_outcomes_reported_while_open_are_ignored(clock: ManualClock) -> None:
    breaker = make(clock)
    trip(breaker)
    retry_at = breaker.retry_at
    calls_before = breaker.snapshot()
    for _ in range(5):
        breaker.record_failure()
        breaker.record_success()
    assert breaker.retry_at == retry_at
    assert breaker.snapshot() == calls_before


def test_late_reports_after_half_open_do_not_count_as_trials(clock: ManualClock) -> None:
    breaker = make(clock)
    trip(breaker)
    half_open(breaker, clock)
    # calls let through before the trip report now: no trial is in flight
    breaker.record_success()
    breaker.record_success()
    breaker.record_failure()
    assert breaker.state is HALF_OPEN


# -- listeners and errors ----------------------------------------------------------------


def test_on_change_sees_every_transition(clock: ManualClock) -> None:
    seen: list[tuple[str, BreakerState, BreakerState]] = []
    breaker = CircuitBreaker("agent-a", BreakerConfig(), clock, on_change=lambda *a: seen.append(a))
    trip(breaker)
    half_open(breaker, clock)
    assert breaker.allow()
    breaker.record_failure()
    half_open(breaker, clock)
    calls(breaker, ok=2)
    assert seen == [
        ("agent-a", CLOSED, OPEN),
        ("agent-a", OPEN, HALF_OPEN),
        ("agent-a", HALF_OPEN, OPEN),
        ("agent-a", OPEN, HALF_OPEN),
        ("agent-a", HALF_OPEN, CLOSED),
    ]
    assert [new.value for _, _, new in seen] == [
        "open",
        "half_open",
        "open",
        "half_open",
        "closed",
    ]


def test_a_failing_listener_does_not_break_the_breaker(
    clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(target: str, old: BreakerState, new: BreakerState) -> None:
        raise RuntimeError("metrics backend down")

    breaker = CircuitBreaker("agent-a", BreakerConfig(), clock, on_change=broken)
    trip(breaker)
    assert not breaker.allow()
    half_open(breaker, clock)
    calls(breaker, ok=2)
    assert breaker.state is CLOSED
    assert "metrics backend down" in caplog.text


def test_open_error_says_when_to_retry(clock: ManualClock) -> None:
    breaker = make(clock)
    trip(breaker)
    clock.advance(0.5)
    err = breaker.open_error()
    assert isinstance(err, CircuitOpen)
    assert err.target == "agent-a"
    assert err.retry_at == breaker.retry_at == clock.monotonic() + 1.5
    assert err.retry_in == pytest.approx(1.5)
    assert "1.50s" in str(err)


def test_snapshot_is_a_small_frozen_record(clock: ManualClock) -> None:
    breaker = make(clock)
    calls(breaker, ok=3, failed=2)
    snap = breaker.snapshot()
    assert snap == BreakerSnapshot(
        target="agent-a",
        state=CLOSED,
        calls=5,
        failures=2,
        trials=0,
        retry_at=None,
        trips=0,
        consecutive_trips=0,
    )
    with pytest.raises(AttributeError):
        snap.state = OPEN  # type: ignore[misc]


# -- the board ---------------------------------------------------------------------------


def test_board_creates_breakers_lazily_and_keeps_them(clock: ManualClock) -> None:
    changes: list[tuple[str, BreakerState, BreakerState]] = []
    board = BreakerBoard(BreakerConfig(min_calls=2), clock, on_change=lambda *a: changes.append(a))
    assert len(board) == 0
    assert board.peek("a") is None
    breaker = board.get("a")
    assert board.get("a") is breaker
    assert "a" in board
    calls(breaker, failed=2)
    calls(board.get("b"), ok=1)
    snaps = board.snapshot()
    assert snaps["a"].state is OPEN
    assert snaps["b"].state is CLOSED
    assert changes == [("a", CLOSED, OPEN)]
    board.forget("a")
    assert "a" not in board


def test_earliest_retry_at_over_targets(clock: ManualClock) -> None:
    board = BreakerBoard(BreakerConfig(min_calls=1, open_base_sec=2.0), clock)
    calls(board.get("a"), failed=1)
    clock.advance(1.0)
    calls(board.get("b"), failed=1)
    now = clock.monotonic()
    assert board.earliest_retry_at(["a", "b"]) == now + 1.0
    assert board.earliest_retry_at(["b"]) == now + 2.0
    assert board.earliest_retry_at(["b", "never-called"]) == now  # no breaker = closed
    assert board.earliest_retry_at([]) == now  # nothing to wait for
    clock.advance(1.0)
    assert board.earliest_retry_at(["a", "b"]) == clock.monotonic()  # a half-opens now


def test_a_trial_in_flight_is_a_chance_now_for_a_waiting_call(clock: ManualClock) -> None:
    """Every trial slot taken: operators see the slots' upper bound (``retry_at``), while
    a waiting call is told to look again now: the trial's outcome closes the breaker or
    frees its slot long before that bound."""
    board = BreakerBoard(BreakerConfig(min_calls=1, open_base_sec=2.0), clock)
    breaker = board.get("a")
    calls(breaker, failed=1)
    assert breaker.next_chance() == clock.monotonic() + 2.0  # open: when it half-opens
    clock.advance(2.0)
    assert breaker.next_chance() is None  # half-open with a free slot
    while breaker.allow():
        pass
    now = clock.monotonic()
    assert breaker.retry_at is not None
    assert breaker.retry_at > now + 1.0
    assert breaker.next_chance() == now
    assert board.earliest_retry_at(["a"]) == now
    breaker.record_failure()  # the trial failed: open again, for twice as long
    assert breaker.next_chance() == now + 4.0


# -- the registry's word -------------------------------------------------------------------


def test_the_open_wait_stays_short_while_the_registry_reports_the_target_healthy(
    clock: ManualClock,
) -> None:
    breaker = make(clock)
    breaker.registry_health(True)
    waits = []
    trip(breaker)
    for n in range(4):
        if n:
            calls_fail_trial(breaker)  # trips in a row
        retry_at = breaker.retry_at
        assert retry_at is not None
        waits.append(retry_at - clock.monotonic())
        half_open(breaker, clock)
    assert waits == [0.5, 0.5, 0.5, 0.5]
    breaker.registry_health(False)  # its probes fail now: the wait has grown meanwhile
    calls_fail_trial(breaker)
    assert breaker.retry_at == clock.monotonic() + 32.0


def calls_fail_trial(breaker: CircuitBreaker) -> None:
    assert breaker.allow()
    breaker.record_failure()
    assert breaker.state is OPEN


def test_healthy_again_in_the_registry_half_opens_at_once(clock: ManualClock) -> None:
    breaker = make(clock)
    trip(breaker)
    breaker.registry_health(False)
    assert not breaker.allow()
    breaker.registry_health(True)  # its registrar's probe passed again
    assert breaker.state is HALF_OPEN
    calls(breaker, ok=2)
    assert breaker.state is CLOSED


def test_healthy_news_while_healthy_changes_no_wait(clock: ManualClock) -> None:
    breaker = make(clock)
    breaker.registry_health(True)
    trip(breaker)
    breaker.registry_health(True)  # every heartbeat's record says so again
    assert breaker.state is OPEN


def test_the_board_remembers_the_registry_for_breakers_made_later(clock: ManualClock) -> None:
    board = BreakerBoard(BreakerConfig(), clock)
    board.registry_health("a", True)
    board.registry_health("b", True)
    board.registry_health("b", False)
    trip(board.get("a"))
    trip(board.get("b"))
    now = clock.monotonic()
    assert (board.get("a").retry_at, board.get("b").retry_at) == (now + 0.5, now + 2.0)
    board.forget("a")
    trip(board.get("a"))
    assert board.get("a").retry_at == now + 2.0
