"""A call's deadline: kept on its clock's monotonic scale, Unix milliseconds on the wire;
and sleeping on a clock, which a manual clock does without waiting."""

from __future__ import annotations

import asyncio
import time

import pytest

from reach.clock import ManualClock, system_clock
from reach.deadline import Deadline

WALL = 1_760_000_000.0


class WallSetBack(ManualClock):
    """A manual clock whose wall clock can be set without the monotonic one moving."""

    def __init__(self) -> None:
        super().__init__(wall=WALL)
        self.wall_shift = 0.0

    def time(self) -> float:
        return super().time() + self.wall_shift


def test_a_deadline_after_a_timeout_counts_down_on_its_clock() -> None:
    clock = ManualClock(wall=WALL)
    deadline = Deadline.after(2.0, clock)
    assert deadline.remaining() == 2.0
    assert not deadline.expired()
    clock.advance(1.5)
    assert deadline.remaining() == pytest.approx(0.5)
    clock.advance(0.5)
    assert deadline.expired()
    clock.advance(1.0)
    assert deadline.remaining() == pytest.approx(-1.0)


def test_on_the_wire_it_is_unix_milliseconds() -> None:
    clock = ManualClock(wall=WALL)
    assert Deadline.after(2.5, clock).to_wire() == int((WALL + 2.5) * 1000)


def test_a_deadline_read_from_the_wire_is_the_time_left_by_this_sides_wall_clock() -> None:
    clock = ManualClock(wall=WALL)
    deadline = Deadline.from_wire(int((WALL + 3) * 1000), clock)
    assert deadline.remaining() == pytest.approx(3.0)
    assert Deadline.from_wire(int((WALL - 1) * 1000), clock).expired()


def test_the_wire_value_goes_on_unchanged() -> None:
    clock = ManualClock(wall=WALL)
    for wire_ms in (1_760_000_000_001, 1_760_000_123_457, 1_799_999_999_999):
        assert Deadline.from_wire(wire_ms, clock).to_wire() == wire_ms


def test_a_wall_clock_set_back_changes_neither_the_time_left_nor_the_wire_value() -> None:
    clock = WallSetBack()
    deadline = Deadline.after(5.0, clock)
    sent = deadline.to_wire()
    clock.wall_shift = -3600.0
    clock.advance(1.0)
    assert deadline.remaining() == pytest.approx(4.0)
    assert deadline.to_wire() == sent


def test_an_attempt_given_less_time_sends_the_sooner_wire_value() -> None:
    clock = ManualClock(wall=WALL)
    deadline = Deadline.after(10.0, clock)
    clock.advance(1.0)
    assert deadline.to_wire_within(2.0) == int((WALL + 3.0) * 1000)
    assert deadline.to_wire_within(20.0) == deadline.to_wire()  # never past the deadline


async def test_a_manual_clock_sleeps_by_moving_and_notes_each_sleep() -> None:
    clock = ManualClock(wall=WALL)
    deadline = Deadline.after(1.0, clock)
    started = time.monotonic()
    await clock.sleep(0.25)
    await clock.sleep(0.5)
    await clock.sleep(0.0)
    await clock.sleep(-1.0)  # nothing: the clock never goes back
    assert time.monotonic() - started < 0.25  # no real waiting
    assert clock.slept == [0.25, 0.5, 0.0, -1.0]
    assert clock.monotonic() == pytest.approx(1_000.75)
    assert clock.time() == pytest.approx(WALL + 0.75)
    assert deadline.remaining() == pytest.approx(0.25)


async def test_a_manual_sleep_lets_other_tasks_run() -> None:
    clock = ManualClock()
    ran: list[str] = []

    async def other() -> None:
        ran.append("other")

    task = asyncio.create_task(other())
    await clock.sleep(0.1)
    assert ran == ["other"]
    await task


async def test_the_system_clock_sleeps_for_real() -> None:
    started = time.monotonic()
    await system_clock.sleep(0.05)
    assert time.monotonic() - started >= 0.05
