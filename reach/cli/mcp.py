"""``reach mcp``: the fabric's capabilities as MCP tools, for LLM hosts."""

from __future__ import annotations

import click

from reach.cli.common import Target, connection_options, fail, run
from reach.cli.doors import door_options, policy_of


def register(main: click.Group) -> None:
    @main.command("mcp", short_help="Serve the fabric's capabilities as MCP tools.")
    @click.option(
        "--http",
        "http_port",
        type=click.IntRange(0, 65535),
        default=None,
        metavar="PORT",
        help="serve streamable HTTP at /mcp on PORT (0: a free one) instead of stdio",
    )
    @click.option(
        "--host", default="127.0.0.1", show_default=True, help="the address --http listens on"
    )
    @click.option(
        "--public-url",
        metavar="URL",
        default=None,
        help="the base URL the login's metadata gives (behind a proxy); default: the one asked",
    )
    @door_options
    @connection_options
    def mcp(
        target: Target,
        http_port: int | None,
        host: str,
        public_url: str | None,
        no_login: bool,
        allow_hosts: tuple[str, ...],
        allow_origins: tuple[str, ...],
        max_body: int,
    ) -> None:
        """Serve the fabric's capabilities as the tools of an MCP server.

        One tool per capability, with its input schema; the list follows the registry
        as agents come and go (clients are told it changed). A tool call is a fabric
        call; a failed one is a tool error naming the layer that failed. Serves stdio
        (what a desktop host launches, calling with these credentials) unless --http is
        given. Over HTTP every caller logs in with its own Agent-Reach credential (OAuth
        2.1 client credentials at /oauth/token, then Authorization: Bearer), sees the
        tools its clearance allows and calls as itself; this gateway's credential needs
        the gateway role (reach creds add NAME --level N --role gateway).
        """
        try:
            # the SDK is loaded for this command only: `reach --help` stays fast
            from reach.gateways.mcp import serve
        except ImportError as exc:
            fail(f"reach mcp needs the MCP SDK: pip install 'agent-reach[gateways]' ({exc})", 2)
        policy = policy_of(host, allow_hosts, allow_origins, max_body)
        run(
            serve(
                target.servers,
                target.credentials,
                http_port=http_port,
                host=host,
                login=not no_login,
                policy=policy,
                public_url=public_url,
            )
        )
