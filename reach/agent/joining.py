"""Joining the fabric step by step (an agent's ``start``): a step that fails for a
transient reason (a timeout, a lost connection, a login no gate answered) is tried again
until the join's deadline, sleeping on the deadline's clock between tries, and the error
that ends the join names the step."""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable
from typing import TypeVar

from reach.deadline import Deadline
from reach.errors import ReachError, ReachTimeout, TransportError

__all__ = ["TRANSIENT", "at_step", "run_step"]

log = logging.getLogger("reach.agent.agent")

T = TypeVar("T")

#: failures of a step that trying again may cure
TRANSIENT: tuple[type[BaseException], ...] = (TransportError, TimeoutError)


async def run_step(
    who: str,
    step: str,
    deadline: Deadline,
    attempt: Callable[[], Awaitable[T]],
    transient: tuple[type[BaseException], ...] = TRANSIENT,
) -> T:
    """``attempt()``, tried again after a ``transient`` failure until ``deadline`` (with
    jittered back-off); the error that ends it names ``who`` and ``step`` (a bare timeout
    becomes ReachTimeout)."""
    delay = 0.1
    while True:
        # no await inside the except blocks: compiled by mypyc, an await there loses track
        # of which exception is being handled
        try:
            return await attempt()
        except transient as exc:
            failure: BaseException = exc
            final = False
        except (ReachError, TimeoutError) as exc:
            failure = exc
            final = True
        if final or delay > deadline.remaining():
            raise at_step(who, step, failure)
        log.info("%s: %s failed (%s); trying again", who, step, failure)
        await deadline.clock.sleep(delay * (0.5 + random.random()))
        delay = min(delay * 2, 2.0)


def at_step(who: str, step: str, exc: BaseException) -> ReachError:
    """``exc`` as the error of joining at ``step``: a ReachError keeps its type and
    cause, its message now begins with ``who`` and the step; anything else (a bare
    timeout) becomes ReachTimeout caused by it."""
    said = str(exc) or type(exc).__name__
    where = f"{who} cannot join the fabric: {step}: "
    if isinstance(exc, ReachError):
        exc.args = (where + said, *exc.args[1:])
        return exc
    err = ReachTimeout(f"{where}no answer in time ({said})")
    err.__cause__ = exc
    return err
