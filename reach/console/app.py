"""The console's web application: pages, the live feed and the static files.

Pages are rendered on the server (``reach.console.pages``); a live part of a page (the
agents table, a capability's instances and charts, the alerts) is sent again over
server-sent events (``/live/<page>``) whenever it changes: at the next ``interval`` after
the registry, a breaker or the alerts changed, its call figures every ``refresh``. The
page's one script (``static/console.js``, an EventSource) puts it in place. Nothing the
console serves changes the fabric: every route is a GET that reads.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from importlib.resources import files

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from reach.audit.alerts import RULES
from reach.console.auth import guarded
from reach.console.pages import LIVE_PAGES, Pages
from reach.console.search import KINDS, CallQuery, search
from reach.console.state import FabricView
from reach.errors import ConfigurationError, ReachError
from reach.fabric.doctor import diagnose
from reach.tasks import wait_set
from reach.wire.models import Instance

__all__ = ["MAX_FEEDS", "REFRESH_SEC", "Console"]

#: live feeds open at once at most (each one renders its page part every interval)
MAX_FEEDS = 64
#: a comment is sent on a quiet feed this often, so that proxies keep it open
KEEPALIVE_SEC = 15.0
#: a live part is rendered again at least this often (its call figures: the width of a
#: bucket), and at the next interval after the registry, a breaker or the alerts changed
REFRESH_SEC = 5.0
#: a live part is rendered again no sooner than this many times its last rendering took
RENDER_PACE = 20.0
#: how far back the doctor page reads the audit stream
DOCTOR_WINDOW_SEC = 600.0


def _params(request: Request) -> dict[str, str]:
    return {k: v[:200] for k, v in request.query_params.items()}


class Console:
    """The application over one ``FabricView``; ``asgi`` is what a server runs."""

    def __init__(
        self,
        view: FabricView,
        *,
        interval: float = 1.0,
        refresh: float = REFRESH_SEC,
        password: str | None = None,
        loopback_only: bool = True,
    ) -> None:
        self.view = view
        self.pages = Pages(view)
        self.interval = interval
        self.feeds = 0
        self.closing = asyncio.Event()
        self.refresh = refresh
        #: (page, params) → (when, ``FabricView.version`` then, html, seconds it took)
        self._rendered: dict[
            tuple[str, tuple[tuple[str, str], ...]], tuple[float, tuple[int, ...], str, float]
        ] = {}
        static = files("reach.console").joinpath("static")
        app = Starlette(
            routes=[
                Route("/", lambda _: RedirectResponse("/agents", status_code=303)),
                Route("/agents", self.agents),
                Route("/capability/{name}", self.capability),
                Route("/calls", self.calls),
                Route("/call/{call_id}", self.call),
                Route("/alerts", self.alerts),
                Route("/doctor", self.doctor),
                Route("/live/{page}", self.live),
                Mount("/static", StaticFiles(directory=str(static)), name="static"),
            ]
        )
        self.asgi = guarded(app, password=password, loopback_only=loopback_only)

    def _page(self, template: str, status: int = 200, **context: object) -> HTMLResponse:
        return HTMLResponse(self.pages.render(template, **context), status_code=status)

    def _error(self, section: str, exc: Exception, status: int) -> HTMLResponse:
        return self._page("error.html", status, section=section, message=str(exc))

    async def agents(self, request: Request) -> Response:
        params = _params(request)
        return self._page(
            "agents.html",
            section="agents",
            capability=params.get("capability", ""),
            tag=params.get("tag", ""),
            capabilities=sorted({c for i in self.view.instances() for c in _names(i)}),
            table=self.pages.agents_fragment(params),
        )

    async def capability(self, request: Request) -> Response:
        name = request.path_params["name"][:200]
        return self._page(
            "capability.html",
            section="agents",
            name=name,
            live=self.pages.capability_fragment({"name": name}),
            contracts=self.pages.contracts(name),
        )

    async def calls(self, request: Request) -> Response:
        params = _params(request)
        try:
            query = CallQuery.parse(params)
            result = await search(self.view.conn, query) if params else None
        except ConfigurationError as exc:
            return self._error("calls", exc, 400)
        except ReachError as exc:
            return self._error("calls", exc, 503)
        return self._page("calls.html", section="calls", query=query, result=result, kinds=KINDS)

    async def call(self, request: Request) -> Response:
        call_id = request.path_params["call_id"][:200]
        since = request.query_params.get("since", "24h")[:200]
        try:
            result = await search(self.view.conn, CallQuery(call_id=call_id, since=since))
        except ConfigurationError as exc:
            return self._error("calls", exc, 400)
        except ReachError as exc:
            return self._error("calls", exc, 503)
        found = result.calls[-1] if result.calls else None
        return self._page(
            "call.html", 200 if found else 404,
            section="calls", call_id=call_id, since=since, call=found,
        )  # fmt: skip

    async def alerts(self, request: Request) -> Response:
        params = _params(request)
        return self._page(
            "alerts.html",
            section="alerts",
            rule=params.get("rule", ""),
            rules=RULES,
            listing=self.pages.alerts_fragment(params),
        )

    async def doctor(self, request: Request) -> Response:
        target = request.query_params.get("target", "").strip()[:200]
        diagnosis = None
        if target:
            try:
                diagnosis = await diagnose(self.view.conn, target, window_sec=DOCTOR_WINDOW_SEC)
            except ReachError as exc:
                return self._error("doctor", exc, 503)
        return self._page("doctor.html", section="doctor", target=target, diagnosis=diagnosis)

    def _fragment(self, page: str, params: dict[str, str]) -> tuple[str, float]:
        """The live part of ``page``, and how long its rendering took: rendered again when
        the registry, a breaker or the alerts changed (``FabricView.version``), else once
        per ``refresh`` (the call figures), whatever the number of feeds showing it."""
        key = (page, tuple(sorted(params.items())))
        now = time.monotonic()
        version = self.view.version()
        cached = self._rendered.get(key)
        if cached is not None:
            at, seen, html, cost = cached
            if seen == version and now - at < self.refresh:
                return html, cost
        started = time.perf_counter()
        html = self.pages.fragment(page, params) or ""
        cost = time.perf_counter() - started
        if len(self._rendered) > 4 * MAX_FEEDS:
            self._rendered.clear()
        self._rendered[key] = (now, version, html, cost)
        return html, cost

    async def live(self, request: Request) -> Response:
        page = request.path_params["page"]
        params = _params(request)
        if page not in LIVE_PAGES:
            return Response(f"no live view {page!r}", status_code=404, media_type="text/plain")
        if self.feeds >= MAX_FEEDS:
            return Response("too many live views open", status_code=503, media_type="text/plain")
        return StreamingResponse(
            self._feed(page, params),
            media_type="text/event-stream",
            headers={"x-accel-buffering": "no"},
        )

    async def _feed(self, page: str, params: dict[str, str]) -> AsyncIterator[str]:
        """The page part as an ``update`` event now and whenever it changes, and a
        ``fabric`` event (``down``, then ``up``) whenever the console's connection to the
        fabric goes or comes back (a page takes it as up until told); ends when the
        console closes (or the browser goes: the server then stops the stream)."""
        self.feeds += 1
        try:
            last: str | None = None
            fabric = True  # as a page takes it until told otherwise
            quiet = 0.0
            while not self.closing.is_set():
                # whether the figures are current: the page stays, the fabric may not
                up = self.view.conn.is_connected
                if up != fabric:
                    fabric = up
                    yield f"event: fabric\ndata: {'up' if up else 'down'}\n\n"
                html, cost = self._fragment(page, params)
                if html != last:
                    last, quiet = html, 0.0
                    yield (
                        "event: update\n"
                        + "".join(f"data: {line}\n" for line in html.splitlines())
                        + "\n"
                    )
                elif quiet >= KEEPALIVE_SEC:
                    quiet = 0.0
                    yield ": keep-alive\n\n"
                # a part that takes long to render is sent less often, so that rendering
                # stays a small share of the console's time
                pause = max(self.interval, cost * RENDER_PACE)
                await wait_set(self.closing, pause)
                quiet += pause
        finally:
            self.feeds -= 1


def _names(inst: Instance) -> list[str]:
    return [c.name for c in inst.manifest.capabilities]
