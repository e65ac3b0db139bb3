"""What a failed call answers with instead: a cached result, a backup, or a default.

A call falls back only after a reachability failure (nobody answered in time, breakers
open, no instance, retries exhausted), never after a contract, business or auth error:
those are answers. ``reach.resilience.fallback.Fallback`` says what to try, in order.
"""

from __future__ import annotations

from collections.abc import Awaitable, Iterable
from typing import Any, Protocol

from reach.caller.result import CallResult
from reach.clock import Clock
from reach.deadline import Deadline
from reach.errors import CircuitOpen, DiscoveryError, ReachError, RetriesExhausted
from reach.resilience.fallback import MISSING, NO_FALLBACK, Fallback, FallbackInfo, ResultCache
from reach.wire import codec

__all__ = ["Fallbacks", "falls_back"]


class CallFunction(Protocol):
    """``ReachClient.call``: a backup is called as any capability is."""

    def __call__(
        self,
        capability: str,
        payload: Any,
        *,
        timeout: float | None = None,
        tags: Iterable[str] = (),
        idempotency_key: str | None = None,
        fallback: Fallback | None = None,
    ) -> Awaitable[CallResult]: ...


def falls_back(exc: ReachError) -> bool:
    """Fallbacks cover reachability failures, never contract, business or auth errors."""
    return exc.retryable or isinstance(exc, CircuitOpen | DiscoveryError | RetriesExhausted)


class Fallbacks:
    """A client's fallbacks: the last good results it keeps, and how it falls back."""

    def __init__(self, clock: Clock, call: CallFunction) -> None:
        self.results = ResultCache()
        self._clock = clock
        self._call = call

    def remember(self, capability: str, body: bytes, value: Any) -> None:
        """A served call's value, for calls with the same payload that fall back to it."""
        self.results.put(capability, body, value, self._clock.monotonic())

    async def answer(
        self,
        capability: str,
        payload: Any,
        fb: Fallback,
        exc: ReachError,
        deadline: Deadline | None,
        started: float,
    ) -> CallResult:
        """The fallback's answer to a call that failed with ``exc`` (``deadline``: the
        call's, if its caller gave a timeout; ``started``: its start on the clock's
        ``perf_counter``); ``exc`` raised when none applies."""
        reason = f"{type(exc).__name__}: {exc}"
        if fb.cache_max_age_sec is not None:
            body = codec.encode(payload)
            hit = self.results.get(capability, body, self._clock.monotonic(), fb.cache_max_age_sec)
            if hit is not None:
                age, value = hit
                return self._result(capability, value, started, "cache", reason, age=age)
        # A timeout the caller gave bounds the whole call: the backup has what is left of
        # it (none left: no backup). Without one the backup has its own SLA's, as a call
        # of its own would (a served call's deadline still bounds it, as it bounds any).
        left = None if deadline is None else deadline.remaining()
        if (fb.backup_capability is not None or fb.backup_tags) and (left is None or left > 0):
            backup = fb.backup_capability or capability
            backup_error: ReachError | None = None
            try:
                # the backup's own failure ends it: no fallback of the fallback (the
                # client's default Fallback would call the backup again, for ever)
                result = await self._call(
                    backup, payload, timeout=left, tags=fb.backup_tags, fallback=NO_FALLBACK
                )
            except ReachError as failed:
                backup_error = failed
            if backup_error is not None:
                reason += f"; backup {backup} failed: {type(backup_error).__name__}: {backup_error}"
            else:
                return CallResult(
                    value=result.value,
                    capability=capability,
                    call_id=result.call_id,
                    agent_id=result.agent_id,
                    attempts=result.attempts,
                    latency_ms=(self._clock.perf_counter() - started) * 1000,
                    fallback=FallbackInfo(source="backup", reason=reason, backup=backup),
                )
        if fb.default is not MISSING:
            return self._result(capability, fb.default, started, "default", reason)
        raise exc

    def _result(
        self,
        capability: str,
        value: Any,
        started: float,
        source: Any,
        reason: str,
        age: float | None = None,
    ) -> CallResult:
        return CallResult(
            value=value,
            capability=capability,
            call_id="",
            agent_id="",
            attempts=0,
            latency_ms=(self._clock.perf_counter() - started) * 1000,
            fallback=FallbackInfo(source=source, reason=reason, age_sec=age),
        )
