"""Tenacity strategies for the retry rule, run through tenacity itself on a manual clock
(its sleeps move the clock: nothing waits)."""

from __future__ import annotations

import itertools

import pytest
from tenacity import AsyncRetrying, RetryCallState, RetryError, retry_if_exception_type

from reach.clock import ManualClock
from reach.deadline import Deadline
from reach.errors import ConfigurationError, NoResponders, ReachTimeout
from reach.resilience import stop_at_deadline, stop_for_call, wait_backoff


def state(attempt: int, upcoming_sleep: float = 0.0) -> RetryCallState:
    rs = RetryCallState(AsyncRetrying(), fn=None, args=(), kwargs={})
    rs.attempt_number = attempt
    rs.upcoming_sleep = upcoming_sleep
    return rs


def test_backoff_doubles_from_200_ms_without_jitter() -> None:
    wait = wait_backoff(rng=lambda: 0.0)
    assert [wait(state(n)) for n in (1, 2, 3)] == pytest.approx([0.2, 0.4, 0.8])


def test_jitter_adds_up_to_100_ms() -> None:
    assert wait_backoff(rng=lambda: 1.0)(state(1)) == pytest.approx(0.3)
    wait = wait_backoff()  # the real random.random
    for n, base in ((1, 0.2), (2, 0.4), (3, 0.8)):
        for _ in range(200):
            assert base <= wait(state(n)) <= base + 0.1


def test_delay_gives_the_same_sleeps_outside_tenacity() -> None:
    wait = wait_backoff(rng=lambda: 0.5)
    assert [wait.delay(n) for n in (1, 2, 3)] == pytest.approx([0.25, 0.45, 0.85])


def test_backoff_never_overflows() -> None:
    assert wait_backoff(rng=lambda: 0.0)(state(10_000)) > 0


def test_negative_base_is_refused() -> None:
    with pytest.raises(ConfigurationError):
        wait_backoff(base=-1)


def test_stop_at_deadline_looks_at_the_end_of_the_coming_sleep() -> None:
    clock = ManualClock()
    deadline = Deadline.after(1.0, clock)
    stop = stop_at_deadline(deadline)
    assert not stop(state(1, upcoming_sleep=0.99))
    assert stop(state(1, upcoming_sleep=1.0))
    assert stop(state(1, upcoming_sleep=1.5))
    assert not stop_at_deadline(None)(state(1, upcoming_sleep=1e9))
    with_margin = stop_at_deadline(deadline, min_attempt_sec=0.5)
    assert with_margin(state(1, upcoming_sleep=0.6))
    clock.advance(0.5)  # the deadline comes nearer as its clock moves
    assert stop(state(1, upcoming_sleep=0.5))
    assert not stop(state(1, upcoming_sleep=0.49))


class Flaky:
    """Fails with ``errors`` then succeeds, counting attempts."""

    def __init__(self, *errors: Exception) -> None:
        self.errors = list(errors)
        self.attempts = 0

    async def __call__(self) -> str:
        self.attempts += 1
        if self.errors:
            raise self.errors.pop(0)
        return "ok"


def retrying(clock: ManualClock, deadline: Deadline | None) -> AsyncRetrying:
    return AsyncRetrying(
        wait=wait_backoff(rng=itertools.cycle([0.0, 0.5, 1.0]).__next__),
        stop=stop_for_call(deadline),
        retry=retry_if_exception_type((NoResponders, ReachTimeout)),
        sleep=clock.sleep,
    )


async def test_at_most_three_retries() -> None:
    clock = ManualClock()
    call = Flaky(*(NoResponders("nobody") for _ in range(10)))
    with pytest.raises(RetryError) as info:
        await retrying(clock, None)(call)
    assert call.attempts == 4
    assert clock.slept == pytest.approx([0.2, 0.45, 0.9])
    assert isinstance(info.value.last_attempt.exception(), NoResponders)


async def test_a_retry_that_succeeds_returns_its_result() -> None:
    clock = ManualClock()
    call = Flaky(ReachTimeout("slow"))
    assert await retrying(clock, None)(call) == "ok"
    assert call.attempts == 2
    assert clock.slept == pytest.approx([0.2])


async def test_no_retry_whose_sleep_would_end_past_the_deadline() -> None:
    clock = ManualClock()
    # attempts take no time here; sleeps 0.2 + 0.45 end at 0.65, the third (0.9) would not fit
    deadline = Deadline.after(1.0, clock)
    call = Flaky(*(NoResponders("nobody") for _ in range(10)))
    with pytest.raises(RetryError):
        await retrying(clock, deadline)(call)
    assert call.attempts == 3
    assert clock.slept == pytest.approx([0.2, 0.45])
    assert not deadline.expired()
    assert deadline.remaining() == pytest.approx(1.0 - 0.65)  # the sleeps moved the clock


async def test_past_the_deadline_there_is_no_retry_at_all() -> None:
    clock = ManualClock()
    call = Flaky(NoResponders("nobody"))
    with pytest.raises(RetryError):
        await retrying(clock, Deadline.after(0.0, clock))(call)
    assert (call.attempts, clock.slept) == (1, [])


def test_max_retries_must_not_be_negative() -> None:
    with pytest.raises(ConfigurationError):
        stop_for_call(None, max_retries=-1)
