"""``reach mcp``: the fabric's capabilities as MCP tools, for LLM hosts."""

from __future__ import annotations

import click

from reach.cli.common import Target, connection_options, fail, run


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
    @connection_options
    def mcp(target: Target, http_port: int | None, host: str) -> None:
        """Serve the fabric's capabilities as the tools of an MCP server.

        One tool per capability, with its input schema; the list follows the registry
        as agents come and go (clients are told it changed). A tool call is a fabric
        call under these credentials; a failed one is a tool error naming the layer
        that failed. Serves stdio (what a desktop host launches) unless --http is given.
        """
        try:
            # the SDK is loaded for this command only: `reach --help` stays fast
            from reach.gateways.mcp import serve
        except ImportError as exc:
            fail(f"reach mcp needs the MCP SDK: pip install 'agent-reach[gateways]' ({exc})", 2)
        run(serve(target.servers, target.credentials, http_port=http_port, host=host))
