"""Who may open the console, and what every answer of it carries.

On 127.0.0.1 (the default) the console is for whoever may use the machine, as the CLI
is: no login. What keeps a web page elsewhere out is the door every HTTP gateway has
(``reach.http.guard``): a request must name a loopback host (``Host``), so that a page
cannot reach the console by pointing a name of its own at 127.0.0.1 (DNS rebinding), and
a request another site's page sent (its ``Origin``) is refused. Bound to any other
address it asks for a login: HTTP Basic, user ``operator`` and a password
(REACH_CONSOLE_PASSWORD, else one made at start and printed once). Basic rather than a
session cookie: a browser sends it with every request, the live feed's included, it
needs no login form and no session store, and the console changes nothing (its pages
only read), so there is no form a cookie could be abused to submit. Served beyond a
trusted network, it belongs behind TLS (a reverse proxy): Basic sends the password with
every request.

Every answer carries a Content-Security-Policy that lets only the console's own script
and style run: agent-supplied text is escaped where it is rendered, and were it not,
an injected script would still not run.
"""

from __future__ import annotations

import base64
import binascii
import secrets

from starlette.types import ASGIApp, Receive, Scope, Send

from reach.http.guard import BASE_HEADERS, Door, DoorPolicy, is_loopback

__all__ = ["LOGIN_USER", "SECURITY_HEADERS", "Guard", "guarded", "is_loopback", "make_password"]

LOGIN_USER = "operator"

#: what every answer of the console carries, beyond the door's own headers
SECURITY_HEADERS: tuple[tuple[bytes, bytes], ...] = (
    (
        b"content-security-policy",
        b"default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:;"
        b" connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    ),
    (b"cache-control", b"no-store"),
)


def make_password() -> str:
    return secrets.token_urlsafe(18)


def guarded(app: ASGIApp, *, password: str | None, loopback_only: bool) -> ASGIApp:
    """``app`` behind the door (loopback names only when ``loopback_only``) and, when
    ``password`` is set, the login."""
    policy = DoorPolicy(
        hosts=DoorPolicy().hosts if loopback_only else None, headers=SECURITY_HEADERS
    )
    return Door(Guard(app, password=password), policy)


class Guard:
    """ASGI middleware: the login, when ``password`` is set."""

    def __init__(self, app: ASGIApp, *, password: str | None) -> None:
        self.app = app
        self.password = password

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.password is None:
            await self.app(scope, receive, send)
            return
        authorization = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        if not self._logged_in(authorization.decode("latin-1")):
            await _refuse(send, 401, "login required", challenge=True)
            return
        await self.app(scope, receive, send)

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
    headers = [(b"content-type", b"text/plain; charset=utf-8"), *SECURITY_HEADERS, *BASE_HEADERS]
    if challenge:
        headers.append((b"www-authenticate", b'Basic realm="reach console", charset="UTF-8"'))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": text.encode()})
