"""`reach console` in a real browser (headless Chromium, tests/webdriver.py) over a fabric
`reach up` started, with agents in processes of their own: the agents page lists them, a
SIGKILLed agent turns unhealthy on the page without a reload, a call is found by its id,
and a description holding a script is shown as text and never runs.

With REACH_SCREENSHOTS=DIR (docs/img for the documentation) each page is saved there
as console-<page>.png.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from reach.caller.client import ReachClient
from reach.fabric.embedded import free_port
from reach.tasks import cancel_and_wait

from .cli_helpers import CLEAN_ENV, REACH, reach_cli
from .console_helpers import SCRIPT
from .up_helpers import Secured
from .webdriver import Browser, browser_missing, chromium

pytestmark = [
    pytest.mark.long,
    pytest.mark.timeout(180),
    pytest.mark.skipif(browser_missing() is not None, reason=browser_missing() or ""),
]

HERE = Path(__file__).parent
TITLE = "agents · reach console"
#: where screenshots go: REACH_SCREENSHOTS, relative to the checkout (tests run elsewhere)
SHOTS = os.environ.get("REACH_SCREENSHOTS", "")


def manifest(agent_id: str, description: str) -> dict[str, object]:
    return {
        "agent_id": agent_id,
        "agent_name": "echoer",
        "version": "1.2.0",
        "max_concurrency": 8,
        "capabilities": [
            {
                "name": "echo",
                "description": description,
                "tags": ["demo", "text"],
                "latency_sla_ms": 200.0,
                "security_level": 2,
                "idempotent": True,
                "input_schema": {"type": "object", "properties": {"x": {"type": "integer"}}},
            }
        ],
        # a dead instance is seen within about a second
        "health": {"interval_sec": 0.5, "timeout_sec": 0.3, "failures_before_unhealthy": 2},
    }


@contextlib.contextmanager
def process(cmd: list[str], env: dict[str, str]) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        proc.communicate()


async def start_agent(
    stack: contextlib.ExitStack, fabric: Secured, creds: Path, agent_id: str, description: str
) -> subprocess.Popen[str]:
    env = {**CLEAN_ENV, "PYTHONUNBUFFERED": "1", "REACH_CREDS": str(creds)}
    cmd = [sys.executable, str(HERE / "agent_process.py"), fabric.url]
    proc = stack.enter_context(process([*cmd, json.dumps(manifest(agent_id, description))], env))
    assert proc.stdout is not None
    line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 30)
    assert line.startswith("READY"), line
    return proc


async def start_console(stack: contextlib.ExitStack, fabric: Secured) -> str:
    port = free_port()
    cmd = [REACH, "console", "--port", str(port), "--servers", fabric.url,
           "--creds", str(fabric.admin)]  # fmt: skip
    proc = stack.enter_context(process(cmd, {**CLEAN_ENV, "PYTHONUNBUFFERED": "1"}))
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    async with httpx.AsyncClient(timeout=5) as http:
        while True:
            with contextlib.suppress(httpx.TransportError):
                if (await http.get(f"{base}/agents")).status_code == 200:
                    return base
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "reach console did not answer within 30s"
            await asyncio.sleep(0.2)


@contextlib.asynccontextmanager
async def traffic(client: ReachClient) -> AsyncIterator[None]:
    """Calls to echo, 20 a second, while the test looks (failures are part of it)."""

    async def loop() -> None:
        while True:
            with contextlib.suppress(Exception):
                await client.call("echo", {"x": 1}, timeout=1.0)
            await asyncio.sleep(0.05)

    task = asyncio.create_task(loop())
    try:
        yield
    finally:
        await cancel_and_wait([task])
        with contextlib.suppress(asyncio.CancelledError):
            await task  # done: raises what it failed with, if anything


async def shot(browser: Browser, name: str) -> None:
    if SHOTS:
        await browser.screenshot(HERE.parent / SHOTS / f"console-{name}.png")


async def no_script_ran(browser: Browser) -> None:
    """The hostile description is in the page as text; none of it ran or became markup."""
    assert await browser.run("return document.title") == TITLE
    shown = await browser.run(
        "return document.querySelector('tr[data-agent=\"a-1\"] .desc').textContent"
    )
    assert shown == SCRIPT
    # the console's own script is the page's only one, and no image was injected
    assert await browser.run("return document.scripts.length") == 1
    assert await browser.run("return document.images.length") == 0


async def test_the_console_in_a_browser(secured: Secured, tmp_path: Path) -> None:
    b_creds = tmp_path / "agent-b.creds"
    code, out, err = await reach_cli(
        "creds", "add", "agent-b", "--level", "2", "--agent-id", "b-1", "--cap", "echo",
        "--out", str(b_creds), "--servers", secured.url, "--creds", str(secured.admin),
    )  # fmt: skip
    assert code == 0, out + err
    with contextlib.ExitStack() as stack:
        victim = await start_agent(stack, secured, secured.agent, "a-1", SCRIPT)
        await start_agent(stack, secured, b_creds, "b-1", "Echoes its input back.")
        base = await start_console(stack, secured)
        async with (
            ReachClient(servers=secured.url, credentials=secured.watcher) as client,
            chromium() as browser,
        ):
            first = await client.call("echo", {"x": 1})
            async with traffic(client):
                await browser.get(f"{base}/agents")
                await browser.wait_for(
                    "return document.querySelectorAll('tr[data-agent]').length == 2",
                    "both agents listed",
                )
                await browser.wait_for("return document.body.dataset.updates", "a live update")
                await no_script_ran(browser)
                await asyncio.sleep(3)  # a few seconds of calls in the figures
                await shot(browser, "agents")

                # the page is not loaded again: what it holds now stays
                await browser.run("window.sameLoad = 'yes'")
                victim.send_signal(signal.SIGKILL)
                await browser.wait_for(
                    "return document.querySelector('tr[data-agent=\"a-1\"]')"
                    ".dataset.status == 'unhealthy'",
                    "the killed agent shown unhealthy",
                    within=20,
                )
                assert await browser.run("return window.sameLoad") == "yes"
                await no_script_ran(browser)  # after the live update too

                await browser.get(f"{base}/capability/echo")
                await browser.wait_for("return document.querySelector('svg.chart')", "charts")
                await asyncio.sleep(2)
                await shot(browser, "capability")

            await browser.get(f"{base}/calls")
            await browser.type("input[name=call_id]", first.call_id)
            await browser.click("form.filter button")
            link = f'a[href^="/call/{first.call_id}"]'
            await browser.wait_for(f"return document.querySelector('{link}')", "the call found")
            await shot(browser, "calls")
            await browser.click(link)
            await browser.wait_for("return document.getElementById('trace-id')", "its page")
            text = await browser.run("return document.querySelector('dl.call').textContent")
            assert first.agent_id in text
            attempts = await browser.run("return document.querySelectorAll('.attempts tr').length")
            assert attempts >= 2  # the header and the attempt
            await shot(browser, "call")

            await browser.get(f"{base}/doctor?target=echo")
            steps = await browser.run("return document.querySelectorAll('li.step').length")
            assert steps == 6
            await shot(browser, "doctor")

            await browser.get(f"{base}/alerts")
            # the kill raises an alert (instance_unhealthy) the page shows as it comes
            with contextlib.suppress(AssertionError):
                await browser.wait_for(
                    "return document.querySelector('table.alerts tr.warning, "
                    "table.alerts tr.critical')",
                    "an alert",
                    within=10,
                )
            await shot(browser, "alerts")
