"""What keeps `reach console` cheap with pages open: a live part is rendered once per
refresh whatever the number of browsers showing it, and at once when the registry
changes (the cost itself is measured by ``python -m bench.console``)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from reach.registry.registrar import Registrar
from reach.tasks import cancel_and_wait
from reach.testing import NatsServer

from .calls_helpers import capability, make_agent
from .console_helpers import serve_console

pytestmark = pytest.mark.timeout(60)


async def _read(base: str, path: str, updates: list[str]) -> None:
    """Every update of a live feed, appended to ``updates``."""
    async with (
        httpx.AsyncClient(base_url=base, timeout=None) as http,
        http.stream("GET", path) as feed,
    ):
        data: list[str] = []
        async for line in feed.aiter_lines():
            if line.startswith("data: "):
                data.append(line[6:])
            elif not line and data:
                updates.append("\n".join(data))
                data = []


async def test_a_live_part_is_rendered_once_per_refresh_and_at_once_on_a_registry_change(
    nats_server: NatsServer, registrar: Registrar
) -> None:
    async with serve_console(nats_server.url, None) as (base, console):
        console.refresh = 2.0  # the feeds look every 0.2 s (serve_console's interval)
        renders: list[str] = []
        fragment = console.pages.fragment

        def counted(page: str, params: dict[str, str]) -> str | None:
            renders.append(page)
            return fragment(page, params)

        console.pages.fragment = counted  # type: ignore[method-assign]
        feeds = [[] for _ in range(3)]  # type: list[list[str]]
        readers = [asyncio.create_task(_read(base, "/live/agents", f)) for f in feeds]
        try:
            await asyncio.sleep(3)
            # three feeds for three seconds: the first rendering, one a refresh later
            # (a registry record written meanwhile may add one)
            assert 1 <= renders.count("agents") <= 3
            assert all(f and "no agents registered" in f[0] for f in feeds)
            agent, _ = make_agent(nats_server.url, "w-1", capability("work"))
            async with agent:
                started = time.monotonic()
                while not all(f and 'data-agent="w-1"' in f[-1] for f in feeds):
                    assert time.monotonic() - started < 1.5, "the new agent not shown at once"
                    await asyncio.sleep(0.05)
        finally:
            await cancel_and_wait(readers)
