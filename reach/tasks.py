"""Background tasks that really stop.

Python 3.11's ``asyncio.wait_for`` can swallow a cancellation that arrives just as the
awaited future completes (nats-py awaits with it on every request), so a single
``task.cancel()`` may be lost and a loop keeps running. ``cancel_and_wait`` cancels
again until every task is done.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

__all__ = ["cancel_and_wait"]


async def cancel_and_wait(tasks: Iterable[asyncio.Task[object] | asyncio.Task[None]]) -> None:
    pending = {t for t in tasks if not t.done()}
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=0.5)
