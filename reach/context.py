"""The call being served, as a context variable, so nested calls inherit its deadline.

A handler that calls another capability needs no plumbing: the client reads the
current call's deadline and never waits past it (A → B → C never runs past A's budget).
"""

from __future__ import annotations

import time
from contextvars import ContextVar
from dataclasses import dataclass

__all__ = ["CallContext", "current_call", "remaining_seconds"]


@dataclass(frozen=True, slots=True)
class CallContext:
    call_id: str
    capability: str
    agent_id: str
    #: absolute deadline, Unix milliseconds (None: the caller set none)
    deadline_ms: int | None
    attempt: int = 1
    caller: str | None = None
    traceparent: str | None = None


class _Pending:
    """A call's fields, made into a CallContext only when someone asks for it: most
    handlers never do, and building a frozen dataclass on every call would cost them all."""

    __slots__ = ("_ctx", "args")

    def __init__(self, args: tuple[str, str, str, int | None, int, str | None, str | None]):
        self.args = args
        self._ctx: CallContext | None = None

    def get(self) -> CallContext:
        ctx = self._ctx
        if ctx is None:
            ctx = self._ctx = CallContext(*self.args)
        return ctx


_current: ContextVar[CallContext | _Pending | None] = ContextVar("reach_current_call", default=None)


def current_call() -> CallContext | None:
    """The call this task is serving, if any."""
    ctx = _current.get()
    if ctx is None or type(ctx) is CallContext:
        return ctx
    return ctx.get()  # type: ignore[union-attr]


def remaining_seconds(deadline_ms: int | None, now: float | None = None) -> float | None:
    if deadline_ms is None:
        return None
    return deadline_ms / 1000.0 - (time.time() if now is None else now)


def set_current(ctx: CallContext | None) -> None:
    # set, never reset by token: a call's first step may run eagerly in one context and
    # finish in a task with a copy of it, where the token would not be valid
    _current.set(ctx)


def enter_call(
    call_id: str,
    capability: str,
    agent_id: str,
    deadline_ms: int | None,
    attempt: int,
    caller: str | None,
    traceparent: str | None,
) -> None:
    """``set_current`` for the call path: the CallContext is built on first use."""
    _current.set(
        _Pending((call_id, capability, agent_id, deadline_ms, attempt, caller, traceparent))
    )
