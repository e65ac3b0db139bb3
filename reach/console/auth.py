"""Who may open the console, and what every answer of it carries.

On 127.0.0.1 (the default) the console is for whoever may use the machine, as the CLI
is: no login, but a request must name a loopback host (``Host``), so that a web page
elsewhere cannot reach it by pointing a name of its own at 127.0.0.1 (DNS rebinding).
Bound to any other address it asks for a login: HTTP Basic, user ``operator`` and a
password (REACH_CONSOLE_PASSWORD, else one made at start and printed once). Basic
rather than a session cookie: a browser sends it with every request, the live feed's
included, it needs no login form and no session store, and the console changes nothing
(its pages only read), so there is no form a cookie could be abused to submit. Served
beyond a trusted network, it belongs behind TLS (a reverse proxy): Basic sends the
password with every request.

Every answer carries a Content-Security-Policy that lets only the console's own script
and style run: agent-supplied text is escaped where it is rendered, and were it not,
an injected script would still not run.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import secrets
from collections.abc import Iterable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["LOGIN_USER", "SECURITY_HEADERS", "Guard", "is_loopback", "make_password"]

LOGIN_USER = "operator"
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1", "[::1]"})

SECURITY_HEADERS: tuple[tuple[bytes, bytes], ...] = (
    (
        b"content-security-policy",
        b"default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:;"
        b" connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    ),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"no-referrer"),
    (b"cache-control", b"no-store"),
)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) is this machine only."""
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def make_password() -> str:
    return secrets.token_urlsafe(18)


def _host_name(value: str) -> str:
    """The name of a ``Host`` header, without its port."""
    if value.startswith("["):
        return value[: value.find("]") + 1] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


class Guard:
    """ASGI middleware: the login (when ``password`` is set), the loopback Host check
    (when ``loopback_hosts``), and the security headers on every answer."""

    def __init__(
        self, app: ASGIApp, *, password: str | None, loopback_hosts: Iterable[str] = ()
    ) -> None:
        self.app = app
        self.password = password
        self.hosts = frozenset(loopback_hosts)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        if self.hosts and _host_name(headers.get("host", "")) not in self.hosts:
            await _refuse(send, 400, "unexpected Host: the console answers on loopback only")
            return
        if self.password is not None and not self._logged_in(headers.get("authorization", "")):
            await _refuse(send, 401, "login required", challenge=True)
            return

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *SECURITY_HEADERS]
            await send(message)

        await self.app(scope, receive, with_headers)

    def _logged_in(self, authorization: str) -> bool:
        scheme, _, encoded = authorization.partition(" ")
        if scheme.lower() != "basic" or self.password is None:
            return False
        try:
            user, _, password = base64.b64decode(encoded, validate=True).decode().partition(":")
        except (binascii.Error, UnicodeDecodeError):
            return False
        # both compared whatever the first gave, in constant time
        good_user = secrets.compare_digest(user.encode(), LOGIN_USER.encode())
        good_password = secrets.compare_digest(password.encode(), self.password.encode())
        return good_user and good_password


async def _refuse(send: Send, status: int, text: str, *, challenge: bool = False) -> None:
    headers = [(b"content-type", b"text/plain; charset=utf-8"), *SECURITY_HEADERS]
    if challenge:
        headers.append((b"www-authenticate", b'Basic realm="reach console", charset="UTF-8"'))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": text.encode()})
