"""Waiting for a condition by polling it, with a deadline: the tests' one way to do so.

Poll only for what has no event to wait on (a flag a library sets, a count, a process
gone from /proc, a record in a store). Where something says when it changes (an
``asyncio.Event``, a route cache's ``wait_for``, a subscription), wait on that instead.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from typing import TypeVar, overload

T = TypeVar("T")

#: how often a condition is checked unless told otherwise: no wait this helper replaced
#: checked less often, and a check is cheap (pass a longer ``interval`` where it is not)
INTERVAL = 0.01


@overload
async def until(
    check: Callable[[], Awaitable[T | None]],
    what: str = ...,
    *,
    timeout: float = ...,
    interval: float = ...,
) -> T: ...


@overload
async def until(
    check: Callable[[], T | None],
    what: str = ...,
    *,
    timeout: float = ...,
    interval: float = ...,
) -> T: ...


async def until(
    check: Callable[[], object],
    what: str = "the condition",
    *,
    timeout: float = 10.0,
    interval: float = INTERVAL,
) -> object:
    """The first truthy value of ``check()``, called every ``interval`` seconds.

    ``check`` may be sync or return an awaitable (an ``async def``, or a lambda calling
    one), which is awaited. After ``timeout`` seconds, a check still running included,
    this fails with an ``AssertionError`` naming ``what`` and the timeout. An exception
    ``check`` raises (a ``TimeoutError`` of its own too) propagates as it is.
    """
    scope = asyncio.timeout(timeout)
    try:
        async with scope:
            while True:
                got = check()
                if inspect.isawaitable(got):
                    got = await got
                if got:
                    return got
                await asyncio.sleep(interval)
    except TimeoutError:
        if not scope.expired():
            raise
        raise AssertionError(f"not within {timeout:g}s: {what}") from None
