"""``reach console`` over HTTP: every page, the live feed, escaping of what agents say of
themselves, and the login when it is not on loopback (the browser's view is
tests/test_console_browser.py)."""

from __future__ import annotations

import asyncio
import base64

import httpx
import pytest

from reach.caller.client import ReachClient

from .calls_helpers import capability, make_agent
from .console_helpers import SCRIPT, serve_console
from .poll_helpers import until
from .up_helpers import Secured

pytestmark = pytest.mark.timeout(120)


def hostile_agent(fabric: Secured):  # type: ignore[no-untyped-def]
    cap = capability("echo", level=2, tags=("work",))
    cap["description"] = SCRIPT
    agent, _ = make_agent(fabric.url, "a-1", cap)
    agent.credentials = fabric.agent
    return agent


async def test_every_page_shows_the_fabric_and_escapes_what_agents_say(secured: Secured) -> None:
    async with (
        hostile_agent(secured),
        ReachClient(servers=secured.url, credentials=secured.watcher) as caller,
        serve_console(secured.url, secured.admin) as (base, _console),
        httpx.AsyncClient(base_url=base, timeout=10) as http,
    ):
        result = await caller.call("echo", {"x": 1})
        page = await http.get("/agents")
        assert page.status_code == 200
        assert 'data-agent="a-1"' in page.text
        # the description is shown, as text: no element of it reaches the page as markup
        assert "&lt;script&gt;document.title=" in page.text
        assert "<script>document" not in page.text
        assert "<img src=x" not in page.text
        assert "script-src 'self'" in page.headers["content-security-policy"]

        filtered = await http.get("/agents", params={"tag": "nothing-has-it"})
        assert 'data-agent="a-1"' not in filtered.text
        assert "matching the filter" in filtered.text

        async def found() -> str | None:
            got = await http.get("/calls", params={"call_id": result.call_id, "since": "5m"})
            return got.text if result.call_id in got.text and "1 call(s)" in got.text else None

        await until(found, "the call found in the audit stream by its id", interval=0.2)
        call = await http.get(f"/call/{result.call_id}")
        assert call.status_code == 200
        assert "a-1" in call.text
        assert 'id="trace-id"' in call.text

        cap = await http.get("/capability/echo")
        assert cap.status_code == 200
        assert "<svg" in cap.text
        assert "&lt;script&gt;" in cap.text
        assert (await http.get("/alerts")).status_code == 200
        doctor = await http.get("/doctor", params={"target": "echo"})
        assert doctor.status_code == 200
        assert doctor.text.count('class="step ') == 6
        missing = await http.get("/call/no-such-call", params={"since": "1m"})
        assert missing.status_code == 404
        bad = await http.get("/calls", params={"since": "<b>yesterday</b>"})
        assert bad.status_code == 400
        assert "&lt;b&gt;yesterday" in bad.text


async def test_the_live_feed_sends_the_agents_table_and_its_changes(secured: Secured) -> None:
    async with (
        serve_console(secured.url, secured.admin) as (base, _console),
        httpx.AsyncClient(base_url=base, timeout=10) as http,
        http.stream("GET", "/live/agents") as feed,
    ):
        assert feed.headers["content-type"].startswith("text/event-stream")
        lines = feed.aiter_lines()
        seen: list[str] = []

        async def next_update() -> str:
            data: list[str] = []
            async for line in lines:
                if line.startswith("data: "):
                    data.append(line[6:])
                elif not line and data:
                    return "\n".join(data)
            raise AssertionError("the feed ended")

        async with asyncio.timeout(10):
            seen.append(await next_update())
        assert "no agents registered" in seen[0]
        async with hostile_agent(secured), asyncio.timeout(10):
            while 'data-agent="a-1"' not in seen[-1]:
                seen.append(await next_update())
        assert "&lt;script&gt;" in seen[-1]
        assert "<script>" not in seen[-1]
    assert (await http_get_status(base, "/live/nothing")) is None


async def http_get_status(base: str, path: str) -> int | None:
    """The status of ``path``, None once the console is gone."""
    try:
        async with httpx.AsyncClient(base_url=base, timeout=2) as http:
            return (await http.get(path)).status_code
    except httpx.TransportError:
        return None


async def test_a_foreign_host_name_is_refused_on_loopback(secured: Secured) -> None:
    """A page elsewhere cannot read the console by pointing a name at 127.0.0.1."""
    async with (
        serve_console(secured.url, secured.admin) as (base, _console),
        httpx.AsyncClient(base_url=base, timeout=10) as http,
    ):
        assert (await http.get("/agents", headers={"host": "evil.example:8222"})).status_code == 421
        assert (await http.get("/agents", headers={"host": "localhost:8222"})).status_code == 200
        assert (await http.get("/live/nothing")).status_code == 404


async def test_off_loopback_every_path_asks_for_the_login(secured: Secured) -> None:
    def basic(user: str, password: str) -> dict[str, str]:
        token = base64.b64encode(f"{user}:{password}".encode()).decode()
        return {"authorization": f"Basic {token}"}

    async with (
        serve_console(secured.url, secured.admin, password="s3cret") as (base, _console),
        httpx.AsyncClient(base_url=base, timeout=10) as http,
    ):
        for path in ("/", "/agents", "/calls", "/live/agents", "/static/console.js", "/nope"):
            refused = await http.get(path)
            assert refused.status_code == 401, path
            assert refused.headers["www-authenticate"].startswith("Basic")
        for headers in (
            basic("operator", "wrong"),
            basic("admin", "s3cret"),
            {"authorization": "Basic !!!"},
            {"authorization": "Bearer s3cret"},
        ):
            assert (await http.get("/agents", headers=headers)).status_code == 401, headers
        page = await http.get("/agents", headers=basic("operator", "s3cret"))
        assert page.status_code == 200
        assert "Agents" in page.text
        # bound elsewhere, the Host is whatever name the operator reaches it by
        named = {**basic("operator", "s3cret"), "host": "console.example:8222"}
        assert (await http.get("/agents", headers=named)).status_code == 200


async def test_a_credential_without_the_registry_is_told_not_shown_everything(
    secured: Secured,
) -> None:
    """The console shows what its credential may read, and says what it may not."""
    async with (
        serve_console(secured.url, secured.watcher) as (base, _console),
        httpx.AsyncClient(base_url=base, timeout=10) as http,
    ):
        page = await http.get("/agents")
        assert page.status_code == 200
        assert 'class="note"' in page.text
