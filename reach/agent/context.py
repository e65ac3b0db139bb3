"""The call being served, as a context variable, so nested calls inherit its deadline.

A handler that calls another capability needs no plumbing: the client reads the
current call's deadline and never waits past it (A → B → C never runs past A's budget).
A handler reads its own time left as ``current_call().deadline.remaining()``.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass

from reach.deadline import Deadline

__all__ = ["CallContext", "current_call"]


@dataclass(frozen=True, slots=True)
class CallContext:
    """The call being served: its id, capability and instance, its deadline, which
    attempt this is, the agent that called (if one did) and its W3C trace context."""

    call_id: str
    capability: str
    agent_id: str
    #: by when the caller must be answered, on the agent's clock (None: the caller set none)
    deadline: Deadline | None
    attempt: int = 1
    caller: str | None = None
    traceparent: str | None = None

    @property
    def deadline_ms(self) -> int | None:
        """The deadline as the request carried it: absolute, Unix milliseconds."""
        deadline = self.deadline
        return None if deadline is None else deadline.to_wire()


class _Pending:
    """A call's fields, made into a CallContext only when someone asks for it: most
    handlers never do, and building a frozen dataclass on every call would cost them all."""

    __slots__ = ("_ctx", "args")

    def __init__(
        self, args: tuple[str, str, str, Deadline | None, int, str | None, str | None]
    ) -> None:
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


def set_current(ctx: CallContext | None) -> None:
    # set, never reset by token: a call's first step may run eagerly in one context and
    # finish in a task with a copy of it, where the token would not be valid
    _current.set(ctx)


def enter_call(
    call_id: str,
    capability: str,
    agent_id: str,
    deadline: Deadline | None,
    attempt: int,
    caller: str | None,
    traceparent: str | None,
) -> None:
    """``set_current`` for the call path: the CallContext is built on first use."""
    _current.set(_Pending((call_id, capability, agent_id, deadline, attempt, caller, traceparent)))
