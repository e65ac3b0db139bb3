"""run_eagerly: a call's first step runs at once; only a step that waits gets a task."""

from __future__ import annotations

import asyncio

from reach.tasks import PENDING_DEADLINE, run_eagerly


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
