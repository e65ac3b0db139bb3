"""`reach mcp` against a fabric `reach up` started (tokens on), through the MCP SDK's own
client: over stdio with the initialize handshake (tool changes arrive as
``notifications/tools/list_changed``) and over streamable HTTP with the 2026-07-28
protocol (tool changes arrive on a ``subscriptions/listen`` stream). The tools are the
capabilities of the agents on the fabric, with their schemas; a call is a fabric call
under the gateway's credential; a failed one is a tool error naming the layer."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mcp", reason="the MCP SDK is the gateways extra: pip install '.[gateways]'")

import httpx2
import mcp_types as types
from mcp import Client
from mcp.client.auth.extensions.client_credentials import ClientCredentialsOAuthProvider
from mcp.client.session import IncomingMessage
from mcp.client.stdio import StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.client.subscriptions import Subscription, ToolsListChanged
from mcp.shared.auth import OAuthClientInformationFull, OAuthToken
from mcp.shared.exceptions import MCPError

from reach.errors import (
    AuthenticationFailed,
    BusinessError,
    CircuitOpen,
    ContractError,
    InternalError,
    NoResponders,
    NotAuthorized,
    NotFound,
    ReachError,
    RetriesExhausted,
    Unavailable,
)
from reach.gateways.mcptools import (
    WRAPPED_ARGUMENT,
    answer,
    catalogue,
    payload_of,
    refusal,
    tool_of,
)
from reach.security.credentials import CredentialsFile
from reach.wire.models import Capability, Manifest

from .calls_helpers import capability, make_agent
from .cli_helpers import CLEAN_ENV, REACH, reach_cli, reach_serving
from .poll_helpers import until
from .up_helpers import Secured

#: an end-to-end run of whole programs: `make test-long` (CI runs it after `make test`)
pytestmark = pytest.mark.long

#: how long a change may take to reach the MCP client, at most
WITHIN = 10.0

ECHO_INPUT = {
    "type": "object",
    "properties": {"text": {"type": "string"}},
    "required": ["text"],
    "additionalProperties": False,
}
ECHO_OUTPUT = {"type": "object", "properties": {"by": {"type": "string"}}, "required": ["by"]}


def _cap(name: str, level: int = 2) -> dict[str, Any]:
    cap = capability(name, level=level, input_schema=ECHO_INPUT, output_schema=ECHO_OUTPUT)
    cap["description"] = f"says back what it is given ({name})"
    return cap


async def _agent_creds(fabric: Secured, agent_id: str, cap: str, level: int = 2) -> Path:
    """Credentials of an agent that may serve ``cap``, made by the fabric's admin."""
    out = fabric.admin.parent.parent / f"{agent_id}.creds"
    code, stdout, stderr = await reach_cli(
        "creds", "add", agent_id, "--level", str(level), "--agent-id", agent_id,
        "--cap", cap, "--out", str(out), "--servers", fabric.url, "--creds", str(fabric.admin),
    )  # fmt: skip
    assert code == 0, stdout + stderr
    return out


@contextlib.asynccontextmanager
async def _serving(
    fabric: Secured, agent_id: str, cap: str, creds: Path, level: int = 2
) -> AsyncIterator[None]:
    """An agent serving ``cap`` on the fabric (registered once entered)."""
    agent, _ = make_agent(fabric.url, agent_id, _cap(cap, level))
    agent.credentials = creds
    await agent.start()
    try:
        yield
    finally:
        await agent.stop()


async def _names(client: Client) -> set[str]:
    return {tool.name for tool in (await client.list_tools()).tools}


def _text(result: types.CallToolResult) -> str:
    block = result.content[0]
    assert isinstance(block, types.TextContent)
    return block.text


def _gateway_args(fabric: Secured, *extra: str) -> list[str]:
    return ["mcp", "--servers", fabric.url, "--creds", str(fabric.watcher), *extra]


