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
Each failed attempt's socket is closed before the next one. It overrides nats-py
internals (``reach.transport.internals`` lists them); ``PublicClient``, what runs
without them, keeps nats-py's own behaviour on those errors. ``Link`` (``linkstate``)
follows the state of one connection: up, or down since when and why.
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

from reach.transport.linkstate import Link, is_refusal, is_slow
from reach.transport.protocol import ProtocolReader

__all__ = ["Client", "Link", "PublicClient", "open_client"]

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
_BUFFER_SIZE = 32768
#: a server that stopped answering (a stalled process keeps its socket open, so nothing
#: closes the connection): a PING every this many seconds, and the connection is given
#: up as stale, and another node tried, once this many are unanswered; nats-py's
#: defaults (2 minutes, 2) notice only after minutes
PING_INTERVAL = 0.5
MAX_OUTSTANDING_PINGS = 2
#: the server's ``-ERR`` texts (in lower case) that nats-py handles without closing: a
#: stale connection (it reconnects) and a permissions violation (the connection stays)
_STALE_CONNECTION = "stale connection"
_PERMISSIONS_VIOLATION = "permissions violation"
#: a refused login
_AUTHORIZATION_VIOLATION = "authorization violation"


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


class PublicClient(_NatsClient):
    """nats-py's client as it is, with what ``open_client`` asks of a client: a refused
    login after the connection was up closes it, as nats-py does."""

    def __init__(self) -> None:
        super().__init__()
        #: set once the first connect succeeded; only ``close()`` should end it then
        self.keep_trying = False

    async def close(self) -> None:
        self.keep_trying = False
        await super().close()

    async def drain(self) -> None:
        self.keep_trying = False
        await super().drain()

    def login_waited(self) -> float | None:
        """Seconds the current login waited for its answer (None: unknown here)."""
        return None

    @property
    def login_pending(self) -> bool:
        """Whether the login of the current attempt waits for its answer (unknown here)."""
        return False


class Client(PublicClient):
    """nats-py's client; with ``keep_trying`` no answer of the server closes it. Its
    messages are read by :class:`~reach.transport.protocol.ProtocolReader`."""

    def __init__(self) -> None:
        super().__init__()
        self._ps = ProtocolReader(self)  # type: ignore[assignment]  # parse and reset, as nats-py's
        self._reconnecting: set[asyncio.Future[None]] = set()
        #: the server (host:port) of the latest connect attempt: the one in use, or lost
        self.last_tried: str | None = None

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
        self.last_tried = s.uri.netloc
        if not isinstance(self._transport, _LoginTransport):
            self._transport = _LoginTransport()
        await self._transport.connect(s.uri, _BUFFER_SIZE, self.options["connect_timeout"])

    async def _process_pong(self) -> None:
        # PONGs answer PINGs in order. A flush that timed out leaves its PING's future,
        # cancelled, in the queue; nats-py would then set the late PONG's result on it,
        # and the error would end the connection's read loop for good.
        pongs = self._pongs
        if pongs:
            future = pongs.pop(0)
            if not future.done():
                future.set_result(True)
            self._pongs_received += 1
            self._pings_outstanding = 0

    async def _process_err(self, err_msg: str) -> None:
        text = err_msg.lower()
        if not self.keep_trying or _STALE_CONNECTION in text or _PERMISSIONS_VIOLATION in text:
            await super()._process_err(err_msg)
            return
        err: nats.errors.Error
        if _AUTHORIZATION_VIOLATION in text:
            err = nats.errors.AuthorizationError()
        else:
            err = nats.errors.Error(f"nats: {err_msg.strip(chr(39))}")
        self._err = err
        await self._error_cb(err)
        # the server closes the socket after the error: log in again, as after a lost one
        task = asyncio.ensure_future(self._process_op_err(err))
        self._reconnecting.add(task)
        task.add_done_callback(self._reconnecting.discard)


def _next_server(nc: PublicClient, servers: list[Any]) -> Any:
    """A server to reconnect to: one of those tried least, at random, the one tried last
    (the one just lost, first) counting as tried once more. A stalled server still takes
    connections and never answers them: tried again at once, it would cost a whole
    connect timeout while the other nodes are up."""
    last = nc.last_tried if isinstance(nc, Client) else None

    def tries(server: Any) -> int:
        attempts = max(0, int(getattr(server, "reconnects", 0)))
        return attempts + (1 if server.uri.netloc == last else 0)

    fewest = min(tries(server) for server in servers)
    return random.choice([server for server in servers if tries(server) == fewest])


def _reconnect_handler(
    nc: PublicClient, prompt: bool
) -> Callable[[list[Any], dict[str, Any]], tuple[Any, float]]:
    """nats-py's choice of the next server and the wait before trying it: jittered
    back-off per server (a crowd of clients does not come back at once), or, ``prompt``,
    a short wait (``_PROMPT_RECONNECT``)."""

    def choose(servers: list[Any], info: dict[str, Any]) -> tuple[Any, float]:
        server = _next_server(nc, servers)
        if prompt:
            return server, _PROMPT_RECONNECT * (0.5 + random.random())
        attempts = max(0, int(getattr(server, "reconnects", 0)))
        delay = min(_RECONNECT_CAP, _RECONNECT_BASE * 2 ** min(attempts, 10))
        return server, delay * (0.5 + random.random())

    return choose


