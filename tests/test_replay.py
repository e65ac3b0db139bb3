"""The callee's memory of served calls: each kept until its deadline, bounded in size."""

from __future__ import annotations

import pytest

from reach.clock import ManualClock
from reach.security.replay import RecentCalls


def test_a_call_is_served_once_while_its_deadline_lives_and_a_retry_is_not_a_replay() -> None:
    clock = ManualClock(start=1000.0, wall=1000.0)
    recent = RecentCalls(clock=clock)
    assert recent.first_time("client-a", "c1", 1, 1005.0)
    assert not recent.first_time("client-a", "c1", 1, 1005.0)
    assert recent.first_time("client-a", "c1", 2, 1006.0)  # the next attempt of the same call
    clock.advance(4.0)
    assert not recent.first_time("client-a", "c1", 1, 1005.0)  # still within its deadline


def test_calls_are_forgotten_once_their_deadlines_pass() -> None:
    clock = ManualClock(start=1000.0, wall=1000.0)
    recent = RecentCalls(clock=clock)
    for i in range(100):
        assert recent.first_time("client-a", f"c{i}", 1, 1000.0 + 1 + i % 3)
    clock.advance(10.0)
    assert recent.first_time("client-a", "new", 1, 1015.0)
    assert len(recent) == 1


def test_a_long_deadline_in_front_keeps_the_ones_behind_it_no_shorter() -> None:
    clock = ManualClock(start=1000.0, wall=1000.0)
    recent = RecentCalls(clock=clock)
    recent.first_time("client-a", "long", 1, 2000.0)
    recent.first_time("client-a", "short", 1, 1001.0)
    clock.advance(5.0)
    recent.first_time("client-a", "next", 1, 1010.0)
    assert not recent.first_time("client-a", "short", 1, 1001.0)  # kept a little longer, refused
    assert not recent.first_time("client-a", "long", 1, 2000.0)


def test_memory_is_bounded_the_oldest_going_first() -> None:
    clock = ManualClock(start=1000.0, wall=1000.0)
    recent = RecentCalls(clock=clock, max_remembered=3)
    for name in ("a", "b", "c", "d"):
        recent.first_time("client-a", name, 1, 1100.0)
    assert len(recent) == 3
    assert recent.first_time("client-a", "a", 1, 1100.0)  # forgotten: the oldest
    assert not recent.first_time("client-a", "d", 1, 1100.0)
    with pytest.raises(ValueError, match="max_remembered"):
        RecentCalls(clock=clock, max_remembered=0)


def test_another_clients_call_with_the_same_id_and_attempt_is_its_own() -> None:
    """A client reusing another's call id does not make that caller's attempt a replay."""
    recent = RecentCalls(clock=ManualClock(wall=1000.0))
    assert recent.first_time("thief", "c1", 2, 1005.0)
    assert recent.first_time("victim", "c1", 2, 1005.0)
    assert not recent.first_time("victim", "c1", 2, 1005.0)
