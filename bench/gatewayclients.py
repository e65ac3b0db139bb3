"""The callers of ``bench.gateways``: one echo call, made each way a client reaches the
fabric's capability, and the login a gateway asks for.

Each ``open_*`` is an async context manager giving a ``Call`` (payload in, the echoed
payload out; a refused or failed call raises):

- ``open_direct``: ``ReachClient.call``;
- ``open_mcp_stdio``: the MCP SDK's ``Client`` launching ``reach mcp`` (stdio);
- ``open_mcp_http``: the MCP SDK's ``Client`` over streamable HTTP;
- ``open_a2a``: A2A ``SendMessage`` (or 0.3's ``message/send``) as a JSON-RPC POST with
  plain httpx;
- ``open_mcp_wire`` and ``open_a2a_wire``: the same requests as the two above, written
  and read by hand over kept-alive connections (``Wire``): what the gateway adds without
  a client library's own cost.

A gateway serving a fabric with tokens asks each HTTP caller to log in (OAuth 2.0 client
credentials, with an Agent-Reach credential's ``client_id`` and ``secret``). Whether it
asks is read from its first answer: a 401 sends the MCP SDK's client through its
client-credentials provider, and the A2A and hand-written callers through
``access_token``; any other answer, and they call without a token.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import uuid
from collections.abc import AsyncIterator, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from bench.stacks import Call
from reach.security.credentials import CredentialsFile

__all__ = [
    "A2A_METHODS",
    "LOGINS",
    "TOOL",
    "Wire",
    "access_token",
    "open_a2a",
    "open_a2a_wire",
    "open_direct",
    "open_mcp_http",
    "open_mcp_stdio",
    "open_mcp_wire",
]

#: the capability every caller calls (the agent's echo), and so the MCP tool's name
TOOL = "echo"
#: A2A's JSON-RPC method of a message, by protocol version
A2A_METHODS = {"1.0": "SendMessage", "0.3": "message/send"}
#: the MCP protocol version the SDK's client speaks by default, and its hand-written twin
MCP_VERSION = "2026-07-28"
_ROOT = Path(__file__).resolve().parent.parent
_TIMEOUT = 30.0


class CallFailed(RuntimeError):
    """A call answered with an error (a tool error, a failed task, an HTTP status)."""


# -- the login ---------------------------------------------------------------------------


async def access_token(http: httpx.AsyncClient, refused: httpx.Response, creds: Path) -> str:
    """Log in at the gateway that answered ``refused`` (a 401) with the credential
    ``creds``: the resource metadata its ``WWW-Authenticate`` names (RFC 9728), the token
    endpoint its authorization server's metadata names (RFC 8414), a client-credentials
    grant with the credential's client_id and secret (RFC 6749); the access token."""
    challenge = refused.headers.get("www-authenticate", "")
    found = re.search(r'resource_metadata="([^"]+)"', challenge)
    if found is None:
        raise CallFailed(f"a 401 without resource metadata: {challenge!r}")
    resource = (await http.get(found.group(1))).raise_for_status().json()
    issuer = resource["authorization_servers"][0].rstrip("/")
    server = (
        (await http.get(f"{issuer}/.well-known/oauth-authorization-server"))
        .raise_for_status()
        .json()
    )
    data = CredentialsFile.read(creds)
    answer = await http.post(
        server["token_endpoint"],
        data={"grant_type": "client_credentials"},
        auth=(data.client_id, data.secret),
    )
    return str(answer.raise_for_status().json()["access_token"])


#: the URLs called so far, and whether each asked its callers to log in
LOGINS: dict[str, bool] = {}


async def _bearer(
    url: str, body: Mapping[str, Any], headers: Mapping[str, str], creds: Path
) -> str:
    """``Authorization`` for requests to ``url``: empty when a first request goes through
    without one, else a bearer token of ``creds``' login."""
    async with httpx.AsyncClient(timeout=_TIMEOUT) as http:
        first = await http.post(url, json=body, headers=headers)
        LOGINS[url] = first.status_code == 401
        if first.status_code != 401:
            return ""
        return "Bearer " + await access_token(http, first, creds)


# -- direct and MCP with the SDK -----------------------------------------------------------


@asynccontextmanager
async def open_direct(url: str) -> AsyncIterator[Call]:
    from reach.caller.client import ReachClient

    async with ReachClient(servers=url, name="bench-gateways-direct") as client:
        await client.routes.wait_for(
            lambda cache: any(i.status == "healthy" for i in cache.find(TOOL)), timeout=30
        )

        async def call(payload: dict[str, Any]) -> Any:
            return (await client.call(TOOL, payload)).value

        yield call


