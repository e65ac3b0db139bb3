"""The retry policy: what a call does after its first attempt failed.

Only retryable errors are retried (reachability, never contract, business or auth), a
timed-out attempt only when the capability is idempotent or the call carries an
idempotency key, never past the call's deadline, at most ``max_retries`` times, and only
while the client's retry budget allows (retries are a bounded share of calls, so a
failing fabric is not hit by a retry storm). Backoff is 200 ms × 2^n plus jitter, slept
on the client's clock (``Clock.sleep``: a test's ``ManualClock`` runs it at once); after
"no responders" the first retry goes to another instance at once (the request reached
nobody: waiting spares no one).

While the fabric settles after a reconnect, a call that reached nobody waits for an
instance within its deadline instead (``wait_for_instance``); a call that found every
candidate's breaker open waits for the earliest half-open trial, if its deadline reaches
it and it has no fallback to answer with at once (``wait_for_trial``).
"""

from __future__ import annotations

from typing import Any

from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt

from reach.caller.attempt import AttemptRunner
from reach.caller.callstate import CallState, has_other
from reach.clock import Clock
from reach.errors import (
    CircuitOpen,
    Disconnected,
    NoHealthyInstance,
    NoResponders,
    ReachError,
    ReachTimeout,
    RetriesExhausted,
    Unavailable,
)
from reach.resilience import RetryBudget, stop_at_deadline, wait_backoff
from reach.wire.envelope import RequestMeta

__all__ = ["RetryPolicy", "waits_for_instance"]

_BACKOFF_BASE = 0.2
#: the first pause of a call waiting for an instance while the fabric settles, and its cap
_SETTLE_PAUSE = 0.05
_SETTLE_PAUSE_MAX = 0.4
#: the first pause of a call waiting on trials in flight (the breakers say "now" until
#: a trial's outcome is known), and its cap
_TRIAL_PAUSE = 0.05
_TRIAL_PAUSE_MAX = 0.4


def waits_for_instance(error: ReachError, state: CallState) -> bool:
    """Whether a call may wait for an instance while the fabric settles after ``error``:
    it reached nobody, or found every instance unhealthy (probed while they were still
    reconnecting), or it was lost with a connection and is safe to send again (where a
    timeout would be retried)."""
    return isinstance(error, NoResponders | NoHealthyInstance) or (
        isinstance(error, Disconnected) and state.retry_timeouts
    )


