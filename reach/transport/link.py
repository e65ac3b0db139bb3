"""The NATS client beneath a ``Connection``: nats-py's, made to keep a connection that
was once established whatever the server answers, and to say why it is down.

nats-py (2.x) ends a connection for good where a fabric meets it in normal operation:

* after ``CONNECT`` it takes the next line for the server's answer. A server whose login
  check is slow (an auth callout waiting for a login gate that is down, or for a
  credentials bucket electing its leader) sends its first ``PING`` before it answers: the
  client counts itself connected, and the ``-ERR 'Authorization Violation'`` that
  follows is read as an error of an established connection;
* on such an error (any ``-ERR`` but a stale connection or a permissions violation:
  ``Authorization Violation``, ``User Authentication Expired`` when a login's lifetime
  ends) it closes the client instead of reconnecting.

``Client`` answers the server's pings while a login waits for its answer, and once
``keep_trying`` is set it reconnects and logs in again on those errors: a refused login
is then transient (a failover, a gate away), retried with capped, jittered back-off.
Each failed attempt's socket is closed before the next one. ``Link`` follows the state
of one connection (up, down and why), logs each change once, not per attempt, and words
the errors of operations attempted while it is down.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import nats.errors
from nats.aio.client import Client as _NatsClient
from nats.aio.transport import TcpTransport
from nats.protocol.parser import AUTHORIZATION_VIOLATION, PERMISSIONS_ERR, STALE_CONNECTION

from reach.errors import AuthenticationFailed, Disconnected, LoginUnanswered, ReachError

__all__ = ["Client", "Link", "open_client"]

log = logging.getLogger("reach.transport")

#: reconnect back-off: base doubling per failed attempt, capped, plus jitter (thundering herd)
_RECONNECT_BASE = 0.1
_RECONNECT_CAP = 2.0
#: the wait between reconnect attempts of a connection that others' logins depend on (a
#: login gate's): a server that is back sends a login it gets before the gate has
#: subscribed again nowhere, and that login waits out the server's whole auth timeout.
#: A handful of such connections per fabric, so no herd to spread.
_PROMPT_RECONNECT = 0.05
#: how long a login sent while reconnecting waits for its answer before the attempt is
#: given up and made again: a login the server sent to no gate (one still reconnecting)
#: is never answered, only refused at the server's auth timeout. Doubles with each
#: unanswered attempt up to the first connect's timeout, so that a gate slow under a
#: crowd of logins is not sent each one again and again.
_LOGIN_PATIENCE = 2.0
#: the first connect: a few quick tries to reach a server (a refused or unanswered login
#: ends it at once: a wrong secret must not keep a command waiting)
_FIRST_CONNECT_ATTEMPTS = 3
_FIRST_CONNECT_WAIT = 0.2
#: the first connect sends a login that got no answer this many times in all
_FIRST_CONNECT_LOGINS = 2
#: a refusal that took longer than this after the login was sent is the server's own
#: timeout (no login gate answered), not the gate's verdict on the credentials
_SLOW_REFUSAL = 1.0
_BUFFER_SIZE = 32768


class _LoginTransport(TcpTransport):
    """nats-py's TCP transport, which answers the server's pings while the login waits for
    its answer (``readline`` is read only then), remembers when the login was sent, and
    closes the socket of a failed attempt before opening the next."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # nats-py leaves it untyped
        #: monotonic time the login (CONNECT) was sent, until the server answered it
        self.login_sent: float | None = None
        #: seconds the server took to answer the login on this socket
        self.answered_after: float | None = None

    async def connect(self, uri: Any, buffer_size: int, connect_timeout: int) -> None:
        writer = self._io_writer
        if writer is not None:  # the socket of the attempt before: nobody reads it any more
            writer.close()
        self.login_sent = self.answered_after = None
        await super().connect(uri, buffer_size, connect_timeout)

    def write(self, payload: bytes) -> None:
        if payload.startswith(b"CONNECT "):
            self.login_sent = time.monotonic()
        super().write(payload)  # type: ignore[no-untyped-call]

    async def readline(self) -> bytes:
        while True:
            line: bytes = await super().readline()  # type: ignore[no-untyped-call]
            if not line:
                raise nats.errors.UnexpectedEOF
            if self.login_sent is None:
                return line
            if line.startswith(b"PING"):
                super().write(b"PONG\r\n")  # type: ignore[no-untyped-call]
                continue
            if line.startswith(b"INFO"):
                continue  # an update of the cluster's addresses: not the answer
            if line.startswith((b"PONG", b"-ERR")):
                self.answered_after = time.monotonic() - self.login_sent
                self.login_sent = None
            return line


