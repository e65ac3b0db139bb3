"""The state of one connection to NATS: up, or down since when and why.

``Link`` logs each change once, not per attempt, and words the errors of operations
attempted while the connection is down; ``link.open_client`` keeps it up to date.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence

import nats.errors

from reach.errors import AuthenticationFailed, Disconnected, LoginUnanswered, ReachError

__all__ = ["Link", "is_refusal", "is_slow"]

log = logging.getLogger("reach.transport")

#: a refusal that took longer than this after the login was sent is the server's own
#: timeout (no login gate answered), not the gate's verdict on the credentials
_SLOW_REFUSAL = 1.0


def is_refusal(exc: BaseException) -> bool:
    """Did the server refuse the login (Authorization Violation, an auth timeout)?"""
    return isinstance(exc, nats.errors.AuthorizationError) or "authoriz" in str(exc).lower()


def _reason(exc: BaseException) -> str:
    text = str(exc).removeprefix("nats: ").strip("'") or type(exc).__name__
    return "Authorization Violation" if "authoriz" in text.lower() else text


class Link:
    """The state of one connection to NATS: up, or down since when and why.

    Each change (disconnected, login refused, login unanswered, reconnected, given up) is
    logged once, not per attempt. ``describe`` words it for the errors of operations
    attempted meanwhile."""

    def __init__(
        self, name: str, servers: Sequence[str], user: str | None, give_up_after: float | None
    ) -> None:
        self.name = name
        self.where = ", ".join(servers)
        self.who = f"user {user!r}" if user else "an anonymous client"
        #: what to check when the login is refused
        self.login_hint = (
            "check the credentials file"
            if user
            else "no credentials were given: REACH_CREDS or --creds names a credentials"
            " file, else .reach/dev.creds in the working directory (reach up writes it)"
        )
        self.give_up_after = give_up_after
        #: monotonic time the connection went down (None: up)
        self.down_since: float | None = None
        #: why the server refused the last login (None: it did not), and how long after
        #: the login was sent (a quick refusal is the login gate's verdict on the
        #: credentials, a slow one the server's own timeout: no gate answered in time)
        self.refused: str | None = None
        self.refused_after: float | None = None
        #: seconds the last login waited for an answer that did not come (None: it came)
        self.unanswered: float | None = None
        #: seconds after which reconnecting stopped (the connection is closed for good)
        self.gave_up: float | None = None
        self.last_error = ""
        self._give_up: asyncio.TimerHandle | None = None
        #: what ends the connection when reconnecting takes longer than ``give_up_after``
        self.close: Callable[[], Awaitable[None]] | None = None

    @property
    def down(self) -> bool:
        return self.down_since is not None or self.gave_up is not None

    def disconnected(self) -> None:
        if self.down_since is not None:
            return
        self.down_since = time.monotonic()
        self.refused = self.unanswered = None
        log.warning("%s: disconnected from NATS at %s; reconnecting", self.name, self.where)
        if self.give_up_after is not None:
            loop = asyncio.get_running_loop()
            self._give_up = loop.call_later(self.give_up_after, self._expire)

    def attempt_failed(self, exc: BaseException, waited: float | None, pending: bool) -> None:
        """A connect or login attempt failed with ``exc``; ``waited``: how long its login
        waited (None: it was not sent), ``pending``: for an answer still to come."""
        self.last_error = _reason(exc)
        if is_refusal(exc):
            first = self.refused is None
            self.refused, self.refused_after, self.unanswered = _reason(exc), waited, None
            if first and self.down_since is not None:
                log.warning("%s: %s (still trying)", self.name, self._refusal())
        elif isinstance(exc, asyncio.TimeoutError) and waited is not None and pending:
            if self.unanswered is None and self.down_since is not None:
                log.warning(
                    "%s: NATS does not answer the login of %s while reconnecting: is the"
                    " login gate (reach up) running? still trying",
                    self.name,
                    self.who,
                )
            self.unanswered, self.refused = waited, None

    def reconnected(self) -> None:
        if self._give_up is not None:
            self._give_up.cancel()
            self._give_up = None
        down = time.monotonic() - self.down_since if self.down_since is not None else 0.0
        log.info("%s: reconnected to NATS after %.1fs", self.name, down)
        self.down_since = None
        self.refused = self.unanswered = None

    def _expire(self) -> None:
        self._give_up = None
        if self.down_since is None or self.give_up_after is None:
            return
        self.gave_up = self.give_up_after
        log.error(
            "%s: gave up reconnecting to NATS at %s after %gs (REACH_RECONNECT_FOR): %s",
            self.name,
            self.where,
            self.give_up_after,
            self.cause(),
        )
        if self.close is not None:
            task = asyncio.ensure_future(self.close())
            task.add_done_callback(lambda done: done.exception())

    def cause(self) -> str:
        """Why the connection is down, in a few words."""
        if self.refused is not None:
            return self._refusal()
        if self.unanswered is not None:
            return (
                f"the server did not answer the login of {self.who} in"
                f" {self.unanswered:.1f}s; is the login gate (reach up) running?"
            )
        return f"connection lost ({self.last_error})" if self.last_error else "connection lost"

    @property
    def credentials_refused(self) -> bool:
        """Whether the login gate refused these credentials (revoked, changed) rather than
        leaving the login unanswered."""
        return self.refused is not None and not is_slow(self.refused_after)

    def _refusal(self) -> str:
        said = f"the server refused the login of {self.who} while reconnecting ({self.refused})"
        if not self.credentials_refused:
            waited = f" after {self.refused_after:.1f}s" if self.refused_after else ""
            return f"{said}{waited} without an answer from the login gate: is reach up running?"
        return f"{said}: these credentials were revoked or changed"

    def describe(self) -> str:
        """``not connected to NATS at …: <cause> (down for …, still retrying)``."""
        if self.gave_up is not None:
            state = f"gave up reconnecting after {self.gave_up:g}s (REACH_RECONNECT_FOR)"
        else:
            down = time.monotonic() - (self.down_since or time.monotonic())
            state = f"down for {down:.1f}s, still retrying"
        return f"not connected to NATS at {self.where}: {self.cause()} ({state})"

    def first_connect_error(
        self, exc: BaseException, refused: BaseException | None, took: float | None
    ) -> ReachError:
        """The error of a first connect that failed with ``exc`` (``refused``: the login's
        refusal if that was the end, ``took``: seconds after the login was sent)."""
        if refused is not None and is_slow(took):
            return LoginUnanswered(
                f"NATS at {self.where} refused {self.who}: {_reason(refused)}, after"
                f" {took:.1f}s without an answer from the login gate: is reach up running?"
            )
        if refused is not None:
            return AuthenticationFailed(
                f"NATS at {self.where} refused {self.who}: {_reason(refused)} ({self.login_hint})"
            )
        if self.unanswered is not None:
            return LoginUnanswered(
                f"NATS at {self.where} did not answer the login of {self.who} in"
                f" {self.unanswered:.1f}s: is the login gate (reach up) running?"
            )
        return Disconnected(
            f"cannot connect to NATS at {self.where}: {_reason(exc)} (is a fabric running"
            " there? `reach up` starts one; --servers or REACH_URL names another)"
        )


def is_slow(took: float | None) -> bool:
    """Whether a refusal ``took`` seconds after the login is the server's timeout (None:
    unknown, taken for the gate's verdict)."""
    return took is not None and took >= _SLOW_REFUSAL