class RetryPolicy:
    """Retries of one client's calls: ``max_retries`` at most, paid from ``budget``."""

    def __init__(
        self, runner: AttemptRunner, clock: Clock, budget: RetryBudget, max_retries: int
    ) -> None:
        self.budget = budget
        self.max_retries = max_retries
        self._runner = runner
        self._clock = clock

    async def recover(
        self,
        first: ReachError,
        state: CallState,
        meta: RequestMeta,
        body: bytes,
        *,
        trials: bool = True,
    ) -> Any:
        """The call's value after its first attempt failed with ``first``, or its error.
        ``trials``: wait for a half-open trial when every breaker is open (a call with a
        fallback answers with it at once instead)."""
        error: ReachError | None = first
        value: Any = None
        if isinstance(first, CircuitOpen):
            if trials:
                value, error = await self.wait_for_trial(first, state, meta, body)
        elif waits_for_instance(first, state) and self._runner.settling():
            value, error = await self.wait_for_instance(first, state, meta, body)
        if error is None:
            return value
        return await self.retry(error, state, meta, body, trials=trials)

    def should_retry(self, exc: ReachError, state: CallState) -> bool:
        """Whether ``exc`` may be retried (the retry budget is asked only once a retry will
        be made, so that retries never made cost nothing)."""
        if not exc.retryable or self._runner.closing or state.issuer_silent:
            return False
        if isinstance(exc, ReachTimeout) and not state.retry_timeouts:
            return False
        return not state.deadline.expired()

    async def retry(
        self,
        first_error: ReachError,
        state: CallState,
        meta: RequestMeta,
        body: bytes,
        *,
        trials: bool = True,
    ) -> Any:
        """Attempts after a failed first one: only retryable errors, with backoff. A retry
        that finds every breaker open waits for the earliest half-open trial (``trials``)
        as the first attempt would."""
        first_wait = self._first_wait(first_error, state)
        if first_wait is None or not self.budget.try_spend():  # paid for a retry made
            raise first_error
        clock = self._clock
        if first_wait:
            await clock.sleep(first_wait)
        # the budget pays for a retry as it starts (the first one was paid above): a retry
        # that tenacity's stop rules (count, deadline) never start costs nothing
        refused = [False]

        def should_retry(exc: BaseException) -> bool:
            return (
                not refused[0]
                and isinstance(exc, ReachError)
                and self.should_retry(exc, state)
                and state.attempts <= self.max_retries  # another one is allowed
            )

        retrying = AsyncRetrying(
            stop=stop_after_attempt(self.max_retries) | stop_at_deadline(state.deadline),
            wait=wait_backoff(base=2 * _BACKOFF_BASE),
            retry=retry_if_exception(should_retry),
            sleep=clock.sleep,
            reraise=True,
        )
        latest = first_error
        try:
            async for attempt in retrying:
                with attempt:
                    if attempt.retry_state.attempt_number > 1 and not self.budget.try_spend():
                        refused[0] = True
                        raise latest  # the budget is spent: the last error stands
                    try:
                        return await self._runner.attempt(state, meta, body)
                    except CircuitOpen as exc:
                        latest = exc
                        if not trials:
                            raise
                    except ReachError as exc:
                        latest = exc
                        raise
                    # every breaker open: wait for a trial (outside the except block: the
                    # compiled build cannot await inside one)
                    assert isinstance(latest, CircuitOpen)
                    value, error = await self.wait_for_trial(latest, state, meta, body)
                    if error is None:
                        return value
                    latest = error
                    raise error
        except ReachError as exc:
            if not exc.retryable:
                # a retry reached an instance that answered: its business, contract or auth
                # error is the call's outcome as it is, not an exhausted retry
                raise
            raise RetriesExhausted(
                f"{state.capability}: {state.attempts} attempts failed,"
                f" last: {type(exc).__name__}: {exc}",
                attempts=state.attempts,
                last=exc,
            ) from exc
        raise AssertionError("unreachable")  # pragma: no cover

    def _first_wait(self, first_error: ReachError, state: CallState) -> float | None:
        """The pause before the first retry; None: no retry.

        Tenacity runs attempts 2.. after this first backoff (200 ms + jitter); its own
        waits are then 400 ms, 800 ms (+ jitter): 200 ms × 2^n overall."""
        if not self.should_retry(first_error, state) or self.max_retries == 0:
            return None
        first_wait = wait_backoff(base=_BACKOFF_BASE).delay(1)
        if isinstance(first_error, NoResponders | Unavailable) and has_other(state):
            # the request reached nobody, or an instance that answered it will not take
            # calls now (not ready, at capacity): another instance may take it at once,
            # and waiting only spends the deadline
            first_wait = 0.0
        if first_wait >= state.deadline.remaining():
            return None
        return first_wait

    async def wait_for_trial(
        self, error: CircuitOpen, state: CallState, meta: RequestMeta, body: bytes
    ) -> tuple[Any, ReachError | None]:
        """Every candidate's breaker is open: wait for the earliest half-open trial, as
        long as the deadline reaches it, instead of failing with the deadline unspent. The
        call may be the trial, or come after it once it closed the breaker; a trial that
        failed opens the breaker again, and the call waits again if it still can. Returns
        the value, or the last error (None: served)."""
        runner = self._runner
        current: ReachError = error
        pause = _TRIAL_PAUSE
        while isinstance(current, CircuitOpen) and not runner.closing:
            if current.retry_in > 0:  # a breaker half-opens then
                wait = max(current.retry_in, _TRIAL_PAUSE)
                pause = _TRIAL_PAUSE
            else:  # a trial is in flight: look again shortly, less often as it lasts
                wait = pause
                pause = min(pause * 2, _TRIAL_PAUSE_MAX)
            if wait >= state.deadline.remaining():
                break  # the breaker's error says when, which the deadline does not reach
            await self._clock.sleep(wait)
            try:
                return await runner.attempt(state, meta, body), None
            except ReachError as exc:
                current = exc
        return None, current

    async def wait_for_instance(
        self, error: ReachError, state: CallState, meta: RequestMeta, body: bytes
    ) -> tuple[Any, ReachError | None]:
        """While the fabric settles after a reconnect (or the connection is away), a call
        that reached nobody, or whose request was lost with the old socket where a retry
        is safe, waits for an instance within its deadline instead of failing: another
        candidate at once, else the same ones again after a short pause (growing to a few
        tenths of a second), as long as the deadline leaves room. Returns the value, or
        the last error (None: served)."""
        runner = self._runner
        pause = _SETTLE_PAUSE
        while waits_for_instance(error, state) and runner.settling() and not runner.closing:
            left = state.deadline.remaining()
            if left <= 0:
                break  # the last error says why, not a deadline passed
            if not has_other(state):
                if left <= pause:
                    break
                await self._clock.sleep(pause)
                pause = min(pause * 2, _SETTLE_PAUSE_MAX)
                state.failed.clear()  # every candidate is worth another try
            try:
                return await runner.attempt(state, meta, body), None
            except ReachError as exc:
                error = exc
        return None, error
