"""`reach mcp --http` answers each request with one JSON body (no SSE stream per call), for
clients of the 2026-07-28 protocol and handshake-era ones alike, while tool-list changes
still arrive as streams: a ``subscriptions/listen`` stream, and a handshake-era client's
GET stream. On an open fabric (no tokens, so no login at the gateway either)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

pytest.importorskip("mcp", reason="the MCP SDK is the gateways extra: pip install '.[gateways]'")

import httpx2
import mcp_types as types
from mcp import Client
from mcp.client.session import IncomingMessage
from mcp.client.streamable_http import streamable_http_client
from mcp.client.subscriptions import ToolsListChanged

from reach.registry import Registrar
from reach.testing import NatsServer

from .calls_helpers import capability, make_agent
from .cli_helpers import reach_serving

#: an end-to-end run of whole programs: `make test-long` (CI runs it after `make test`)
pytestmark = pytest.mark.long

#: how long a change may take to reach the MCP client, at most
WITHIN = 10.0


@contextlib.asynccontextmanager
async def _agent(url: str, agent_id: str, cap: str) -> AsyncIterator[None]:
    agent, _ = make_agent(url, agent_id, capability(cap))
    await agent.start()
    try:
        yield
    finally:
        await agent.stop()


@contextlib.asynccontextmanager
async def _gateway(url: str) -> AsyncIterator[str]:
    args = ("mcp", "--servers", url, "--http", "0")
    async with reach_serving(*args, ready=r" tools at (http://\S+)") as (_, found):
        yield found.group(1)


def _recording(kinds: list[str]) -> httpx2.AsyncClient:
    """An HTTP client that notes the content type of every answer to a POST."""

    async def note(response: httpx2.Response) -> None:
        if response.request.method == "POST" and response.status_code == 200:
            kinds.append(response.headers.get("content-type", ""))

    return httpx2.AsyncClient(event_hooks={"response": [note]})


@pytest.mark.parametrize("mode", ["auto", "legacy"])
async def test_calls_are_answered_with_json_and_tool_changes_still_stream(
    nats_server: NatsServer, registrar: Registrar, mode: str
) -> None:
    changes: asyncio.Queue[None] = asyncio.Queue()

    async def on_message(message: IncomingMessage) -> None:
        if isinstance(message, types.ToolListChangedNotification):
            changes.put_nowait(None)

    kinds: list[str] = []
    async with (
        _agent(nats_server.url, "a-1", "echo"),
        _gateway(nats_server.url) as url,
        _recording(kinds) as http,
        Client(
            streamable_http_client(url, http_client=http), mode=mode, message_handler=on_message
        ) as client,
    ):
        assert (client.protocol_version == "2026-07-28") == (mode == "auto")
        for n in range(3):
            result = await client.call_tool("echo", {"n": n})
            assert result.structured_content == {"by": "a-1", "echo": {"n": n}}
        assert kinds, "no answer was seen"
        assert all(kind.startswith("application/json") for kind in kinds), kinds

        names = {tool.name for tool in (await client.list_tools()).tools}
        assert names == {"echo"}
        if mode == "legacy":  # the tool-list change comes on the session's GET stream
            async with _agent(nats_server.url, "b-1", "upper"):
                await asyncio.wait_for(changes.get(), WITHIN)
                names = {tool.name for tool in (await client.list_tools()).tools}
                assert names == {"echo", "upper"}
        else:  # on a listen stream
            async with (
                client.listen(tools_list_changed=True) as sub,
                _agent(nats_server.url, "b-1", "upper"),
                asyncio.timeout(WITHIN),
            ):
                assert isinstance(await anext(sub), ToolsListChanged)
