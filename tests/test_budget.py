"""The retry budget: 10 % of first attempts, with a floor, over a sliding minute; and a
floor of retries per second beside it."""

from __future__ import annotations

import pytest

from reach.clock import ManualClock
from reach.errors import ConfigurationError
from reach.resilience import RetryBudget


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


def spend_all(budget: RetryBudget) -> int:
    spent = 0
    while budget.try_spend():
        spent += 1
        assert spent < 10_000
    return spent


def test_a_quiet_caller_still_gets_the_floor(clock: ManualClock) -> None:
    budget = RetryBudget(clock=clock)
    budget.record_call()
    assert budget.available == 10
    assert spend_all(budget) == 10
    assert not budget.try_spend()
    assert budget.retries == 10


def test_retries_are_capped_at_ten_percent_of_calls(clock: ManualClock) -> None:
    budget = RetryBudget(clock=clock)
    for _ in range(500):
        budget.record_call()
    assert budget.available == 50
    assert spend_all(budget) == 50
    for _ in range(10):
        budget.record_call()
    assert spend_all(budget) == 1  # 510 calls allow 51 retries


def test_a_refused_retry_takes_nothing(clock: ManualClock) -> None:
    budget = RetryBudget(min_retries=1, min_per_sec=0, clock=clock)
    assert budget.try_spend()
    for _ in range(3):
        assert not budget.try_spend()
    assert budget.retries == 1


def test_the_window_slides(clock: ManualClock) -> None:
    budget = RetryBudget(min_per_sec=0, clock=clock)
    assert spend_all(budget) == 10
    clock.advance(30.0)
    assert not budget.try_spend()
    assert spend_all(budget) == 0
    clock.advance(30.0)  # the first ten retries left the window
    assert budget.retries == 0
    assert spend_all(budget) == 10


def test_calls_leave_the_window_too(clock: ManualClock) -> None:
    budget = RetryBudget(clock=clock)
    for _ in range(300):
        budget.record_call()
    clock.advance(59.0)
    assert budget.calls == 300
    clock.advance(1.0)
    assert budget.calls == 0
    assert budget.available == 10


def test_a_long_idle_spell_clears_everything(clock: ManualClock) -> None:
    budget = RetryBudget(clock=clock)
    for _ in range(100):
        budget.record_call()
    spend_all(budget)
    clock.advance(3_600.0)
    assert (budget.calls, budget.retries) == (0, 0)


def test_zero_floor_and_zero_ratio_allow_no_retry(clock: ManualClock) -> None:
    budget = RetryBudget(ratio=0.0, min_retries=0, min_per_sec=0, clock=clock)
    budget.record_call()
    assert not budget.try_spend()


def test_a_young_caller_retries_a_burst_beyond_its_share(clock: ManualClock) -> None:
    budget = RetryBudget(clock=clock)  # 10 % of the minute, and 10 a second
    for _ in range(200):  # one second old, at 200 calls a second
        budget.record_call()
    assert budget.available == 20
    assert spend_all(budget) == 20  # its share of the minute
    clock.advance(1.0)
    assert budget.available == 10
    assert spend_all(budget) == 10  # the share is spent: the floor of this second
    clock.advance(0.5)
    assert not budget.try_spend()  # same second
    clock.advance(0.5)
    assert spend_all(budget) == 10
    assert budget.retries == 40  # the window counts every retry, floor or share


def test_the_per_second_floor_caps_a_storm(clock: ManualClock) -> None:
    budget = RetryBudget(ratio=0.0, min_retries=0, min_per_sec=5, clock=clock)
    spent = 0
    for _ in range(100):  # ten seconds, a try every 0.1 s, ten tries each time
        spent += sum(budget.try_spend() for _ in range(10))
        clock.advance(0.1)
    assert spent == 50


@pytest.mark.parametrize(
    "bad",
    [
        {"ratio": -0.1},
        {"ratio": float("nan")},
        {"window_sec": 0},
        {"min_retries": -1},
        {"min_per_sec": -1},
        {"min_per_sec": 0.5},
        {"buckets": 0},
    ],
)
def test_bad_settings_are_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ConfigurationError):
        RetryBudget(**bad)  # type: ignore[arg-type]
