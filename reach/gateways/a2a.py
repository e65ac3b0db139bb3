"""``reach a2a``: the fabric's agents as A2A agents, over HTTP.

One A2A agent per agent name on the fabric, at ``/agents/<name>``:

- ``GET /agents/<name>/.well-known/agent-card.json``: its Agent Card
  (``reach.gateways.a2a_cards``: skills = capabilities);
- ``POST /agents/<name>``: its A2A JSON-RPC endpoint (protocol 1.0, and 0.3's method
  names), served by the SDK's dispatcher over ``reach.gateways.a2a_handler``;
- ``GET /`` (also ``/agents``): the index, every live agent with its card's URL.

Cards and index are built from the route cache of the gateway's ``ReachClient`` on each
request, so they follow the registry: an agent whose instances have all left (or are
unhealthy) is no longer listed and its card is 404. The calls are the gateway's:
its credentials, clearance and audit, for whoever can reach its port (it listens on
127.0.0.1 unless told otherwise).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from a2a.server.context import ServerCallContext
from a2a.server.routes import DefaultServerCallContextBuilder, create_jsonrpc_routes
from a2a.types import AgentCard
from a2a.utils.constants import AGENT_CARD_WELL_KNOWN_PATH, VERSION_HEADER
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp

from reach.caller.client import ReachClient
from reach.gateways.a2a_cards import (
    LEGACY_CARD_PATH,
    agents_of,
    card_document,
    card_for,
    card_response,
    card_version,
    index_entry,
    security_of,
)
from reach.gateways.a2a_handler import AGENT_KEY, FabricRequestHandler
from reach.gateways.a2a_store import TaskStore
from reach.http.guard import Door, DoorPolicy
from reach.http.oauth import TOKEN_PATH, Caller, GatewayLogin, RequireLogin, login_for
from reach.http.serve import listen, url_of
from reach.http.serve import serve as serve_http

__all__ = ["A2AGateway", "guarded", "serve"]

#: where an agent's JSON-RPC endpoint is; its card is under it, at the well-known path
AGENT_PATH = "/agents/{agent}"
#: the level of the skills a card shows to whom has not logged in (public, general)
PUBLIC_LEVEL = 1
#: the call context's key for the caller logged in (``reach.http.oauth.Caller``)
CALLER_KEY = "reach.caller"


class _AgentContext(DefaultServerCallContextBuilder):
    """The SDK's call context, with the agent name of the request's path."""

    def build(self, request: Request) -> ServerCallContext:
        context = super().build(request)
        context.state[AGENT_KEY] = request.path_params.get("agent", "")
        context.state[CALLER_KEY] = request.scope.get("user")
        return context


class A2AGateway:
    """The HTTP app of the A2A gateway over a connected ``ReachClient``.

    ``public_url``: the base URL the cards give (behind a proxy, say); by default the one
    each request came to. ``job_wait``: how long a message to an async-mode capability
    waits for its job before it answers with the task still working. ``tasks``: where
    the tasks are kept for ``GetTask`` (a ``TaskStore`` of the default bounds unless
    given). ``login``: whether the cards describe the gateway's login
    (``reach.gateways.a2a_cards.security_of``).
    """

    def __init__(
        self,
        client: ReachClient,
        *,
        public_url: str | None = None,
        job_wait: float = 30.0,
        tasks: TaskStore | None = None,
        login: bool = False,
    ) -> None:
        self.client = client
        self.public_url = public_url.rstrip("/") if public_url else None
        self.login = login
        self.handler = FabricRequestHandler(client, job_wait=job_wait, tasks=tasks)
        self.handler.extended_card = self._extended_card

    def _extended_card(self, name: str, context: ServerCallContext) -> AgentCard | None:
        """``GetExtendedAgentCard``: the card with the skills of the caller who asks."""
        host = str(context.state.get("headers", {}).get("host", ""))
        base = self.public_url or f"http://{host}"
        return self.card_of(name, base, context.state.get(CALLER_KEY))

    def _base(self, request: Request) -> str:
        return self.public_url or str(request.base_url).rstrip("/")

    def _urls(self, request: Request, name: str) -> tuple[str, str]:
        url = f"{self._base(request)}/agents/{name}"
        return url, url + AGENT_CARD_WELL_KNOWN_PATH

    async def index(self, request: Request) -> Response:
        agents = agents_of(self.client.routes.find())
        return JSONResponse(
            {
                "agents": [
                    index_entry(name, found, *self._urls(request, name))
                    for name, found in agents.items()
                ]
            }
        )

    def clearance(self, user: object) -> int:
        """The level whose skills a card shows: the caller's, logged in; without a login
        to the gateway, every skill (the gateway's own clearance decides); and to a caller
        not logged in to a gateway that asks for one, the public skills (level 1)."""
        if isinstance(user, Caller):
            return user.level
        return PUBLIC_LEVEL if self.login else 4

    def card_of(self, name: str, base: str, user: object) -> AgentCard | None:
        """Agent ``name``'s card as ``user`` may see it (None: no such agent is live)."""
        found = agents_of(self.client.routes.find()).get(name)
        if not found:
            return None
        security = security_of(base, self.login)
        url = f"{base}/agents/{name}"
        return card_for(name, found, url, security, clearance=self.clearance(user))

    async def card(self, request: Request) -> Response:
        name = request.path_params["agent"]
        card = self.card_of(name, self._base(request), request.scope.get("user"))
        if card is None:
            return JSONResponse({"error": f"no agent named {name!r} is live"}, status_code=404)
        # the version a request names: its header, else the parameter A2A allows for it
        requested = request.headers.get(VERSION_HEADER) or request.query_params.get(VERSION_HEADER)
        version = card_version(requested, request.url.path.endswith(LEGACY_CARD_PATH))
        return card_response(card_document(card, version), request.headers.get("if-none-match"))

    def app(self) -> Starlette:
        routes: list[Any] = [
            Route("/", self.index, methods=["GET"]),
            Route("/agents", self.index, methods=["GET"]),
            Route(AGENT_PATH + AGENT_CARD_WELL_KNOWN_PATH, self.card, methods=["GET"]),
            Route(AGENT_PATH + LEGACY_CARD_PATH, self.card, methods=["GET"]),
            *create_jsonrpc_routes(
                self.handler, AGENT_PATH, context_builder=_AgentContext(), enable_v0_3_compat=True
            ),
        ]
        return Starlette(routes=routes)


def _rpc_path(path: str) -> bool:
    """Whether ``path`` is an agent's JSON-RPC endpoint (``/agents/<name>``): what a
    caller must log in for; the index, cards and login metadata are for everyone."""
    rest = path.removeprefix("/agents/")
    return rest != path and bool(rest.strip("/")) and "/" not in rest.strip("/")


def guarded(gateway: A2AGateway, policy: DoorPolicy, login: GatewayLogin | None) -> ASGIApp:
    """The gateway's app behind the door of ``policy`` and, with ``login``, the callers'
    login (its metadata and token endpoint beside the gateway's routes)."""
    gateway.login = login is not None
    starlette = gateway.app()
    app: ASGIApp = starlette
    if login is not None:
        starlette.router.routes.extend(login.routes())
        app = RequireLogin(starlette, login, open_paths=lambda path: not _rpc_path(path))
    return Door(app, policy)


async def serve(
    gateway: A2AGateway,
    host: str,
    port: int,
    ready: Callable[[str], None],
    *,
    policy: DoorPolicy | None = None,
    login: bool = True,
) -> None:
    """Serve ``gateway`` on ``host``:``port`` (0: a free port) until SIGINT or SIGTERM;
    ``ready(url)`` once it listens. Behind the door (``policy``; by default the one of
    ``host``) and, unless ``login`` is false (on loopback only) or the fabric is open,
    the callers' login (``reach.http.oauth``)."""
    checked = login_for(gateway.client, host=host, enabled=login, public_url=gateway.public_url)
    door = policy or DoorPolicy.for_address(host, form_paths=[TOKEN_PATH])
    sock = listen(host, port)
    try:
        with contextlib.closing(sock):
            # its index and cards list every agent of the fabric: it follows the registry
            await gateway.client.routes.follow_everything()
            app = guarded(gateway, door, checked)
            ready(url_of(sock))
            await serve_http(app, sock)
    finally:
        if checked is not None:
            await checked.close()
