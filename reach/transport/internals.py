"""The nats-py internals the transport uses, listed once and checked in one place.

nats-py's public API hands every message to a task of its subscription and every publish
to its flusher task, a turn of the event loop each way on every call; and it closes a
connection, instead of logging in again, when the server refuses a login after the
connection was up. ``natsio`` (direct socket writes, inline delivery) and ``link`` (a
client that keeps its connection through refused logins) therefore use the private
attributes of nats-py's client, transport and subscription listed in ``USED``.

They exist in every release in ``SUPPORTED``, the range pyproject.toml pins. The first
connection checks them (``resolve``) and raises UnsupportedNatsPy naming each one that
is missing, the installed nats-py and the supported range. ``REACH_NATS_INTERNALS=off``
(or ``connect(internals=False)``) uses nats-py's public API alone instead: calls work
the same, slower, and a connection whose login is refused after it was up is closed by
nats-py rather than logged in again.
"""

from __future__ import annotations

import asyncio
import inspect
import os
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import metadata

from nats.aio.client import Client as _NatsClient
from nats.aio.client import Srv as _NatsServer
from nats.aio.subscription import Subscription as _NatsSubscription
from nats.aio.transport import TcpTransport
from nats.protocol.parser import Parser as _NatsParser

from reach.errors import ConfigurationError

__all__ = [
    "ENV",
    "SUPPORTED",
    "USED",
    "Internal",
    "UnsupportedNatsPy",
    "check",
    "missing",
    "resolve",
    "samples",
]

#: the nats-py releases whose internals are those in ``USED`` (pyproject.toml pins it)
SUPPORTED = ">=2.14,<2.17"
#: ``off`` (or 0, false, no): use nats-py's public API alone; ``on`` by default
ENV = "REACH_NATS_INTERNALS"

_OFF = ("off", "0", "false", "no")
_ON = ("", "on", "1", "true", "yes")


class UnsupportedNatsPy(ConfigurationError):
    """The installed nats-py lacks internals the transport uses (outside ``SUPPORTED``)."""


@dataclass(frozen=True, slots=True)
class Internal:
    """One attribute of a nats-py object the transport relies on."""

    #: the object: ``Client``, ``TcpTransport``, ``Subscription``, ``Parser`` or ``Srv``
    #: (see ``samples``)
    owner: str
    name: str
    #: what uses it, for the error message
    used_by: str
    #: parameters a method must accept (by name)
    params: tuple[str, ...] = ()
    #: the type its value must have (on a fresh object)
    kind: type | None = None
    #: part of nats-py's public API (newer than some releases): needed without the
    #: internals too
    public: bool = False

    def __str__(self) -> str:
        if self.params:
            return f"{self.owner}.{self.name}({', '.join(p + '=' for p in self.params)})"
        return f"{self.owner}.{self.name}"


_WRITER = "natsio.Writer (direct socket writes)"
_INLINE = "natsio.subscribe_inline (delivery without a task hop)"
_LINK = "link.Client (logging in again after a refused login)"
_CONNECT = "link.open_client (jittered reconnects, a reply inbox of its own)"
_READER = "reader.ProtocolReader (messages handed to inline subscriptions as read)"
_PONG = "link.Client (a late PONG after a flush that timed out)"
_ADOPT = "adopt (a connected nats-py client given to an Agent or a ReachClient)"

