"""A headless Chromium for tests, driven over the W3C WebDriver protocol.

Debian's chromium and chromedriver (``make browser`` installs them); the protocol is a
few JSON requests, sent here with httpx, so nothing is downloaded at test time (no
driver manager, no browser download). ``browser_missing()`` says why the browser tests
cannot run where they cannot.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx

from reach.fabric.embedded import free_port

from .poll_helpers import until

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
#: what a closed network needs: no calls home, no sandbox (containers run as root)
FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-dev-shm-usage", "--window-size=1400,900",
)  # fmt: skip
ELEMENT = "element-6066-11e4-a52e-4f735466cecf"


def browser_missing() -> str | None:
    """Why no browser test can run here (None: they can)."""
    for path in (CHROMIUM, CHROMEDRIVER):
        if not path.exists():
            return f"{path} is not installed (`make browser` installs chromium and chromedriver)"
    return None


class Browser:
    """One WebDriver session."""

    def __init__(self, http: httpx.AsyncClient, session: str) -> None:
        self.http = http
        self.session = session

    async def _send(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        reply = await self.http.request(method, f"/session/{self.session}{path}", json=body)
        value = reply.json().get("value")
        if reply.status_code != 200:
            raise AssertionError(f"WebDriver {method} {path}: {value}")
        return value

    async def get(self, url: str) -> None:
        await self._send("POST", "/url", {"url": url})

    async def run(self, script: str, *args: Any) -> Any:
        """The value of ``script`` (a function body) run in the page."""
        return await self._send("POST", "/execute/sync", {"script": script, "args": list(args)})

    async def element(self, css: str) -> str:
        found = await self._send("POST", "/element", {"using": "css selector", "value": css})
        return str(found[ELEMENT])

    async def type(self, css: str, text: str) -> None:
        await self._send("POST", f"/element/{await self.element(css)}/value", {"text": text})

    async def click(self, css: str) -> None:
        await self._send("POST", f"/element/{await self.element(css)}/click", {})

    async def wait_for(self, script: str, what: str, within: float = 15.0) -> Any:
        """The first truthy value of ``script``, polled until ``within`` seconds."""
        return await until(lambda: self.run(script), what, timeout=within, interval=0.2)

    async def screenshot(self, path: Path) -> None:
        # the whole page, not the window: the page's own height (measured in a short
        # window, which the page then overflows)
        await self._send("POST", "/window/rect", {"width": 1400, "height": 400})
        height = await self.run("return document.body.scrollHeight")
        await self._send("POST", "/window/rect", {"width": 1400, "height": min(height + 140, 4000)})
        png = base64.b64decode(await self._send("GET", "/screenshot"))
        await asyncio.to_thread(_write, path, png)


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


@contextlib.asynccontextmanager
async def chromium() -> AsyncIterator[Browser]:
    """A headless Chromium with a profile of its own, closed (and its driver) after."""
    port = free_port()
    profile = tempfile.mkdtemp(prefix="reach-chromium-")
    driver = subprocess.Popen(  # noqa: ASYNC220 - fork+exec, returns at once
        [str(CHROMEDRIVER), f"--port={port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:

            async def ready() -> bool:
                with contextlib.suppress(httpx.TransportError):
                    return bool((await http.get("/status")).json()["value"]["ready"])
                return False

            await until(ready, "chromedriver started", timeout=20, interval=0.1)
            options = {"binary": str(CHROMIUM), "args": [*FLAGS, f"--user-data-dir={profile}"]}
            caps = {"alwaysMatch": {"browserName": "chrome", "goog:chromeOptions": options}}
            reply = await http.post("/session", json={"capabilities": caps})
            value = reply.json()["value"]
            assert reply.status_code == 200, value
            browser = Browser(http, value["sessionId"])
            try:
                yield browser
            finally:
                with contextlib.suppress(httpx.HTTPError):
                    await http.delete(f"/session/{browser.session}")
    finally:
        driver.terminate()
        try:
            driver.wait(10)
        except subprocess.TimeoutExpired:
            driver.kill()
            driver.wait()
        shutil.rmtree(profile, ignore_errors=True)