class Client(_NatsClient):
    """nats-py's client; with ``keep_trying`` no answer of the server closes it."""

    def __init__(self) -> None:
        super().__init__()
        #: set once the first connect succeeded; only ``close()`` ends the connection then
        self.keep_trying = False
        self._reconnecting: set[asyncio.Future[None]] = set()

    async def close(self) -> None:
        self.keep_trying = False
        await super().close()

    async def drain(self) -> None:
        self.keep_trying = False
        await super().drain()

    def login_waited(self) -> float | None:
        """Seconds the login of the current attempt has waited for its answer, or waited
        until it came (None: not sent)."""
        transport = self._transport
        if not isinstance(transport, _LoginTransport):
            return None
        if transport.login_sent is not None:
            return time.monotonic() - transport.login_sent
        return transport.answered_after

    @property
    def login_pending(self) -> bool:
        """Whether the login of the current attempt waits for its answer."""
        transport = self._transport
        return isinstance(transport, _LoginTransport) and transport.login_sent is not None

    async def _connect_to_server(self, s: Any) -> None:
        if s.uri.scheme in ("ws", "wss"):
            await super()._connect_to_server(s)
            return
        s.last_attempt = time.monotonic()
        if not isinstance(self._transport, _LoginTransport):
            self._transport = _LoginTransport()
        await self._transport.connect(s.uri, _BUFFER_SIZE, self.options["connect_timeout"])

    async def _process_err(self, err_msg: str) -> None:
        text = err_msg.lower()
        if not self.keep_trying or STALE_CONNECTION in text or PERMISSIONS_ERR in text:
            await super()._process_err(err_msg)
            return
        err: nats.errors.Error
        if AUTHORIZATION_VIOLATION in text:
            err = nats.errors.AuthorizationError()
        else:
            err = nats.errors.Error(f"nats: {err_msg.strip(chr(39))}")
        self._err = err
        await self._error_cb(err)
        # the server closes the socket after the error: log in again, as after a lost one
        task = asyncio.ensure_future(self._process_op_err(err))
        self._reconnecting.add(task)
        task.add_done_callback(self._reconnecting.discard)


def _jittered_reconnect(servers: list[Any], info: dict[str, Any]) -> tuple[Any, float]:
    server = random.choice(servers)
    attempts = max(0, int(getattr(server, "reconnects", 0)))
    delay = min(_RECONNECT_CAP, _RECONNECT_BASE * 2 ** min(attempts, 10))
    return server, delay * (0.5 + random.random())


def _prompt_reconnect(servers: list[Any], info: dict[str, Any]) -> tuple[Any, float]:
    return random.choice(servers), _PROMPT_RECONNECT * (0.5 + random.random())


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
        log.info("%s: disconnected from NATS at %s; reconnecting", self.name, self.where)
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
        return self.refused is not None and not _slow(self.refused_after)

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
        if refused is not None and _slow(took):
            return LoginUnanswered(
                f"NATS at {self.where} refused {self.who}: {_reason(refused)}, after"
                f" {took:.1f}s without an answer from the login gate: is reach up running?"
            )
        if refused is not None:
            return AuthenticationFailed(
                f"NATS at {self.where} refused {self.who}: {_reason(refused)}"
                " (check the credentials file)"
            )
        if self.unanswered is not None:
            return LoginUnanswered(
                f"NATS at {self.where} did not answer the login of {self.who} in"
                f" {self.unanswered:.1f}s: is the login gate (reach up) running?"
            )
        return Disconnected(f"cannot connect to NATS at {self.where}: {_reason(exc)}")


def _slow(took: float | None) -> bool:
    """Whether a refusal ``took`` seconds after the login is the server's timeout (None:
    unknown, taken for the gate's verdict)."""
    return took is not None and took >= _SLOW_REFUSAL