class _Callbacks:
    """nats-py's callbacks of one client: what each failed attempt means for the first
    connect (``ended`` it: refused, or unanswered twice) and for the ``Link``."""

    def __init__(
        self,
        nc: PublicClient,
        link: Link,
        connect_timeout: float,
        on_error: Callable[[Exception], bool],
        on_reconnect: Callable[[], Awaitable[None]],
        on_disconnect: Callable[[], Awaitable[None]],
    ) -> None:
        self.nc = nc
        self.link = link
        self.connect_timeout = connect_timeout
        self.patience = min(_LOGIN_PATIENCE, float(connect_timeout))
        self._on_error = on_error
        self._on_reconnect = on_reconnect
        self._on_disconnect = on_disconnect
        #: set when the first connect must end now
        self.ended = asyncio.Event()
        #: the refusal that ended the first connect, and seconds after the login was sent
        self.refusal: tuple[BaseException, float | None] | None = None
        self._unanswered = 0

    async def error(self, exc: Exception) -> None:
        if self._on_error(exc):
            return
        log.debug("nats: %s: %s", type(exc).__name__, exc)
        nc = self.nc
        waited, pending = nc.login_waited(), nc.login_pending
        self.link.attempt_failed(exc, waited, pending)
        # no answer: nobody got the login (pending past our patience), or the server's
        # own auth timeout refused it (a slow refusal); a quick refusal is the gate's
        lost = (pending and isinstance(exc, asyncio.TimeoutError)) or (
            is_refusal(exc) and is_slow(waited)
        )
        if nc.keep_trying:
            if lost:
                nc.options["connect_timeout"] = min(
                    2 * nc.options["connect_timeout"], max(self.patience, self.connect_timeout)
                )
            return
        if lost:
            self._unanswered += 1
            if self._unanswered < _FIRST_CONNECT_LOGINS:
                return
        if is_refusal(exc):
            self.refusal = (exc, waited)
            self.ended.set()
        elif lost:
            self.ended.set()

    async def disconnected(self) -> None:
        if self.nc.keep_trying and not self.nc.is_closed:
            self.link.disconnected()
        await self._on_disconnect()

    async def closed(self) -> None:
        if self.nc.keep_trying:  # not by close(): a way of nats-py's to give up this client
            log.error("%s: the NATS client closed itself (%s)", self.link.name, self.nc.last_error)

    async def reconnected(self) -> None:
        self.nc.options["connect_timeout"] = self.patience
        self.link.reconnected()
        await self._on_reconnect()


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
    internals: bool = True,
) -> PublicClient:
    """A connected ``Client`` that reconnects forever (or for ``link.give_up_after``).

    The first connect makes a few quick tries to reach a server and ends at the first
    refused login (AuthenticationFailed) or at the second unanswered one
    (LoginUnanswered): a login request can be lost on its way to a gate (one whose node
    or process just died), so one without an answer is sent once more.
    ``on_error`` sees each error first; True: handled (a permissions violation).
    ``prompt``: reconnect without back-off (see ``_PROMPT_RECONNECT``). Without
    ``internals``, a ``PublicClient``."""
    nc = Client() if internals else PublicClient()
    calls = _Callbacks(nc, link, connect_timeout, on_error, on_reconnect, on_disconnect)
    try:
        await _until(
            calls.ended,
            nc.connect(
                servers=list(servers),
                name=name,
                connect_timeout=max(1, int(calls.patience)),
                # a few quick tries for the first connect (nats-py would retry it forever
                # and, with no wait, spin); once connected, reconnect forever (set below)
                max_reconnect_attempts=_FIRST_CONNECT_ATTEMPTS,
                reconnect_time_wait=_FIRST_CONNECT_WAIT,  # type: ignore[arg-type]  # float works
                reconnect_to_server_handler=_reconnect_handler(nc, prompt),
                error_cb=calls.error,
                reconnected_cb=calls.reconnected,
                disconnected_cb=calls.disconnected,
                closed_cb=calls.closed,
                allow_reconnect=True,
                ping_interval=PING_INTERVAL,  # type: ignore[arg-type]  # float works
                max_outstanding_pings=MAX_OUTSTANDING_PINGS,
                user=user,
                password=password,
                inbox_prefix=inbox_prefix,
            ),
        )
    except Exception as exc:
        with contextlib.suppress(Exception):
            await nc.close()
        refused, took = calls.refusal or (None, None)
        raise link.first_connect_error(exc, refused, took) from exc
    nc.options["max_reconnect_attempts"] = -1
    nc.options["connect_timeout"] = calls.patience
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
