"""run_eagerly: a call's first step runs at once; only a step that waits gets a task."""

from __future__ import annotations

import asyncio

import pytest

from reach.tasks import PENDING_DEADLINE, cancel_and_wait, run_eagerly, wait_set


async def test_a_deadline_left_by_a_finished_step_is_not_handed_to_the_next_call() -> None:
    handed: list[float | None] = []
    tasks: list[asyncio.Task[None]] = []

    def on_task(task: asyncio.Task[None], deadline: float | None) -> None:
        tasks.append(task)
        handed.append(deadline)

    async def finishes_at_once() -> None:
        PENDING_DEADLINE.set(123.0)  # as CallServer does for a call with a deadline

    async def waits_without_deadline() -> None:
        await asyncio.sleep(0)

    run_eagerly(finishes_at_once(), on_task=on_task)
    run_eagerly(waits_without_deadline(), on_task=on_task)
    await asyncio.gather(*tasks)
    assert handed == [None]


async def test_a_step_that_waits_hands_over_its_own_deadline() -> None:
    handed: list[float | None] = []
    tasks: list[asyncio.Task[None]] = []

    def on_task(task: asyncio.Task[None], deadline: float | None) -> None:
        tasks.append(task)
        handed.append(deadline)

    async def waits_with_deadline() -> None:
        PENDING_DEADLINE.set(42.0)
        await asyncio.sleep(0)

    run_eagerly(waits_with_deadline(), on_task=on_task)
    await asyncio.gather(*tasks)
    assert handed == [42.0]


async def test_a_loop_that_loses_a_cancel_is_still_stopped() -> None:
    """Python 3.11's ``asyncio.wait_for`` returns the result of a future that completes
    together with the cancel and drops the cancel: a loop around such an await, cancelled
    once, runs on. Here the loop drops the first cancel itself, as that race does."""
    rounds = 0
    dropped = 0

    async def loop() -> None:
        nonlocal rounds, dropped
        while True:
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                if dropped:
                    raise
                dropped += 1
            rounds += 1

    task = asyncio.create_task(loop())
    await asyncio.sleep(0.03)
    await asyncio.wait_for(cancel_and_wait([task]), 10)
    assert task.cancelled()
    assert dropped == 1


async def test_wait_set_says_whether_the_event_came_in_time() -> None:
    event = asyncio.Event()
    assert not await wait_set(event, 0.01)
    asyncio.get_running_loop().call_soon(event.set)
    assert await wait_set(event, 10)
    assert await wait_set(event, None)  # already set: at once


async def test_wait_set_ends_on_a_cancellation_as_the_event_is_set() -> None:
    """The cancellation and the event in the same turn of the loop: the waiter ends
    cancelled, whichever the loop sees first (a loop that waits again would not end)."""
    for turns in range(4):
        event = asyncio.Event()
        waiter = asyncio.create_task(wait_set(event, 10))
        for _ in range(turns):
            await asyncio.sleep(0)
        event.set()
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
