"""The gateways' login: each HTTP caller logs in with its own Agent-Reach credential, and
its calls run as that caller.

A gateway over HTTP is an OAuth 2.1 protected resource (RFC 9728) and its own
authorization server (RFC 8414) with one grant, client credentials: ``client_id`` and
``client_secret`` are an Agent-Reach credential's (a credentials file's ``client_id``
and ``secret``), sent to ``/oauth/token`` as HTTP Basic or in the form.

- **The login** is the fabric's: the gateway logs the credential in with the token
  issuer, as the client itself would (a wrong secret, a revoked client and a login flood
  are refused there), and keeps the caller's fabric token on its side. The caller gets
  an access token of the gateway's own (a JWT, RFC 9068, signed with a key made when the
  gateway starts), for this gateway only (its ``aud`` is the resource, RFC 8707), valid
  at most as long as the fabric token. It never reaches the fabric: no token
  passthrough.
- **Each request** carries ``Authorization: Bearer <access token>``; without one, or
  with one that is forged, expired or for another resource, the answer is 401 with a
  ``WWW-Authenticate`` naming the resource metadata.
- **Each call runs as the caller**: in a request whose token verified, the gateway's
  calls are made ``acting_for`` the caller's session (``reach.security.membership``), whose
  call tokens the issuer mints for the caller's client id and level, with the gateway as
  the actor (RFC 8693 ``act``), and only for a gateway whose credential holds the
  ``gateway`` role. The callee checks the caller's level; the audit names both. A level
  is never more than the gateway's own.

``authlib`` validates the token request and writes its answer and errors (RFC 6749,
``reach.http.tokenendpoint``); the access tokens are signed and checked with
``joserfc``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl

from joserfc import jwt
from joserfc.errors import JoseError
from joserfc.jwk import OKPKey
from starlette.authentication import BaseUser
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from reach.caller.client import ReachClient
from reach.clock import Clock, system_clock
from reach.errors import AuthenticationFailed, ConfigurationError, ReachError
from reach.http.guard import is_loopback
from reach.http.tokenendpoint import basic_credentials, oauth_error, token_response
from reach.security.credentials import ROLE_GATEWAY, CredentialsFile
from reach.security.membership import acting_for
from reach.security.ratelimit import RateByKey
from reach.security.session import TokenSession
from reach.transport import Connection

__all__ = [
    "AS_METADATA_PATH",
    "AUTHORIZE_PATH",
    "PRM_PATH",
    "TOKEN_PATH",
    "Caller",
    "GatewayLogin",
    "RequireLogin",
    "gateway_roles",
    "login_for",
]

log = logging.getLogger("reach.oauth")

TOKEN_PATH = "/oauth/token"
AUTHORIZE_PATH = "/oauth/authorize"
PRM_PATH = "/.well-known/oauth-protected-resource"
AS_METADATA_PATH = "/.well-known/oauth-authorization-server"
#: the longest an access token lives (never longer than the caller's fabric token)
ACCESS_TTL_SEC = 3600.0
#: callers logged in at once (the one unseen longest is logged out beyond this)
MAX_CALLERS = 10_000
#: logins a second one address may ask for, and at once: every login is a request to the
#: fabric's issuer under the gateway's own name, whose rate the issuer bounds, so one
#: address flooding the token endpoint must not spend the logins of everyone else
LOGIN_RATE = 2.0
LOGIN_BURST = 20.0
#: the fully specified name of Ed25519 signatures (RFC 9864)
_ALG = "Ed25519"
#: verified access tokens remembered, so that a caller's requests after its first cost a
#: look-up instead of a signature check (each until its token expires)
VERIFIED_CACHE = 4096


@dataclass(frozen=True)
class Caller(BaseUser):
    """A caller logged in through the gateway: its client id, its clearance (as the
    gateway may use it: at most the gateway's own) and its fabric session."""

    client_id: str
    level: int
    session: TokenSession

    @property
    def is_authenticated(self) -> bool:
        return True

    @property
    def display_name(self) -> str:
        return self.client_id

    @property
    def identity(self) -> str:
        return self.client_id


class GatewayLogin:
    """The login of one gateway: its token endpoint and metadata, and the check of each
    request's bearer token.

    ``conn``: the gateway's connection to the fabric, over which callers log in;
    ``actor``: the gateway's own token session (its credential holds the ``gateway``
    role); ``resource_path``: the path of the protected resource (``/mcp``; '' for the
    whole gateway); ``public_url``: the base URL the metadata and tokens name (by
    default the one each request came to)."""

    def __init__(
        self,
        conn: Connection,
        actor: TokenSession,
        *,
        resource_path: str = "",
        public_url: str | None = None,
        access_ttl_sec: float = ACCESS_TTL_SEC,
        max_callers: int = MAX_CALLERS,
        name: str = "Agent-Reach gateway",
        clock: Clock = system_clock,
    ) -> None:
        if access_ttl_sec <= 0:
            raise ConfigurationError("access_ttl_sec must be positive")
        self._conn = conn
        self.actor = actor
        self.resource_path = resource_path
        self.public_url = public_url.rstrip("/") if public_url else None
        self.access_ttl_sec = access_ttl_sec
        self.max_callers = max_callers
        self.name = name
        self._clock = clock
        self._key = OKPKey.generate_key("Ed25519", auto_kid=True)
        #: client id → its session and level, the one used longest ago first
        self._callers: OrderedDict[str, Caller] = OrderedDict()
        self._logins_by_address = RateByKey(LOGIN_BURST)
        #: access token → (its subject, when it expires, its resource), for tokens
        #: verified already
        self._verified: dict[str, tuple[str, float, str]] = {}
        self._logins = asyncio.Lock()

    # -- where things are ------------------------------------------------------------------

    def base(self, request: Request | Scope) -> str:
        """The gateway's base URL for ``request``: the public one, else the one asked."""
        if self.public_url:
            return self.public_url
        scope = request.scope if isinstance(request, Request) else request
        return f"{scope.get('scheme', 'http')}://{_header(scope, b'host')}"

    def resource(self, request: Request | Scope) -> str:
        return self.base(request) + self.resource_path

    def metadata_url(self, request: Request | Scope) -> str:
        return self.base(request) + PRM_PATH + self.resource_path

    def routes(self) -> list[Any]:
        """The login's routes, to put beside the gateway's own."""
        from starlette.routing import Route

        paths = {PRM_PATH, PRM_PATH + self.resource_path}
        return [
            *(Route(path, self.protected_resource, methods=["GET"]) for path in sorted(paths)),
            Route(AS_METADATA_PATH, self.authorization_server, methods=["GET"]),
            Route(TOKEN_PATH, self.token, methods=["POST"]),
            Route(AUTHORIZE_PATH, self.authorize, methods=["GET", "POST"]),
        ]

    # -- metadata --------------------------------------------------------------------------

    async def protected_resource(self, request: Request) -> Response:
        """RFC 9728: what the resource is and which authorization server logs in to it."""
        base = self.base(request)
        return JSONResponse(
            {
                "resource": self.resource(request),
                "authorization_servers": [base],
                "bearer_methods_supported": ["header"],
                "resource_name": self.name,
            },
            headers={"cache-control": "no-store"},
        )

    async def authorization_server(self, request: Request) -> Response:
        """RFC 8414: the token endpoint and its one grant. (The authorization endpoint is
        listed because clients require one; it answers that only client credentials are
        taken.)"""
        base = self.base(request)
        return JSONResponse(
            {
                "issuer": base,
                "token_endpoint": base + TOKEN_PATH,
                "authorization_endpoint": base + AUTHORIZE_PATH,
                "grant_types_supported": ["client_credentials"],
                "response_types_supported": [],
                "token_endpoint_auth_methods_supported": [
                    "client_secret_basic",
                    "client_secret_post",
                ],
            },
            headers={"cache-control": "no-store"},
        )

    async def authorize(self, request: Request) -> Response:
        return oauth_error(
            400,
            "unsupported_response_type",
            "this authorization server takes the client credentials grant only, at"
            f" {TOKEN_PATH}, with an Agent-Reach credential's client_id and secret",
        )

    # -- the token endpoint ----------------------------------------------------------------

    async def token(self, request: Request) -> Response:
        """client_id + client_secret (an Agent-Reach credential) → an access token for
        this gateway."""
        try:
            form = dict(parse_qsl((await request.body()).decode("utf-8"), strict_parsing=False))
        except UnicodeDecodeError:
            return oauth_error(400, "invalid_request", "the form is not UTF-8")
        headers = request.headers
        client_id, secret = basic_credentials(headers)
        if client_id is None:
            client_id, secret = form.get("client_id"), form.get("client_secret")
        address = request.client.host if request.client is not None else ""
        if not self._logins_by_address.take(address, LOGIN_RATE):
            return oauth_error(
                429, "slow_down", f"more than {LOGIN_RATE:g} logins a second from this address"
            )
        if form.get("grant_type") != "client_credentials":
            return oauth_error(
                400, "unsupported_grant_type", "only grant_type=client_credentials is taken"
            )
        if not client_id or not secret:
            return oauth_error(
                401,
                "invalid_client",
                "give client_id and client_secret (an Agent-Reach credential)",
            )
        resource = form.get("resource")
        if resource is not None and resource.rstrip("/") != self.resource(request).rstrip("/"):
            return oauth_error(
                400, "invalid_target", f"this server issues tokens for {self.resource(request)}"
            )
        try:
            caller = await self._login(client_id, secret)
        except AuthenticationFailed as exc:
            return oauth_error(401, "invalid_client", str(exc))
        except ReachError as exc:
            return oauth_error(503, "temporarily_unavailable", str(exc))
        return token_response(
            self.base(request) + TOKEN_PATH,
            headers,
            form,
            (client_id, secret),
            lambda: self._access_token(caller, self.resource(request)),
        )

    async def _login(self, client_id: str, secret: str) -> Caller:
        """The caller's fabric session: logged in with the issuer now (a second login of a
        client replaces its first)."""
        # (a credential's url is where a client connects: the gateway's connection here)
        creds = CredentialsFile(url="", client_id=client_id, secret=secret)
        session = TokenSession(self._conn, creds, actor=self.actor)
        await session.start(wait=5.0)
        level = min(session.level, self.actor.level)
        caller = Caller(client_id, level, session)
        async with self._logins:
            old = self._callers.pop(client_id, None)
            self._callers[client_id] = caller
            gone = [self._callers.popitem(last=False)[1] for _ in range(self._over())]
        for stale in ([old] if old is not None else []) + gone:
            await stale.session.stop()
        log.info("%s logged in (level %d)", client_id, level)
        return caller

    def _over(self) -> int:
        return max(0, len(self._callers) - self.max_callers)

    def _access_token(self, caller: Caller, resource: str) -> dict[str, Any]:
        now = int(self._clock.time())
        life = int(min(self.access_ttl_sec, caller.session.expires_at - self._clock.time()))
        claims = {
            "iss": resource[: len(resource) - len(self.resource_path)] or resource,
            "aud": resource,
            "sub": caller.client_id,
            "client_id": caller.client_id,
            "lvl": caller.level,
            "iat": now,
            "exp": now + max(1, life),
            "jti": secrets.token_urlsafe(16),
        }
        header = {"alg": _ALG, "typ": "at+jwt", "kid": self._key.kid}
        token = jwt.encode(header, claims, self._key, algorithms=[_ALG])
        return {"access_token": token, "token_type": "Bearer", "expires_in": max(1, life)}

    # -- each request ----------------------------------------------------------------------

    def caller_of(self, scope: Scope) -> Caller | str:
        """The caller a request's bearer token names, or why there is none."""
        header = _header(scope, b"authorization")
        scheme, _, token = header.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return ""
        now = self._clock.time()
        resource = self.resource(scope)
        known = self._verified.get(token)
        if known is None or known[1] <= now or known[2] != resource:
            try:
                decoded = jwt.decode(token, self._key, algorithms=[_ALG])
                jwt.JWTClaimsRegistry(
                    now=int(now),
                    leeway=5,
                    aud={"essential": True, "value": resource},
                    exp={"essential": True},
                    sub={"essential": True},
                ).validate(decoded.claims)
            except (JoseError, ValueError) as exc:
                return f"the access token is not valid here ({type(exc).__name__}: {exc})"
            if decoded.header.get("typ") != "at+jwt":
                return "not an access token"
            known = (str(decoded.claims["sub"]), float(decoded.claims["exp"]), resource)
            if len(self._verified) >= VERIFIED_CACHE:
                self._verified.clear()
            self._verified[token] = known
        caller = self._callers.get(known[0])
        if caller is None or caller.session.expires_at <= now:
            return "the login behind this token has ended: ask for a new token"
        self._callers.move_to_end(caller.client_id)
        return caller

    def challenge(self, scope: Scope, error: str = "") -> list[tuple[bytes, bytes]]:
        """The ``WWW-Authenticate`` of a 401: where the resource metadata is."""
        value = f'Bearer resource_metadata="{self.metadata_url(scope)}"'
        if error:
            value += f', error="invalid_token", error_description="{_quoted(error)}"'
        return [(b"www-authenticate", value.encode("latin-1", "replace"))]

    async def close(self) -> None:
        """Log every caller out."""
        callers = list(self._callers.values())
        self._callers.clear()
        for caller in callers:
            await caller.session.stop()


def gateway_roles(session: TokenSession) -> frozenset[str]:
    """The roles the gateway's own fabric token says it holds (the issuer signed it for
    this very session; read to tell the operator at start what is missing)."""
    import jwt as pyjwt

    try:
        claims = pyjwt.decode(session.token, options={"verify_signature": False})
    except (pyjwt.PyJWTError, AuthenticationFailed):
        return frozenset()
    roles = claims.get("roles", [])
    return (
        frozenset(r for r in roles if isinstance(r, str))
        if isinstance(roles, list)
        else frozenset()
    )


def login_for(
    client: ReachClient,
    *,
    host: str,
    enabled: bool,
    resource_path: str = "",
    public_url: str | None = None,
) -> GatewayLogin | None:
    """The login of a gateway serving HTTP on ``host`` for ``client``'s fabric, or None
    where it serves without one: asked not to (``enabled`` false), or on an open fabric
    (no tokens to log in with). Without a login the gateway may listen on loopback only
    (ConfigurationError elsewhere): every caller then acts as the gateway."""
    session = client.token_session
    if session is None or not enabled:
        if not is_loopback(host):
            why = "this fabric issues no tokens" if session is None else "--no-login was given"
            raise ConfigurationError(
                f"a gateway listening on {host} must log its callers in, and {why}:"
                " listen on 127.0.0.1, or serve a fabric started by `reach up`"
            )
        return None
    if ROLE_GATEWAY not in gateway_roles(session):
        raise ConfigurationError(
            f"the gateway's credential {session.client_id} lacks the {ROLE_GATEWAY!r} role, which"
            " calling for the callers that log in needs: reach creds add NAME --level N"
            f" --role {ROLE_GATEWAY} (or --no-login, on loopback only)"
        )
    return GatewayLogin(
        client.connection, session, resource_path=resource_path, public_url=public_url
    )


class RequireLogin:
    """ASGI middleware: the paths of ``open_paths`` (metadata, the token endpoint, and
    whatever the gateway serves to everyone) pass; every other request needs a valid
    bearer token, and runs as its caller (``scope["user"]``, and ``acting_for`` its
    session)."""

    def __init__(
        self, app: ASGIApp, login: GatewayLogin, *, open_paths: Callable[[str], bool]
    ) -> None:
        self.app = app
        self.login = login
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.open_paths(scope["path"]):
            # for everyone; a caller who shows a valid token is known (a card shows it
            # the skills of its level), one who shows none or a bad one is anonymous
            found = self.login.caller_of(scope)
            if isinstance(found, Caller):
                scope["user"] = found
            await self.app(scope, receive, send)
            return
        found = self.login.caller_of(scope)
        if not isinstance(found, Caller):
            body = json.dumps(
                {"error": "invalid_token" if found else "unauthorized",
                 "error_description": found or "log in: Authorization: Bearer <token>"}
            ).encode()  # fmt: skip
            headers = [
                (b"content-type", b"application/json"),
                (b"cache-control", b"no-store"),
                *self.login.challenge(scope, found),
            ]
            await send({"type": "http.response.start", "status": 401, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        scope["user"] = found
        with acting_for(found.session):
            await self.app(scope, receive, send)


def _header(scope: Scope, name: bytes) -> str:
    """A request header's value ('' without one): a look along the list, with no map made
    of every header on each request."""
    return next((v for k, v in scope["headers"] if k == name), b"").decode("latin-1")


def _quoted(text: str) -> str:
    return text.replace("\\", "").replace('"', "'")[:200]