USED: tuple[Internal, ...] = (
    Internal("Client", "_pending", _WRITER, kind=list),
    Internal("Client", "_pending_data_size", _WRITER, kind=int),
    Internal("Client", "_max_payload", _WRITER, kind=int),
    Internal("Client", "_transport", f"{_WRITER}, {_LINK}"),
    Internal("Client", "_flush_pending", f"{_WRITER}, natsio.barrier", ("force_flush",)),
    Internal("TcpTransport", "_io_writer", _WRITER),
    Internal("Subscription", "_pending_queue", _INLINE, kind=asyncio.Queue),
    Internal("Subscription", "_pending_size", _INLINE, kind=int),
    Internal("Subscription", "_wait_for_msgs_task", _INLINE),
    Internal("Client", "_connect_to_server", _LINK, ("s",)),
    Internal("Client", "_process_err", _LINK, ("err_msg",)),
    Internal("Client", "_process_op_err", _LINK, ("e",)),
    Internal("Client", "_error_cb", f"{_LINK}, {_ADOPT}"),
    Internal("Client", "_reconnected_cb", _ADOPT),
    Internal("Client", "_err", _LINK),
    Internal("TcpTransport", "connect", _LINK, ("uri", "buffer_size", "connect_timeout")),
    Internal("Client", "connect", _CONNECT, ("reconnect_to_server_handler",), public=True),
    Internal("Client", "connect", _CONNECT, ("inbox_prefix",), public=True),
    Internal("Client", "_ps", _READER, kind=_NatsParser),
    Internal("Client", "_subs", _READER, kind=dict),
    Internal("Client", "stats", _READER, kind=dict),
    Internal("Client", "msg_class", _READER),
    Internal("Client", "_process_msg", _READER, ("sid", "subject", "reply", "data", "headers")),
    Internal("Subscription", "_received", _READER, kind=int),
    Internal("Subscription", "_max_msgs", _READER, kind=int),
    Internal("Subscription", "_jsi", _READER),
    Internal("Subscription", "_future", _READER),
    Internal("Parser", "buf", _READER, kind=bytearray),
    Internal("Parser", "state", _READER, kind=int),
    Internal("Parser", "needed", _READER, kind=int),
    Internal("Parser", "parse", _READER, ("data",)),
    Internal("Parser", "reset", _READER),
    Internal("Client", "_pongs", _PONG, kind=list),
    Internal("Client", "_pongs_received", _PONG, kind=int),
    Internal("Client", "_pings_outstanding", _PONG, kind=int),
    Internal("Client", "_process_pong", _PONG),
    Internal("Srv", "reconnects", _LINK, kind=int),
    Internal("Srv", "last_attempt", _LINK),
)


def samples() -> dict[str, object]:
    """Fresh, unconnected instances of the nats-py classes ``USED`` names."""
    return {
        "Client": _NatsClient(),
        "Parser": _NatsParser(),
        "TcpTransport": TcpTransport(),  # type: ignore[no-untyped-call]
        "Subscription": _NatsSubscription(None),
        "Srv": _NatsServer(uri=None),  # type: ignore[arg-type]
    }


def _lacks(found: object, internal: Internal) -> bool:
    if not hasattr(found, internal.name):
        return True
    value = getattr(found, internal.name)
    if internal.kind is not None and not isinstance(value, internal.kind):
        return True
    if not internal.params:
        return False
    try:
        accepted = inspect.signature(value).parameters
    except (TypeError, ValueError):
        return True
    return any(param not in accepted for param in internal.params)


def missing(found: Mapping[str, object] | None = None, *, internals: bool = True) -> list[Internal]:
    """What of ``USED`` (its public part alone without ``internals``) the objects in
    ``found`` (nats-py's own by default) lack."""
    objects = samples() if found is None else found
    return [
        i
        for i in USED
        if (internals or i.public) and (i.owner not in objects or _lacks(objects[i.owner], i))
    ]


def installed() -> str:
    """The installed nats-py's version."""
    try:
        return metadata.version("nats-py")
    except metadata.PackageNotFoundError:
        return "unknown"


def check(found: Mapping[str, object] | None = None, *, internals: bool = True) -> None:
    """UnsupportedNatsPy naming everything of ``USED`` (its public part alone without
    ``internals``) the objects in ``found`` (nats-py's own by default) lack, what uses
    it, and the supported range."""
    lacking = missing(found, internals=internals)
    if not lacking:
        return
    names = "; ".join(f"{i} (used by {i.used_by})" for i in lacking)
    advice = "install a release in that range"
    if not any(i.public for i in lacking):
        advice += (
            f", or set {ENV}=off to use nats-py's public API alone (slower calls, and a"
            " login refused after connecting closes the connection)"
        )
    raise UnsupportedNatsPy(
        f"nats-py {installed()} lacks {names}. Agent-Reach supports nats-py{SUPPORTED}: {advice}"
    )


#: the modes (with internals or without) nats-py's own classes passed ``check`` in
_checked: set[bool] = set()


def resolve(internals: bool | None = None) -> bool:
    """Whether a connection uses nats-py's internals: ``internals`` if given, else
    ``REACH_NATS_INTERNALS`` (on unless ``off``). nats-py is checked once per answer
    (UnsupportedNatsPy); a value of the variable that is neither is a ConfigurationError."""
    if internals is None:
        value = os.environ.get(ENV, "").strip().lower()
        if value not in _ON + _OFF:
            raise ConfigurationError(f"{ENV} must be on or off, not {value!r}")
        internals = value not in _OFF
    if internals not in _checked:
        check(internals=internals)
        _checked.add(internals)
    return internals
