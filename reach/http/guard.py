"""The browser threat model, closed once for every HTTP door (``reach a2a``, ``reach mcp
--http``, ``reach console``).

A web page the user happens to open can make their browser send requests to any
address, 127.0.0.1 included, and a few kinds it sends without asking the server first:
a GET, and a POST whose body is a form or ``text/plain`` (CORS "simple" requests). It
can also point a name of its own at 127.0.0.1 (DNS rebinding) and then read the answers
as its own. ``Door`` refuses all of that before the application sees the request:

- **Host**: only the names the door answers to (the loopback names on a loopback
  address, unless configured); a rebound name is refused with 421.
- **Origin**: a request a browser sent from another site (an ``Origin`` header that is
  neither this door's own nor one the operator allowed, ``null`` included) is refused
  with 403. Programs send no ``Origin`` and are not affected.
- **Content type**: a request with a body is ``application/json`` (415 otherwise),
  except at the paths that take a form by their standard (an OAuth token endpoint). A
  simple request can carry neither JSON nor a bearer token, so a page without a
  preflight gets nothing through.
- **CORS** is answered deliberately: a preflight (``OPTIONS``) from an allowed origin
  gets the methods and headers the door takes, any other gets 403; answers to an allowed
  origin name it in ``Access-Control-Allow-Origin``.
- **Body size**: at most ``max_body`` bytes (1 MiB by default), whether announced by
  ``Content-Length`` or streamed; 413 beyond, and what was read is dropped.

Every answer also carries ``X-Content-Type-Options: nosniff``, ``Referrer-Policy:
no-referrer`` and ``X-Frame-Options: DENY``, plus whatever headers the door is given.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = [
    "BASE_HEADERS",
    "DEFAULT_MAX_BODY",
    "LOOPBACK_NAMES",
    "Door",
    "DoorPolicy",
    "host_name",
    "is_loopback",
]

#: the request body limit of every door unless configured
DEFAULT_MAX_BODY = 1024 * 1024
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1", "[::1]"})
BASE_HEADERS: tuple[tuple[bytes, bytes], ...] = (
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"no-referrer"),
)
#: the request headers a cross-origin client (allowed by the operator) may send
_ALLOWED_HEADERS = (
    b"authorization, content-type, accept, last-event-id, mcp-session-id,"
    b" mcp-protocol-version, a2a-version, a2a-extensions, if-none-match"
)
_EXPOSED_HEADERS = b"www-authenticate, mcp-session-id, etag"
_METHODS = b"GET, POST, DELETE, OPTIONS"
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) is this machine only."""
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_name(value: str) -> str:
    """The name of a ``Host`` header (or of an origin's authority), without its port,
    lowercased; IPv6 addresses keep their brackets."""
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        return value[: end + 1] if end >= 0 else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def _origin(value: str) -> str:
    """An origin in its canonical form (scheme://host[:port], lowercased, default ports
    dropped); '' for one that does not parse (``null`` included)."""
    parts = urlsplit(value.strip().lower())
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
        return ""
    try:
        port = parts.port
    except ValueError:
        return ""
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    default = 443 if parts.scheme == "https" else 80
    return f"{parts.scheme}://{host}" + (f":{port}" if port not in (None, default) else "")


@dataclass(frozen=True)
class DoorPolicy:
    """What a door lets in.

    ``hosts``: the names a request's ``Host`` may give (None: any, for a door that
    requires a login whatever name it is reached by); ``origins``: other sites whose
    pages may call the door (its own origin always may); ``form_paths``: paths whose
    POST takes ``application/x-www-form-urlencoded`` by their standard; ``max_body``: the
    largest request body, in bytes; ``headers``: added to every answer."""

    hosts: frozenset[str] | None = LOOPBACK_NAMES
    origins: frozenset[str] = frozenset()
    form_paths: frozenset[str] = frozenset()
    max_body: int = DEFAULT_MAX_BODY
    headers: tuple[tuple[bytes, bytes], ...] = field(default=())

    def __post_init__(self) -> None:
        if self.max_body < 1:
            raise ValueError(f"max_body must be at least 1 byte, got {self.max_body}")
        if self.hosts is not None:
            object.__setattr__(self, "hosts", frozenset(host_name(h) for h in self.hosts))
        canonical = frozenset(_origin(o) for o in self.origins)
        if "" in canonical:
            bad = sorted(o for o in self.origins if not _origin(o))
            raise ValueError(f"not an origin (scheme://host[:port]): {', '.join(bad)}")
        object.__setattr__(self, "origins", canonical)

    @classmethod
    def for_address(
        cls,
        host: str,
        *,
        allowed_hosts: Iterable[str] = (),
        origins: Iterable[str] = (),
        form_paths: Iterable[str] = (),
        max_body: int = DEFAULT_MAX_BODY,
        headers: tuple[tuple[bytes, bytes], ...] = (),
    ) -> DoorPolicy:
        """The policy of a door listening on ``host``: on a loopback address the loopback
        names and ``allowed_hosts``; elsewhere ``allowed_hosts`` if any are given, else
        any name (such a door requires a login, which a page cannot forge)."""
        extra = frozenset(allowed_hosts)
        if is_loopback(host):
            hosts: frozenset[str] | None = LOOPBACK_NAMES | extra
        else:
            hosts = (extra | {host}) if extra else None
        return cls(
            hosts=hosts,
            origins=frozenset(origins),
            form_paths=frozenset(form_paths),
            max_body=max_body,
            headers=headers,
        )