async def open_client(
    servers: Sequence[str],
    *,
    link: Link,
    name: str,
    connect_timeout: float,
    user: str | None,
    password: str | None,
    inbox_prefix: str,
    on_error: Callable[[Exception], bool],
    on_reconnect: Callable[[], Awaitable[None]],
    on_disconnect: Callable[[], Awaitable[None]],
    prompt: bool = False,
) -> Client:
    """A connected ``Client`` that reconnects forever (or for ``link.give_up_after``).

    The first connect makes a few quick tries to reach a server and ends at the first
    refused login (AuthenticationFailed) or at the second unanswered one
    (LoginUnanswered): a login request can be lost on its way to a gate (one whose node
    or process just died), so one without an answer is sent once more.
    ``on_error`` sees each error first; True: handled (a permissions violation).
    ``prompt``: reconnect without back-off (see ``_PROMPT_RECONNECT``)."""
    nc = Client()
    patience = min(_LOGIN_PATIENCE, float(connect_timeout))
    ended = asyncio.Event()
    #: the refusal that ended the first connect, and seconds after the login was sent
    refusal: list[tuple[BaseException, float | None]] = []
    unanswered = [0]

    async def _error_cb(exc: Exception) -> None:
        if on_error(exc):
            return
        log.debug("nats: %s: %s", type(exc).__name__, exc)
        waited, pending = nc.login_waited(), nc.login_pending
        link.attempt_failed(exc, waited, pending)
        # no answer: nobody got the login (pending past our patience), or the server's
        # own auth timeout refused it (a slow refusal); a quick refusal is the gate's
        lost = (pending and isinstance(exc, asyncio.TimeoutError)) or (
            is_refusal(exc) and _slow(waited)
        )
        if nc.keep_trying:
            if lost:
                nc.options["connect_timeout"] = min(
                    2 * nc.options["connect_timeout"], max(patience, connect_timeout)
                )
            return
        if lost:
            unanswered[0] += 1
            if unanswered[0] < _FIRST_CONNECT_LOGINS:
                return
        if is_refusal(exc):
            refusal.append((exc, waited))
            ended.set()
        elif lost:
            ended.set()

    async def _disconnected_cb() -> None:
        if nc.keep_trying and not nc.is_closed:
            link.disconnected()
        await on_disconnect()

    async def _closed_cb() -> None:
        if nc.keep_trying:  # not by close(): a way of nats-py's to give up this client left
            log.error("%s: the NATS client closed itself (%s)", name, nc.last_error)

    async def _reconnected_cb() -> None:
        nc.options["connect_timeout"] = patience
        link.reconnected()
        await on_reconnect()

    try:
        await _until(
            ended,
            nc.connect(
                servers=list(servers),
                name=name,
                connect_timeout=max(1, int(patience)),
                # a few quick tries for the first connect (nats-py would retry it forever
                # and, with no wait, spin); once connected, reconnect forever (set below)
                max_reconnect_attempts=_FIRST_CONNECT_ATTEMPTS,
                reconnect_time_wait=_FIRST_CONNECT_WAIT,  # type: ignore[arg-type]  # float works
                reconnect_to_server_handler=_prompt_reconnect if prompt else _jittered_reconnect,
                error_cb=_error_cb,
                reconnected_cb=_reconnected_cb,
                disconnected_cb=_disconnected_cb,
                closed_cb=_closed_cb,
                allow_reconnect=True,
                user=user,
                password=password,
                inbox_prefix=inbox_prefix,
            ),
        )
    except Exception as exc:
        with contextlib.suppress(Exception):
            await nc.close()
        refused, took = refusal[0] if refusal else (None, None)
        raise link.first_connect_error(exc, refused, took) from exc
    nc.options["max_reconnect_attempts"] = -1
    nc.options["connect_timeout"] = patience
    nc.keep_trying = True
    link.close = nc.close
    return nc


async def _until(ended: asyncio.Event, connecting: Awaitable[None]) -> None:
    """Await ``connecting``; if ``ended`` is set first, stop it and raise AuthorizationError."""
    task = asyncio.ensure_future(connecting)
    waiter = asyncio.ensure_future(ended.wait())
    try:
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # cancelled: stop connecting too
        task.cancel()
        raise
    finally:
        waiter.cancel()
    if not task.done():
        task.cancel()
        await asyncio.wait({task})
        raise nats.errors.AuthorizationError
    task.result()