def _tool_call(client: Any) -> Call:
    async def call(payload: dict[str, Any]) -> Any:
        result = await client.call_tool(TOOL, payload)
        if result.is_error:
            raise CallFailed(str(result.content))
        return result.structured_content

    return call


@asynccontextmanager
async def open_mcp_stdio(url: str, creds: Path) -> AsyncIterator[Call]:
    """The SDK's client launching ``reach mcp`` (its own process, this checkout)."""
    from mcp import Client
    from mcp.client.stdio import StdioServerParameters

    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(_ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    params = StdioServerParameters(
        command=sys.executable,
        args=["-m", "reach", "mcp", "--servers", url, "--creds", str(creds)],
        env=env,
    )
    async with Client(params) as client:
        yield _tool_call(client)


class _Memory:
    """Where the SDK's OAuth provider keeps its token: in memory."""

    def __init__(self) -> None:
        self.tokens: Any = None
        self.info: Any = None

    async def get_tokens(self) -> Any:
        return self.tokens

    async def set_tokens(self, tokens: Any) -> None:
        self.tokens = tokens

    async def get_client_info(self) -> Any:
        return self.info

    async def set_client_info(self, client_info: Any) -> None:
        self.info = client_info


def _mcp_request(method: str, params: dict[str, Any], request_id: int) -> dict[str, Any]:
    """A 2026-07-28 request: its envelope in ``_meta``, as the SDK's client sends it."""
    meta = {
        "io.modelcontextprotocol/protocolVersion": MCP_VERSION,
        "io.modelcontextprotocol/clientInfo": {"name": "bench", "version": "1"},
        "io.modelcontextprotocol/clientCapabilities": {},
    }
    return {
        "jsonrpc": "2.0",
        "id": request_id,
        "method": method,
        "params": {**params, "_meta": meta},
    }


def _mcp_headers(method: str) -> dict[str, str]:
    return {
        "accept": "application/json, text/event-stream",
        "mcp-protocol-version": MCP_VERSION,
        "mcp-method": method,
    }


@asynccontextmanager
async def open_mcp_http(url: str, creds: Path) -> AsyncIterator[Call]:
    """The SDK's client over streamable HTTP; through the SDK's client-credentials OAuth
    provider when the gateway answers 401."""
    import httpx2
    from mcp import Client
    from mcp.client.auth.extensions.client_credentials import ClientCredentialsOAuthProvider
    from mcp.client.streamable_http import streamable_http_client

    auth = None
    probe = _mcp_request("tools/list", {}, 0)
    if await _bearer(url, probe, _mcp_headers("tools/list"), creds):
        data = CredentialsFile.read(creds)
        origin = urlsplit(url)
        auth = ClientCredentialsOAuthProvider(
            server_url=url,
            storage=_Memory(),
            client_id=data.client_id,
            client_secret=data.secret,
            issuer=f"{origin.scheme}://{origin.netloc}",
        )
    async with (
        httpx2.AsyncClient(auth=auth, timeout=_TIMEOUT) as http,
        Client(streamable_http_client(url, http_client=http)) as client,
    ):
        yield _tool_call(client)


# -- A2A with httpx ------------------------------------------------------------------------


def _a2a_request(version: str, payload: dict[str, Any]) -> dict[str, Any]:
    if version == "0.3":
        message: dict[str, Any] = {
            "role": "user",
            "messageId": uuid.uuid4().hex,
            "parts": [{"kind": "data", "data": payload}],
        }
    else:
        message = {"role": "ROLE_USER", "messageId": uuid.uuid4().hex, "parts": [{"data": payload}]}
    return {
        "jsonrpc": "2.0",
        "id": 1,
        "method": A2A_METHODS[version],
        "params": {"message": message},
    }


def _a2a_headers(version: str) -> dict[str, str]:
    return {"a2a-version": version} if version != "0.3" else {}


def _a2a_value(answer: dict[str, Any], version: str) -> Any:
    """The echoed payload of a completed task, or CallFailed."""
    if "error" in answer:
        raise CallFailed(str(answer["error"]))
    result = answer["result"]
    task = result.get("task", result)
    state = task["status"]["state"]
    if state not in ("TASK_STATE_COMPLETED", "completed"):
        raise CallFailed(f"task {state}: {task['status']}")
    return task["artifacts"][0]["parts"][0]["data"]


@asynccontextmanager
async def open_a2a(url: str, creds: Path, version: str) -> AsyncIterator[Call]:
    """A2A's message as a JSON-RPC POST with plain httpx, to the agent at ``url``."""
    headers = _a2a_headers(version)
    bearer = await _bearer(url, _a2a_request(version, {}), headers, creds)
    if bearer:
        headers["authorization"] = bearer
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(headers=headers, timeout=_TIMEOUT, limits=limits) as http:

        async def call(payload: dict[str, Any]) -> Any:
            answer = await http.post(url, json=_a2a_request(version, payload))
            return _a2a_value(answer.raise_for_status().json(), version)

        yield call


# -- by hand -------------------------------------------------------------------------------


class Wire:
    """JSON POSTs to one URL over kept-alive HTTP/1.1 connections, written and read by
    hand (one connection per call in flight, reused): the least a client can cost."""

    def __init__(self, url: str, headers: Mapping[str, str]) -> None:
        parts = urlsplit(url)
        self._host = parts.hostname or "127.0.0.1"
        self._port = parts.port or 80
        lines = [
            f"POST {parts.path or '/'} HTTP/1.1",
            f"host: {parts.netloc}",
            "content-type: application/json",
            *(f"{k}: {v}" for k, v in headers.items()),
        ]
        self._head = "\r\n".join(lines).encode()
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self._open: list[asyncio.StreamWriter] = []

    async def post(self, body: bytes) -> bytes:
        """The answer's body (CallFailed unless 200). A kept-alive connection the server
        has closed meanwhile (uvicorn closes one idle for 5 s) is replaced, as client
        libraries do."""
        request = self._head + f"\r\ncontent-length: {len(body)}\r\n\r\n".encode() + body
        while self._idle:
            reader, writer = self._idle.pop()
            try:
                return await self._exchange(reader, writer, request)
            except (asyncio.IncompleteReadError, ConnectionError):
                writer.close()  # closed by the server while idle: another one
        reader, writer = await asyncio.open_connection(self._host, self._port)
        self._open.append(writer)
        return await self._exchange(reader, writer, request)

    async def _exchange(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes
    ) -> bytes:
        writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")
        status = head.split(b" ", 2)[1]
        fields = dict(line.split(b":", 1) for line in head.split(b"\r\n")[1:] if b":" in line)
        fields = {k.strip().lower(): v.strip() for k, v in fields.items()}
        if b"content-length" in fields:
            answer = await reader.readexactly(int(fields[b"content-length"]))
        else:  # chunked
            chunks = []
            while size := int((await reader.readline()).strip(), 16):
                chunks.append(await reader.readexactly(size))
                await reader.readline()
            await reader.readline()
            answer = b"".join(chunks)
        self._idle.append((reader, writer))
        if status != b"200":
            raise CallFailed(f"HTTP {status.decode()}: {answer[:300]!r}")
        return answer

    async def close(self) -> None:
        for writer in self._open:
            writer.close()
        self._idle.clear()
        self._open.clear()


@asynccontextmanager
async def _wire(
    url: str, headers: dict[str, str], probe: dict[str, Any], creds: Path
) -> AsyncIterator[Wire]:
    bearer = await _bearer(url, probe, headers, creds)
    if bearer:
        headers = {**headers, "authorization": bearer}
    wire = Wire(url, headers)
    try:
        yield wire
    finally:
        await wire.close()


@asynccontextmanager
async def open_mcp_wire(url: str, creds: Path) -> AsyncIterator[Call]:
    """``tools/call`` as the SDK's client sends it (2026-07-28), by hand."""
    headers = {**_mcp_headers("tools/call"), "mcp-name": TOOL}
    probe = _mcp_request("tools/list", {}, 0)
    async with AsyncExitStack() as stack:
        wire = await stack.enter_async_context(_wire(url, headers, probe, creds))

        async def call(payload: dict[str, Any]) -> Any:
            request = _mcp_request("tools/call", {"name": TOOL, "arguments": payload}, 1)
            answer = json.loads(await wire.post(json.dumps(request).encode()))
            result = answer.get("result")
            if result is None or result.get("isError"):
                raise CallFailed(str(answer)[:300])
            return result.get("structuredContent")

        yield call


@asynccontextmanager
async def open_a2a_wire(url: str, creds: Path, version: str) -> AsyncIterator[Call]:
    """A2A's message as a JSON-RPC POST, by hand."""
    async with _wire(url, _a2a_headers(version), _a2a_request(version, {}), creds) as wire:

        async def call(payload: dict[str, Any]) -> Any:
            body = json.dumps(_a2a_request(version, payload)).encode()
            return _a2a_value(json.loads(await wire.post(body)), version)

        yield call
