"""The door every HTTP gateway stands behind (``reach.http.guard``), tried with plain HTTP
against an application that counts what reaches it: a rebound Host, an evil Origin with
the request kinds a browser sends without a preflight, a preflight, oversized bodies
(announced and streamed)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from starlette.types import Receive, Scope, Send

from reach.http.guard import Door, DoorPolicy, host_name

JSON = {"content-type": "application/json"}


class Counting:
    """An ASGI app that reads the whole body, counts the requests it saw, answers 200."""

    def __init__(self) -> None:
        self.seen = 0
        self.bytes = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        assert scope["type"] == "http"
        self.seen += 1
        more = True
        while more:
            message = await receive()
            self.bytes += len(message.get("body", b""))
            more = message.get("more_body", False)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})


def client(app: Any, host: str = "127.0.0.1:8080") -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=f"http://{host}")


async def test_a_loopback_door_refuses_a_rebound_host_and_lets_its_own_names_in() -> None:
    app = Counting()
    door = Door(app, DoorPolicy.for_address("127.0.0.1"))
    async with client(door) as http:
        for host in ("127.0.0.1:8080", "localhost:8080", "[::1]:8080", "LOCALHOST"):
            assert (await http.get("/", headers={"host": host})).status_code == 200, host
        for host in ("evil.example:8080", "127.0.0.1.evil.example", "", "127.0.0.2x"):
            answer = await http.get("/", headers={"host": host})
            assert answer.status_code == 421, host
    assert app.seen == 4


@pytest.mark.parametrize(
    ("kind", "body"),
    [
        ("text/plain", b'{"jsonrpc": "2.0"}'),
        ("application/x-www-form-urlencoded", b"a=b"),
        ("multipart/form-data; boundary=x", b"--x--"),
        ("application/json", b"{}"),
    ],
)
async def test_an_evil_origin_is_refused_whatever_the_body(kind: str, body: bytes) -> None:
    app = Counting()
    async with client(Door(app)) as http:
        for origin in ("http://evil.example", "null", "http://127.0.0.1:9999", "file://"):
            answer = await http.post(
                "/rpc", content=body, headers={"content-type": kind, "origin": origin}
            )
            assert answer.status_code == 403, (origin, answer.status_code)
    assert app.seen == 0


async def test_only_json_bodies_pass_except_at_form_paths() -> None:
    app = Counting()
    door = Door(app, DoorPolicy(form_paths=frozenset({"/oauth/token"})))
    async with client(door) as http:
        assert (await http.post("/rpc", content=b"{}", headers=JSON)).status_code == 200
        charset = {"content-type": "application/json; charset=utf-8"}
        assert (await http.post("/rpc", content=b"{}", headers=charset)).status_code == 200
        for kind in ("text/plain", "application/x-www-form-urlencoded", ""):
            answer = await http.post("/rpc", content=b"{}", headers={"content-type": kind})
            assert answer.status_code == 415, kind
        form = {"content-type": "application/x-www-form-urlencoded"}
        assert (await http.post("/oauth/token", content=b"a=b", headers=form)).status_code == 200
        assert (await http.post("/oauth/token", content=b"{}", headers=JSON)).status_code == 415
        # a DELETE without a body (an MCP session's end) needs no type
        assert (await http.delete("/rpc")).status_code == 200
    assert app.seen == 4


async def test_the_own_origin_and_allowed_ones_pass_with_cors_headers() -> None:
    app = Counting()
    door = Door(app, DoorPolicy(origins=frozenset({"https://app.example"})))
    async with client(door) as http:
        own = await http.post(
            "/rpc", content=b"{}", headers={**JSON, "origin": "http://127.0.0.1:8080"}
        )
        assert own.status_code == 200
        allowed = await http.post(
            "/rpc", content=b"{}", headers={**JSON, "origin": "https://app.example"}
        )
        assert allowed.status_code == 200
        assert allowed.headers["access-control-allow-origin"] == "https://app.example"
        assert allowed.headers["x-content-type-options"] == "nosniff"
        preflight = await http.options(
            "/rpc",
            headers={"origin": "https://app.example", "access-control-request-method": "POST"},
        )
        assert preflight.status_code == 204
        assert "authorization" in preflight.headers["access-control-allow-headers"]
        evil = await http.options(
            "/rpc",
            headers={"origin": "https://evil.example", "access-control-request-method": "POST"},
        )
        assert evil.status_code == 403
        assert "access-control-allow-origin" not in evil.headers
    assert app.seen == 2


async def test_bodies_over_the_limit_are_refused_announced_or_streamed() -> None:
    app = Counting()
    door = Door(app, DoorPolicy(max_body=1000))
    async with client(door) as http:
        assert (await http.post("/rpc", content=b"x" * 1000, headers=JSON)).status_code == 200
        assert (await http.post("/rpc", content=b"x" * 1001, headers=JSON)).status_code == 413

        async def stream() -> AsyncIterator[bytes]:
            for _ in range(100):
                yield b"x" * 100

        answer = await http.post("/rpc", content=stream(), headers=JSON)
        assert answer.status_code == 413
        bad = await http.post("/rpc", content=b"{}", headers={**JSON, "content-length": "x"})
        assert bad.status_code == 400
    # the streamed one reached the app, which read no more than the limit and some
    assert app.seen == 2
    assert app.bytes <= 1000 + 1100


def test_host_names_lose_their_port_and_case() -> None:
    assert host_name("LocalHost:80") == "localhost"
    assert host_name("[::1]:8080") == "[::1]"
    assert host_name("::1") == "::1"


def test_a_policy_refuses_what_is_not_an_origin() -> None:
    with pytest.raises(ValueError, match="not an origin"):
        DoorPolicy(origins=frozenset({"app.example"}))
    with pytest.raises(ValueError, match="max_body"):
        DoorPolicy(max_body=0)
    assert DoorPolicy.for_address("0.0.0.0").hosts is None
    assert DoorPolicy.for_address("0.0.0.0", allowed_hosts=["gw.example"]).hosts == {
        "gw.example",
        "0.0.0.0",
    }
