"""``reach.http.serve``, what `reach a2a`, `reach mcp --http` and `reach console` serve
through: its connections have Nagle's algorithm off (an answer written as headers then
body is not held back for the client's delayed ACK, a fixed 40 ms a request on Linux),
it stops on SIGTERM and on cancellation after telling the app, and says why it cannot
listen; `reach console` names the port it got and ends its live feeds when told to stop."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import statistics
import time
from collections.abc import AsyncIterator

import httpx
import pytest

pytest.importorskip("uvicorn", reason="uvicorn is the gateways' and the console's extra")

from starlette.types import Receive, Scope, Send

from reach.errors import ConfigurationError
from reach.http.serve import listen, serve, url_of

from .cli_helpers import reach_serving
from .conftest import Fabric


async def _app(scope: Scope, receive: Receive, send: Send) -> None:
    """An answer in two writes, headers and then a body, as every ASGI app sends them."""
    assert scope["type"] == "http"
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


@contextlib.asynccontextmanager
async def _serving(
    stopping: asyncio.Event | None = None,
) -> AsyncIterator[tuple[str, asyncio.Task[None]]]:
    sock = listen("127.0.0.1", 0)
    url = url_of(sock)
    task = asyncio.create_task(serve(_app, sock, stopping=stopping.set if stopping else None))
    async with httpx.AsyncClient(timeout=5) as http:
        async with asyncio.timeout(10):
            while True:
                with contextlib.suppress(httpx.TransportError):
                    await http.get(url)
                    break
                await asyncio.sleep(0.02)
    try:
        yield url, task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_accepted_connections_have_nagle_off() -> None:
    sock = listen("127.0.0.1", 0)
    accepted: asyncio.Queue[int] = asyncio.Queue()

    class Probe(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            conn = transport.get_extra_info("socket")
            accepted.put_nowait(conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            transport.close()

    # what uvicorn does with the socket it is given
    server = await asyncio.get_running_loop().create_server(Probe, sock=sock)
    try:
        host, port = sock.getsockname()[:2]
        _, writer = await asyncio.open_connection(host, port)
        assert await asyncio.wait_for(accepted.get(), 5) != 0
        writer.close()
    finally:
        server.close()
        await server.wait_closed()


async def test_requests_on_a_kept_alive_connection_are_not_held_for_the_delayed_ack() -> None:
    async with _serving() as (url, _), httpx.AsyncClient(timeout=5) as http:
        took = []
        for _ in range(20):
            start = time.perf_counter()
            assert (await http.get(url)).content == b"ok"
            took.append(time.perf_counter() - start)
    # held back, every request but the first few takes the client's delayed ACK (40 ms)
    assert statistics.median(took) < 0.02, took


async def test_sigterm_stops_it_after_telling_the_app_and_closes_the_socket() -> None:
    stopping = asyncio.Event()
    async with _serving(stopping) as (url, task):
        signal.raise_signal(signal.SIGTERM)
        await asyncio.wait_for(asyncio.shield(task), 10)  # returns: no exception
        assert stopping.is_set()
        async with httpx.AsyncClient(timeout=2) as http:
            with pytest.raises(httpx.ConnectError):
                await http.get(url)


async def test_cancelled_it_stops_after_telling_the_app() -> None:
    stopping = asyncio.Event()
    async with _serving(stopping) as (_, task):
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert stopping.is_set()


def test_a_busy_port_is_a_configuration_error_naming_the_address() -> None:
    with listen("127.0.0.1", 0) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(ConfigurationError, match=f"cannot listen on 127.0.0.1:{port}"):
            listen("127.0.0.1", port)


def test_an_ipv6_address_is_in_brackets() -> None:
    try:
        sock = listen("::1", 0)
    except ConfigurationError:
        pytest.skip("no IPv6 loopback here")
    with sock:
        assert sock.family == socket.AF_INET6
        assert url_of(sock, "/mcp").startswith("http://[::1]:")
        assert url_of(sock, "/mcp").endswith("/mcp")


@pytest.mark.long
async def test_reach_console_names_its_real_port_and_a_sigterm_ends_its_live_feeds(
    fabric: Fabric,
) -> None:
    creds = str(fabric.creds["auditor"])
    args = ("console", "--port", "0", "--servers", fabric.url, "--creds", creds)
    ready = r"reach console on (http://127\.0\.0\.1:(\d+)/) "
    async with reach_serving(*args, ready=ready) as (proc, found):
        assert found.group(2) != "0"
        async with (
            httpx.AsyncClient(base_url=found.group(1), timeout=10) as http,
            http.stream("GET", "/live/agents") as feed,
        ):
            assert feed.status_code == 200
            events = feed.aiter_lines()
            assert (await anext(events)).startswith("event: update")
            proc.send_signal(signal.SIGTERM)
            # the feed ends when the console is told to stop, not after the grace period
            start = time.monotonic()
            async for _ in events:
                pass
            assert time.monotonic() - start < 1.5
        assert await asyncio.wait_for(proc.wait(), 20) == 0