async def test_over_stdio_tools_are_the_capabilities_and_list_changed_follows_the_registry(
    secured: Secured,
) -> None:
    changes: asyncio.Queue[types.ToolListChangedNotification] = asyncio.Queue()

    async def on_message(message: IncomingMessage) -> None:
        if isinstance(message, types.ToolListChangedNotification):
            changes.put_nowait(message)

    upper_creds = await _agent_creds(secured, "b-1", "upper")
    params = StdioServerParameters(command=REACH, args=_gateway_args(secured), env=CLEAN_ENV)
    async with (
        _serving(secured, "a-1", "echo", secured.agent),
        Client(params, mode="legacy", message_handler=on_message) as client,
    ):
        tools = {tool.name: tool for tool in (await client.list_tools()).tools}
        assert set(tools) == {"echo"}
        assert tools["echo"].input_schema == ECHO_INPUT
        assert tools["echo"].output_schema == ECHO_OUTPUT
        assert tools["echo"].description == "says back what it is given (echo)"

        result = await client.call_tool("echo", {"text": "hi"})
        assert not result.is_error, _text(result)
        assert result.structured_content == {"by": "a-1", "echo": {"text": "hi"}}

        refused = await client.call_tool("echo", {"text": 5})
        assert refused.is_error
        assert _text(refused).startswith("contract error (ContractError)"), _text(refused)
        assert "text" in _text(refused)

        async with _serving(secured, "b-1", "upper", upper_creds):
            await asyncio.wait_for(changes.get(), WITHIN)
            assert await _names(client) == {"echo", "upper"}
            served = await client.call_tool("upper", {"text": "x"})
            assert served.structured_content == {"by": "b-1", "echo": {"text": "x"}}
        await asyncio.wait_for(changes.get(), WITHIN)
        assert await _names(client) == {"echo"}
        with pytest.raises(MCPError, match="unknown tool 'upper'"):
            await client.call_tool("upper", {"text": "x"})


async def _next_change(sub: Subscription) -> None:
    async with asyncio.timeout(WITHIN):
        event = await anext(sub)
    assert isinstance(event, ToolsListChanged)


@contextlib.asynccontextmanager
async def _http_gateway(fabric: Secured) -> AsyncIterator[str]:
    """`reach mcp --http 0` running under a level-4 credential with the gateway role;
    yields the URL it says it serves at."""
    gateway_creds = fabric.admin.parent.parent / "gw-mcp.creds"
    code, stdout, stderr = await reach_cli(
        "creds", "add", "gw-mcp", "--level", "4", "--role", "gateway", "--out",
        str(gateway_creds), "--servers", fabric.url, "--creds", str(fabric.admin),
    )  # fmt: skip
    assert code == 0, stdout + stderr
    args = ("mcp", "--servers", fabric.url, "--creds", str(gateway_creds), "--http", "0")
    async with reach_serving(*args, ready=r" tools at (http://127\.0\.0\.1:\S+)") as (_, found):
        yield found.group(1)


class _Memory:
    """Where the SDK's OAuth client keeps its token: in memory."""

    def __init__(self) -> None:
        self.tokens: OAuthToken | None = None
        self.info: OAuthClientInformationFull | None = None

    async def get_tokens(self) -> OAuthToken | None:
        return self.tokens

    async def set_tokens(self, tokens: OAuthToken) -> None:
        self.tokens = tokens

    async def get_client_info(self) -> OAuthClientInformationFull | None:
        return self.info

    async def set_client_info(self, client_info: OAuthClientInformationFull) -> None:
        self.info = client_info


def _login(url: str, creds: Path) -> httpx2.AsyncClient:
    """An HTTP client that logs in with an Agent-Reach credential through the gateway's
    OAuth flow (client credentials), as the SDK's OAuth provider does it."""
    data = CredentialsFile.read(creds)
    auth = ClientCredentialsOAuthProvider(
        server_url=url, storage=_Memory(), client_id=data.client_id,
        client_secret=data.secret, issuer=url.removesuffix("/mcp"),
    )  # fmt: skip
    return httpx2.AsyncClient(auth=auth, timeout=30)


