"""Serving an ASGI application over HTTP: the listening socket, uvicorn on it, the signals.

``reach a2a``, ``reach mcp --http`` and ``reach console`` serve through here, so that the
three share one listening socket's options and one way of stopping:

- ``listen`` binds and listens before anything is printed (a client told the address
  may connect at once; port 0 is a free port, and the URL printed names the real one).
  The socket is made as a TCP socket by name (``IPPROTO_TCP``): asyncio turns Nagle's
  algorithm off (``TCP_NODELAY``) on each connection a server accepts only when its
  listening socket says so, and ``socket.create_server``'s says protocol 0. With Nagle's
  algorithm on, an answer written in two parts (its headers, then its body) holds the
  body back until the client acknowledges the headers, which a client delays by up to
  its delayed-ACK time (40 ms on Linux) on every request of a kept-alive connection.
- ``serve`` runs uvicorn on that socket until SIGINT or SIGTERM (a second SIGINT stops
  at once, without waiting for open requests), or until its task is cancelled. The
  signals are taken from uvicorn, which would raise them again once stopped and so end
  the process before its caller had closed what it holds (a gateway's ``ReachClient``
  writes its last audit events as it closes).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
from collections.abc import Callable, Iterator
from typing import Any

import uvicorn

from reach.errors import ConfigurationError

__all__ = ["listen", "serve", "url_of"]

#: connections waiting to be accepted, at most (uvicorn's own default)
BACKLOG = 2048
_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def listen(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host``:``port`` (an address or a name; port 0: a free
    one); ``ConfigurationError`` naming the address if it cannot."""
    try:
        family, _, _, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    except OSError as exc:
        raise ConfigurationError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:  # this address only, not IPv4's as well
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(address)
        sock.listen(BACKLOG)
    except OSError as exc:
        sock.close()
        raise ConfigurationError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock


def url_of(sock: socket.socket, path: str = "/") -> str:
    """The ``http://`` URL of ``path`` on a listening socket (IPv6 in brackets)."""
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}{path}"


class _Server(uvicorn.Server):
    """uvicorn, leaving the signals to ``serve`` (see the module's docstring)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    def told_to_stop(self, sig: signal.Signals, stopping: Callable[[], object] | None) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl-C: do not wait for open requests
            return
        self.should_exit = True
        if stopping is not None:
            stopping()


async def serve(
    app: Any,
    sock: socket.socket,
    *,
    lifespan: bool = False,
    graceful_sec: int | None = None,
    stopping: Callable[[], object] | None = None,
) -> None:
    """Serve the ASGI ``app`` on the listening ``sock`` until SIGINT or SIGTERM, or until
    cancelled (then stopped as on a signal, and the cancellation goes on); ``sock`` is
    closed at the end.

    ``lifespan``: run the app's startup and shutdown (an app that needs them, such as the
    MCP SDK's). ``graceful_sec``: how long the requests still open when told to stop may
    go on (None: until they end). ``stopping()`` is called once when told to stop, before
    the open requests are waited for (an app ends its endless streams there).
    """
    config = uvicorn.Config(
        app,
        lifespan="on" if lifespan else "off",
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=graceful_sec,
    )
    server = _Server(config)
    loop = asyncio.get_running_loop()
    for sig in _SIGNALS:
        loop.add_signal_handler(sig, server.told_to_stop, sig, stopping)
    running = asyncio.create_task(server.serve(sockets=[sock]), name="http-serve")
    try:
        await asyncio.shield(running)
    except asyncio.CancelledError:
        server.told_to_stop(signal.SIGTERM, stopping)
        await running
        raise
    finally:
        for sig in _SIGNALS:
            loop.remove_signal_handler(sig)
        sock.close()
