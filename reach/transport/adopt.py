"""A connection opened elsewhere, used by an Agent or a ReachClient as its own.

``Agent(..., connection=)`` and ``ReachClient(connection=)`` take either a
``reach.transport.Connection`` as it is, or a nats-py client that is already connected,
wrapped here in a ``Connection``. Part of the NATS boundary beside ``reach.transport``
(it is one of the modules that import nats-py): what is above it sees a ``Connection``.

Whoever opened a connection closes it: an Agent or a client that was given one leaves it
open when it stops. A nats-py client is wrapped once; whoever adopts it again gets the
same ``Connection``, so an Agent and a client given the same nats-py client share one
request inbox and one reconnect listener list. Its wrapper lives as long as it does.

A wrapped nats-py client keeps the reconnect settings it was connected with. For a
secured fabric it must log in as ``reach.transport.connect`` would: the client id and
secret of a credentials file as user and password, and ``inbox_prefix="_INBOX.<client
id>"`` (the only inbox its permissions let it read replies on).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, TypeAlias

from nats.aio.client import Client as NatsClient

from reach.errors import ConfigurationError
from reach.transport.connection import Connection
from reach.transport.denials import Denials

__all__ = ["Adoptable", "NatsClient", "adopt"]

log = logging.getLogger("reach.adopt")

#: what ``connection=`` takes: a Connection, or a connected nats-py client
Adoptable: TypeAlias = Connection | NatsClient

#: the callbacks of nats-py's client that a wrapper chains its own in front of, so that it
#: hears of reconnects (route cache, audit writer and calls follow them) and of the
#: server's permission refusals (a request refused ends as PermissionDenied, not a
#: timeout). nats-py takes them only in ``connect``: they are private attributes.
_CALLBACKS = ("_reconnected_cb", "_error_cb")

#: nats-py client (by id) → its wrapper, while the wrapper lives (it holds the client)
_wrapped: weakref.WeakValueDictionary[int, Connection] = weakref.WeakValueDictionary()


def adopt(connection: Adoptable) -> Connection:
    """The ``Connection`` of ``connection``: itself, or a connected nats-py client wrapped.

    ConfigurationError when it is neither, closed, or not connected yet."""
    if isinstance(connection, Connection):
        if connection.is_closed:
            raise ConfigurationError("connection= was given a closed Connection")
        return connection
    if not isinstance(connection, NatsClient):
        raise ConfigurationError(
            "connection= takes a reach.transport.Connection or a connected"
            f" nats.aio.client.Client, not {type(connection).__name__}"
        )
    if connection.is_closed or not connection.is_connected:
        raise ConfigurationError(
            "connection= was given a nats-py client that is not connected:"
            " `await nc.connect(...)` first"
        )
    wrapper = _wrapped.get(id(connection))
    if wrapper is None:
        wrapper = _wrap(connection)
        _wrapped[id(connection)] = wrapper
    return wrapper


def _wrap(nc: NatsClient) -> Connection:
    missing = [name for name in _CALLBACKS if not hasattr(nc, name)]
    if missing:
        raise ConfigurationError(
            f"this nats-py release has no {', '.join(missing)} on its client: a nats-py client"
            " cannot be adopted (pass a reach.transport.Connection instead)"
        )
    # the client's inbox prefix: its inboxes are ``<prefix>.<unique token>``
    inbox_prefix = nc.new_inbox().rsplit(".", 1)[0]
    user = nc.options.get("user")
    denials = Denials()
    conn = Connection(nc, denials, user if isinstance(user, str) else None, inbox_prefix)
    reconnected: Callable[[], Awaitable[None]] | None = nc._reconnected_cb
    on_error: Callable[[Exception], Awaitable[None]] = nc._error_cb

    async def _reconnected() -> None:
        conn._reconnected()
        if reconnected is not None:
            await reconnected()

    async def _error(exc: Exception) -> None:
        if "permissions violation" in str(exc).lower():
            denials.add(str(exc))
        await on_error(exc)

    chained: dict[str, Any] = {"_reconnected_cb": _reconnected, "_error_cb": _error}
    for name, callback in chained.items():
        setattr(nc, name, callback)
    return conn
