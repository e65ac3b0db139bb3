"""The console served in a test's own event loop, over a fabric the test started."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import uvicorn

from reach.console import Console, FabricView
from reach.fabric.embedded import free_port
from reach.security.membership import connect_as

from .poll_helpers import until

#: what a description holds that would run if it were markup
SCRIPT = "<script>document.title='owned'</script><img src=x onerror=\"document.title='owned'\">"


@contextlib.asynccontextmanager
async def serve_console(
    url: str, creds: Path | None, *, password: str | None = None
) -> AsyncIterator[tuple[str, Console]]:
    """``reach console``'s application on a free loopback port: (its base URL, it)."""
    conn, _ = await connect_as([url], name="reach-console", credentials=creds)
    view = FabricView(conn)
    await view.start()
    console = Console(view, interval=0.2, password=password, loopback_only=password is None)
    port = free_port()
    config = uvicorn.Config(
        console.asgi, host="127.0.0.1", port=port, log_level="warning", lifespan="off"
    )
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve())
    try:
        # uvicorn sets a flag, not an event
        await until(lambda: server.started, "the console served", timeout=10)
        yield f"http://127.0.0.1:{port}", console
    finally:
        console.closing.set()
        server.should_exit = True
        await serving
        await view.stop()
        await conn.close()
