"""Background tasks that really stop.

Python 3.11's ``asyncio.wait_for`` can swallow a cancellation that arrives just as the
awaited future completes (nats-py awaits with it on every request), so a single
``task.cancel()`` may be lost and a loop keeps running. ``cancel_and_wait`` cancels
again until every task is done; the waits of our own loops go through ``asyncio.timeout``
instead (``wait_set``), which loses none: the one cancellation Ctrl-C sends a command's
main task must end it.
"""

from __future__ import annotations

import asyncio
import contextvars
import heapq
import logging
from collections.abc import Callable, Coroutine, Generator, Iterable
from contextvars import ContextVar
from typing import Any

log = logging.getLogger("reach.tasks")

__all__ = [
    "DEADLINE_CANCEL",
    "EAGER",
    "PENDING_DEADLINE",
    "DeadlineReaper",
    "cancel_and_wait",
    "run_eagerly",
    "step_now",
    "wait_set",
]


async def wait_set(event: asyncio.Event, timeout: float | None) -> bool:
    """Whether ``event`` was set within ``timeout`` seconds (None: however long it takes).
    A cancellation that comes as the event is set is raised, never lost."""
    try:
        async with asyncio.timeout(timeout):
            await event.wait()
    except TimeoutError:
        return False
    return True


async def cancel_and_wait(tasks: Iterable[asyncio.Task[object] | asyncio.Task[None]]) -> None:
    pending = {t for t in tasks if not t.done()}
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=0.5)


DEADLINE_CANCEL = "reach: the caller's deadline passed"


class DeadlineReaper:
    """Cancels tasks whose deadline passed, with one timer for all of them.

    ``asyncio.timeout`` per call costs a timer handle and a context object per call;
    here a call costs one heap push. Deadlines are
    loop times; the reaper wakes at the earliest one and cancels what is overdue with
    the message ``DEADLINE_CANCEL``, so the task can tell a deadline from a shutdown.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, asyncio.Task[object]]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = float("inf")
        self._seq = 0

    def watch(self, task: asyncio.Task[object], when: float) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (when, self._seq, task))
        if when < self._timer_at:
            self._arm(when)

    def _arm(self, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        loop = asyncio.get_running_loop()
        self._timer = loop.call_at(when, self._reap)
        self._timer_at = when

    def _reap(self) -> None:
        self._timer = None
        self._timer_at = float("inf")
        now = asyncio.get_running_loop().time()
        heap = self._heap
        while heap and heap[0][0] <= now:
            _, _, task = heapq.heappop(heap)
            if not task.done():
                task.cancel(DEADLINE_CANCEL)
        # drop finished tasks at the top so the heap does not hold on to them
        while heap and heap[0][2].done():
            heapq.heappop(heap)
        if heap:
            self._arm(heap[0][0])

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._heap.clear()


#: set while a coroutine runs its first step eagerly, outside any task of its own
EAGER: ContextVar[bool] = ContextVar("reach_eager", default=False)
#: the deadline (loop time) an eager step asked for, picked up if it continues in a task
PENDING_DEADLINE: ContextVar[float | None] = ContextVar("reach_pending_deadline", default=None)


class _Resume:
    """Continue, inside a task, a coroutine whose first step already ran and yielded."""

    __slots__ = ("_coro", "_yielded")

    def __init__(self, coro: Coroutine[Any, Any, Any], yielded: Any) -> None:
        self._coro = coro
        self._yielded = yielded

    def __await__(self) -> Generator[Any, None, Any]:
        coro, yielded = self._coro, self._yielded
        while True:
            try:
                yield yielded  # the task waits on what the coroutine waits on
            except BaseException as exc:  # cancellation and errors go into the coroutine
                try:
                    yielded = coro.throw(exc)
                except StopIteration as stop:
                    return stop.value
            else:
                try:
                    yielded = coro.send(None)
                except StopIteration as stop:
                    return stop.value


async def _resume(coro: Coroutine[Any, Any, Any], yielded: Any) -> None:
    await _Resume(coro, yielded)


def step_now(coro: Coroutine[Any, Any, None]) -> asyncio.Task[None] | None:
    """Run ``coro`` at once from synchronous code; only if it must wait, continue it in a
    task, which is returned (keep a reference until it is done). Its errors propagate
    from the first step, and are the task's after that."""
    try:
        yielded = coro.send(None)
    except StopIteration:
        return None
    return asyncio.get_running_loop().create_task(_resume(coro, yielded))


def run_eagerly(
    coro: Coroutine[Any, Any, None],
    *,
    on_task: Callable[[asyncio.Task[None], float | None], None],
) -> None:
    """Run ``coro``'s first step now; only if it must wait, continue it in a new task.

    A call whose handler does not wait (the common, fast case) then costs no task and no
    extra trip through the event loop. ``on_task(task, deadline)`` receives the task of a
    coroutine that continues, with the deadline its first step registered (if any).
    """
    eager = EAGER.set(True)
    if PENDING_DEADLINE.get() is not None:
        PENDING_DEADLINE.set(None)  # left by an earlier step that finished: not this call's
    try:
        yielded = coro.send(None)
    except StopIteration:
        return
    except Exception:
        log.exception("a call failed in its first step")
        return
    finally:
        EAGER.reset(eager)
    deadline = PENDING_DEADLINE.get()
    if deadline is not None:
        PENDING_DEADLINE.set(None)
    task = asyncio.get_running_loop().create_task(
        _resume(coro, yielded), context=contextvars.copy_context()
    )
    on_task(task, deadline)