class _TooLarge(Exception):
    pass


class Door:
    """ASGI middleware enforcing a ``DoorPolicy`` in front of ``app``."""

    def __init__(self, app: ASGIApp, policy: DoorPolicy | None = None) -> None:
        self.app = app
        self.policy = policy or DoorPolicy()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        policy = self.policy
        headers: dict[str, str] = {}
        for key, value in scope["headers"]:
            name = key.decode("latin-1").lower()
            # a repeated Host or Origin is refused: which one a proxy reads is anyone's guess
            headers[name] = "\0" if name in headers else value.decode("latin-1")
        host = headers.get("host", "")
        if "\0" in host or (policy.hosts is not None and host_name(host) not in policy.hosts):
            await _refuse(send, 421, "unexpected Host: this door answers only to its own names")
            return
        raw_origin = headers.get("origin")
        origin = None if raw_origin is None else _origin(raw_origin)
        allowed_origin = origin is not None and self._allowed_origin(
            origin, f"{scope.get('scheme', 'http')}://{host.strip().lower()}"
        )
        if origin is not None and not allowed_origin:
            await _refuse(send, 403, "cross-origin request refused: this origin is not allowed")
            return
        if scope["type"] == "websocket":
            await self.app(scope, receive, send)
            return
        method = scope["method"]
        if method == "OPTIONS":
            await self._preflight(send, origin if allowed_origin else None)
            return
        length = headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                await _refuse(send, 400, "Content-Length is not a number")
                return
            if int(length) > policy.max_body:
                await _refuse(send, 413, f"request body over {policy.max_body} bytes")
                return
        has_body = (length is not None and int(length) > 0) or "transfer-encoding" in headers
        if method == "POST" or (method in _BODY_METHODS and has_body):
            kind = headers.get("content-type", "").split(";", 1)[0].strip().lower()
            wanted = (
                "application/x-www-form-urlencoded"
                if scope["path"] in policy.form_paths
                else "application/json"
            )
            if kind != wanted:
                await _refuse(send, 415, f"this door takes {wanted} bodies, not {kind or 'none'}")
                return
        await self._pass(scope, receive, send, origin if allowed_origin else None)

    def _allowed_origin(self, origin: str, asked: str) -> bool:
        """Whether a request from ``origin`` to ``asked`` (scheme://Host) may pass: an
        origin the policy allows, or the door's own (a page it served, the console's)."""
        if not origin:
            return False
        if origin in self.policy.origins:
            return True
        own = _origin(asked)
        return bool(own) and origin == own

    async def _preflight(self, send: Send, origin: str | None) -> None:
        headers = [*BASE_HEADERS, *self.policy.headers, (b"allow", _METHODS)]
        if origin is not None:
            headers += [
                (b"access-control-allow-origin", origin.encode("latin-1")),
                (b"access-control-allow-methods", _METHODS),
                (b"access-control-allow-headers", _ALLOWED_HEADERS),
                (b"access-control-max-age", b"600"),
                (b"vary", b"Origin"),
            ]
        await send({"type": "http.response.start", "status": 204, "headers": headers})
        await send({"type": "http.response.body", "body": b""})

    async def _pass(self, scope: Scope, receive: Receive, send: Send, origin: str | None) -> None:
        policy = self.policy
        received = 0
        over = False
        started = False

        async def bounded() -> Message:
            nonlocal received, over
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > policy.max_body:
                    over = True
                    raise _TooLarge
            return message

        extra = [*BASE_HEADERS, *policy.headers]
        if origin is not None:
            extra += [
                (b"access-control-allow-origin", origin.encode("latin-1")),
                (b"access-control-expose-headers", _EXPOSED_HEADERS),
                (b"vary", b"Origin"),
            ]

        async def with_headers(message: Message) -> None:
            nonlocal started
            if over:
                return  # the refusal below answers instead
            if message["type"] == "http.response.start":
                started = True
                message["headers"] = [*message.get("headers", []), *extra]
            await send(message)

        try:
            await self.app(scope, bounded, with_headers)
        except _TooLarge:
            pass
        except Exception:
            if not over:
                raise
        if over and not started:
            await _refuse(send, 413, f"request body over {policy.max_body} bytes")


async def _refuse(send: Send, status: int, text: str) -> None:
    body = json.dumps({"error": text}).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"cache-control", b"no-store"),
        *BASE_HEADERS,
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
