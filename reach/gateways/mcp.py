"""``reach mcp``: the fabric's capabilities as the tools of an MCP server.

An MCP host (Claude Desktop, an MCP-capable IDE, any client of the official SDK) lists
the tools and calls them; each tool is a capability of the agents on the fabric
(``reach.gateways.mcptools`` says how one maps onto the other). The gateway is a
``ReachClient`` under its own credential: a tool call is ``ReachClient.call``, with its
routing, retries, breakers, call tokens (the gateway's clearance) and audit event.

The tool list follows the registry live, through the client's route cache. When the
set of tools changes (an agent with a new capability announced itself, the last
instance of one left, a new version changed a contract) the gateway tells its
clients: a ``notifications/tools/list_changed`` on each connection that made the
initialize handshake (protocol versions up to 2025-11-25), and a ``ToolsListChanged``
event on each ``subscriptions/listen`` stream that asked for tool changes (2026-07-28
and later). A heartbeat, or a health change, changes no tool and tells nobody.

It serves one client over stdio (what a desktop host launches), or any number over
streamable HTTP at ``/mcp`` on a port.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import weakref
from collections.abc import Mapping
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import mcp_types as types
from mcp.server import NotificationOptions, Server, ServerRequestContext
from mcp.server.connection import Connection
from mcp.server.models import InitializationOptions
from mcp.server.subscriptions import InMemorySubscriptionBus, ListenHandler, ToolsListChanged
from mcp.shared.exceptions import MCPError
from starlette.types import ASGIApp

from reach.caller.client import ReachClient
from reach.errors import NotAuthorized, ReachError
from reach.gateways.mcptools import ToolSpec, answer, catalogue, payload_of, refusal
from reach.http.guard import Door, DoorPolicy
from reach.http.oauth import TOKEN_PATH, Caller, GatewayLogin, RequireLogin, login_for
from reach.security.membership import acting_for
from reach.tasks import cancel_and_wait
from reach.wire.models import Instance, Manifest

__all__ = ["HTTP_PATH", "McpGateway", "serve"]

log = logging.getLogger("reach.mcp")

#: where the streamable HTTP endpoint is served
HTTP_PATH = "/mcp"
#: how long requests still open when told to stop may go on, at most
STOP_GRACE_SEC = 5
#: A request over HTTP is answered with one JSON body, not an SSE stream: the SDK's stream
#: costs each call a task group, memory streams and more writes, and a tool call here sends
#: nothing before its result (no progress, no request back to the client). A
#: ``subscriptions/listen`` request is still a stream, and so is the handshake-era GET
#: stream that carries tool-list changes. What a call gives up: the SDK's keep-alive
#: comments on a call silent for 15 s, and the call's end when its client goes away (the
#: call still ends at its deadline).
JSON_RESPONSES = True

_INSTRUCTIONS = (
    "Each tool is a capability of an agent on the Agent-Reach fabric; calling it routes the"
    " call to a healthy instance. A failed call's text starts with the layer that failed:"
    " contract (fix the arguments), discovery or routing (no instance could take it now),"
    " breaker, authentication or authorization (this gateway may not call it), business"
    " (the agent refused the request), agent (the agent failed)."
)


def _reach_version() -> str:
    try:
        return version("agent-reach")
    except PackageNotFoundError:  # pragma: no cover - run from a source tree
        return "0"


class _GatewayServer(Server[Any]):
    """The SDK's low-level server, announcing that its tool list changes (also where the
    streamable HTTP transport asks for the initialize options itself)."""

    def create_initialization_options(
        self,
        notification_options: NotificationOptions | None = None,
        experimental_capabilities: dict[str, dict[str, Any]] | None = None,
        extensions: dict[str, dict[str, Any]] | None = None,
    ) -> InitializationOptions:
        return super().create_initialization_options(
            notification_options or NotificationOptions(tools_changed=True),
            experimental_capabilities,
            extensions,
        )


class McpGateway:
    """An MCP server whose tools are the capabilities of a connected ``ReachClient``.

    ``start`` after the client connected; ``stop`` before it closes."""

    def __init__(self, client: ReachClient) -> None:
        self.client = client
        #: the tools by name, rebuilt when a manifest comes, goes or changes
        self.tools: dict[str, ToolSpec] = {}
        self._manifests: dict[str, Manifest] = {}
        self._dirty = asyncio.Event()
        self._watcher: asyncio.Task[None] | None = None
        self._bus = InMemorySubscriptionBus()
        self._listen = ListenHandler(self._bus)
        #: the handshake-era connections, told of changes; each goes when its client does
        self._connections: weakref.WeakSet[Connection] = weakref.WeakSet()
        #: the callers' login over HTTP (None: stdio, or no login)
        self.login: GatewayLogin | None = None
        self.server = _GatewayServer(
            "agent-reach",
            version=_reach_version(),
            title="Agent-Reach",
            description="The capabilities of the agents on an Agent-Reach fabric, as tools",
            instructions=_INSTRUCTIONS,
            get_tool_input_schema=self._input_schema,
            on_list_tools=self._list_tools,
            on_call_tool=self._call_tool,
            on_subscriptions_listen=self._listen,
        )
        self.server.add_notification_handler(
            "notifications/initialized", types.NotificationParams, self._initialized
        )

    def http_app(self, policy: DoorPolicy, login: GatewayLogin | None) -> ASGIApp:
        """The streamable HTTP app at ``HTTP_PATH``, behind the door of ``policy`` and,
        with ``login``, the callers' login (its metadata and token endpoint beside it)."""
        from mcp.server.transport_security import TransportSecuritySettings

        self.login = login
        app: ASGIApp = self.server.streamable_http_app(
            streamable_http_path=HTTP_PATH,
            json_response=JSON_RESPONSES,
            # the door checks Host and Origin for every path, the SDK's own check only its
            # own path and only for the names of a loopback address
            transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False),
            max_request_body_size=policy.max_body,
            custom_starlette_routes=login.routes() if login is not None else None,
        )
        if login is not None:
            app = RequireLogin(app, login, open_paths=lambda path: path != HTTP_PATH)
        return Door(app, policy)

    async def start(self) -> None:
        """Take the tools from the route cache and follow it from now on."""
        routes = self.client.routes
        # its tools are every capability of the fabric: it follows the whole registry
        await routes.follow_everything()
        for instance in routes.all():
            self._manifests[instance.agent_id] = instance.manifest
        self.tools = catalogue(self._manifests.values())
        routes.on_change(self._instance_changed)
        self._watcher = asyncio.create_task(self._follow(), name="mcp-tools-follow")

    async def stop(self) -> None:
        """Stop following the registry; open listen streams end gracefully."""
        if self._watcher is not None:
            await cancel_and_wait([self._watcher])
            self._watcher = None
        self.end_streams()

    def end_streams(self) -> None:
        """End every open ``subscriptions/listen`` stream gracefully (its final frame says
        so), as when the gateway stops."""
        self._listen.close()

    # -- the tool list follows the registry ----------------------------------------------

    def _instance_changed(self, agent_id: str, instance: Instance | None) -> None:
        """A route cache change: only a manifest that came, went or changed matters."""
        if instance is None:
            if self._manifests.pop(agent_id, None) is None:
                return
        else:
            known = self._manifests.get(agent_id)
            if known is not None and known == instance.manifest:
                return  # a heartbeat, a health change: the same tools
            self._manifests[agent_id] = instance.manifest
        self._dirty.set()

    async def _follow(self) -> None:
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            tools = catalogue(self._manifests.values())
            if [s.tool for s in tools.values()] == [s.tool for s in self.tools.values()]:
                continue  # another instance of capabilities already listed
            self.tools = tools
            log.info("tools now: %s", ", ".join(tools) or "none")
            await self._announce()

    async def _announce(self) -> None:
        """Tell every client that listens that the tool list changed."""
        await self._bus.publish(ToolsListChanged())
        for conn in list(self._connections):
            try:
                await conn.send_tool_list_changed()
            except Exception:  # one client's broken stream must not stop the others
                log.warning("could not tell an MCP client of the tool change", exc_info=True)

    async def _initialized(
        self, ctx: ServerRequestContext[Any], params: types.NotificationParams
    ) -> None:
        """A handshake-era client is ready: it hears of tool changes from now on."""
        # The SDK gives a handler the per-request session; the connection behind it is
        # what outlives the request (held weakly: it goes when its client does).
        conn = getattr(ctx.session, "_connection", None)
        if isinstance(conn, Connection):
            self._connections.add(conn)
        else:  # pragma: no cover - an SDK that keeps its connection elsewhere
            log.warning("cannot tell this MCP client of tool changes (unknown SDK session)")

    # -- the MCP requests -----------------------------------------------------------------

    def _input_schema(self, name: str) -> Mapping[str, Any] | None:
        spec = self.tools.get(name)
        return spec.tool.input_schema if spec is not None else None

    async def _list_tools(
        self, ctx: ServerRequestContext[Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        caller = _caller(ctx)
        return types.ListToolsResult(
            tools=[
                spec.tool
                for spec in self.tools.values()
                if caller is None or spec.level <= caller.level
            ]
        )

    async def _call_tool(
        self, ctx: ServerRequestContext[Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        caller = _caller(ctx)
        spec = self.tools.get(params.name)
        if spec is not None and caller is not None and spec.level > caller.level:
            return refusal(
                NotAuthorized(
                    f"{caller.client_id} may not call {spec.capability}: it needs clearance"
                    f" {spec.level}, {caller.client_id} holds {caller.level}",
                    level_required=spec.level,
                    level_held=caller.level,
                )
            )
        if spec is None:
            raise MCPError(
                types.INVALID_PARAMS,
                f"unknown tool {params.name!r}: no agent on the fabric offers it now"
                " (list the tools again)",
            )
        try:
            payload = payload_of(spec, params.arguments)
            # the SDK may run the handler outside the HTTP request's task: the caller is
            # named again here
            with acting_for(caller.session if caller is not None else None):
                result = await self.client.call(spec.capability, payload)
        except ReachError as exc:
            return refusal(exc)
        return answer(result.value)


def _caller(ctx: ServerRequestContext[Any]) -> Caller | None:
    """The caller logged in for this request (None over stdio, or without login)."""
    request = ctx.request
    scope = getattr(request, "scope", None)
    user = scope.get("user") if isinstance(scope, dict) else None
    return user if isinstance(user, Caller) else None


async def serve(
    servers: list[str],
    credentials: Path | None,
    *,
    http_port: int | None = None,
    host: str = "127.0.0.1",
    login: bool = True,
    policy: DoorPolicy | None = None,
    public_url: str | None = None,
) -> None:
    """Connect to the fabric and serve its capabilities over stdio, or over streamable
    HTTP on ``host:http_port`` (0: a free port) when a port is given: behind the door
    (``policy``; by default the one of ``host``) and, unless ``login`` is false (on
    loopback only), the callers' login (``reach.http.oauth``)."""
    async with ReachClient(servers=servers, credentials=credentials, name="reach-mcp") as client:
        gateway = McpGateway(client)
        checked = None
        if http_port is not None:
            checked = login_for(
                client, host=host, enabled=login, resource_path=HTTP_PATH, public_url=public_url
            )
        await gateway.start()
        try:
            if http_port is None:
                await _serve_stdio(gateway)
            else:
                door = policy or DoorPolicy.for_address(host, form_paths=[TOKEN_PATH])
                await _serve_http(gateway, host, http_port, gateway.http_app(door, checked))
        finally:
            await gateway.stop()
            if checked is not None:
                await checked.close()


async def _serve_stdio(gateway: McpGateway) -> None:
    from mcp.server.stdio import stdio_server

    from reach.gateways.mcpstdio import pipes

    _say(f"reach mcp: {len(gateway.tools)} tools over stdio")
    async with pipes() as wire:
        stdin, stdout = wire if wire is not None else (None, None)
        async with stdio_server(stdin, stdout) as (read_stream, write_stream):
            server = gateway.server
            await server.run(read_stream, write_stream, server.create_initialization_options())


async def _serve_http(gateway: McpGateway, host: str, port: int, app: ASGIApp) -> None:
    from reach.http.serve import listen, serve, url_of

    sock = listen(host, port)  # listening before the URL is printed: a client may connect at once
    with contextlib.closing(sock):
        _say(f"reach mcp: {len(gateway.tools)} tools at {url_of(sock, HTTP_PATH)}")
        if gateway.login is None:
            _say(
                "reach mcp: no login (an open fabric, or --no-login): every caller on this"
                " machine calls with this gateway's credential"
            )
        # the SDK's session manager runs in the app's lifespan; told to stop, the listen
        # streams end at once, and the handshake-era GET streams with the session manager
        # after the grace period
        await serve(
            app, sock, lifespan=True, graceful_sec=STOP_GRACE_SEC, stopping=gateway.end_streams
        )


def _say(line: str) -> None:
    """A line for the operator: on stderr (stdout is the stdio transport's)."""
    print(line, file=sys.stderr, flush=True)