async def test_over_http_each_caller_logs_in_sees_and_calls_only_what_its_clearance_allows(
    secured: Secured,
) -> None:
    # the caller (watcher) holds level 2: a level-3 capability is not for it, though the
    # gateway holds level 4
    vault_creds = await _agent_creds(secured, "v-1", "vault", level=3)
    async with (
        _serving(secured, "a-1", "echo", secured.agent),
        _http_gateway(secured) as url,
        _login(url, secured.watcher) as http,
        Client(streamable_http_client(url, http_client=http)) as client,
    ):
        assert client.protocol_version == "2026-07-28"
        assert await _names(client) == {"echo"}
        result = await client.call_tool("echo", {"text": "over http"})
        assert result.structured_content == {"by": "a-1", "echo": {"text": "over http"}}

        async with client.listen(tools_list_changed=True) as sub:
            async with _serving(secured, "v-1", "vault", vault_creds, level=3):
                await _next_change(sub)
                # listed for nobody below its level, and refused by name
                assert await _names(client) == {"echo"}
                refused = await client.call_tool("vault", {"text": "secret"})
                assert refused.is_error
                assert _text(refused).startswith("authorization error (NotAuthorized)")
                assert refused.structured_content is not None
                error = refused.structured_content["error"]
                assert (error["level_required"], error["level_held"]) == (3, 2)
            await _next_change(sub)
            assert await _names(client) == {"echo"}

        # the call ran as the caller: the agent saw watcher, not the gateway (its event
        # is written by the gateway's audit writer a moment after the call)
        async def callers() -> set[str] | None:
            code, out, err = await reach_cli(
                "audit", "tail", "--capability", "echo", "--json",
                "--servers", secured.url, "--creds", str(secured.admin),
            )  # fmt: skip
            assert code == 0, err
            seen = {json.loads(line)["caller"] for line in out.splitlines() if line.strip()}
            return seen or None

        assert await until(callers, "the call's audit event", timeout=10) == {"watcher"}


# -- the mapping itself, without a fabric ------------------------------------------------


def _manifest(agent_id: str, version: str, *caps: dict[str, Any]) -> Manifest:
    return Manifest.model_validate(
        {"agent_id": agent_id, "agent_name": "t", "version": version, "capabilities": list(caps)}
    )


def test_a_capability_that_does_not_take_an_object_takes_its_payload_as_one_argument() -> None:
    spec = tool_of(Capability(name="shout", input_schema={"type": "string", "maxLength": 5}))
    assert spec.tool.input_schema == {
        "type": "object",
        "properties": {WRAPPED_ARGUMENT: {"type": "string", "maxLength": 5}},
        "required": [WRAPPED_ARGUMENT],
        "additionalProperties": False,
    }
    assert payload_of(spec, {WRAPPED_ARGUMENT: "hey"}) == "hey"
    with pytest.raises(ContractError, match="exactly one argument"):
        payload_of(spec, {"text": "hey"})
    # an object answer is structured content as it is; any other is {"result": ...}
    assert answer(["a", "b"]).structured_content == {"result": ["a", "b"]}
    assert tool_of(Capability(name="any")).tool.input_schema == {"type": "object"}


def test_the_tool_shows_the_contract_of_the_newest_version() -> None:
    old = capability("echo", input_schema={"type": "object", "required": ["a"]})
    new = capability("echo", input_schema={"type": "object", "required": ["b"]})
    pre = capability("echo", input_schema={"type": "object", "required": ["c"]})
    tools = catalogue(
        [_manifest("z-1", "1.10.0", new), _manifest("a-1", "1.9.0", old),
         _manifest("m-1", "1.10.0-rc.1", pre)]
    )  # fmt: skip
    assert tools["echo"].tool.input_schema["required"] == ["b"]


@pytest.mark.parametrize(
    ("error", "layer"),
    [
        (ContractError("$.text: 5 is not a string", path="$.text"), "contract"),
        (NotFound("no instance offers vault"), "discovery"),
        (NoResponders("nobody listens"), "routing"),
        (CircuitOpen("a-1", 0.0), "breaker"),
        (AuthenticationFailed("token expired"), "authentication"),
        (NotAuthorized("level 3 needed", level_required=3, level_held=2), "authorization"),
        (BusinessError("no data for 1999", code="no_data"), "business"),
        (InternalError("boom"), "agent"),
        (RetriesExhausted("3 attempts", attempts=3, last=Unavailable("busy")), "routing"),
        (RetriesExhausted("2 attempts", attempts=2, last=InternalError("boom")), "agent"),
    ],
)
def test_a_failed_call_is_a_tool_error_that_names_the_layer(error: ReachError, layer: str) -> None:
    result = refusal(error)
    assert result.is_error
    assert _text(result).startswith(f"{layer} error ({type(error).__name__}): ")
    assert result.structured_content["error"]["layer"] == layer
