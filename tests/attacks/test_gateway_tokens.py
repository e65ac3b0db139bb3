"""A gateway's access tokens tried as a stranger would: one that has expired, one minted
for another resource of the same gateway, one whose login was replaced, one the gateway
never signed. The login runs in-process on a manual clock, against a fabric `reach up`
started (the callers log in with the fabric's issuer, for real); requests are plain HTTP.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

pytest.importorskip("authlib", reason="the gateways extra: pip install '.[gateways]'")

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from reach.caller.client import ReachClient
from reach.clock import ManualClock
from reach.http.oauth import ACCESS_TTL_SEC, Caller, GatewayLogin, RequireLogin
from reach.security.credentials import CredentialsFile, CredentialStore
from reach.security.membership import connect_as

from ..up_helpers import Secured, secured

__all__ = ["secured"]


async def _whoami(request: Request) -> JSONResponse:
    user = request.scope.get("user")
    assert isinstance(user, Caller)
    return JSONResponse({"caller": user.client_id, "level": user.level})


@pytest.fixture
async def login(secured: Secured) -> AsyncIterator[tuple[GatewayLogin, ManualClock]]:
    conn, _ = await connect_as([secured.url], name="tokens-test", credentials=secured.admin)
    try:
        store = await CredentialStore.open(conn)
        record, secret = await store.add("gw-t", 3, roles=["gateway"])
        gateway = secured.admin.parent.parent / "gw-t.creds"
        CredentialsFile(secured.url, record.client_id, secret).write(gateway)
    finally:
        await conn.close()
    clock = ManualClock()
    async with ReachClient(servers=secured.url, credentials=gateway, name="gw-t") as client:
        assert client.token_session is not None
        made = GatewayLogin(
            client.connection, client.token_session, resource_path="/api", clock=clock
        )
        try:
            yield made, clock
        finally:
            await made.close()


def _app(login: GatewayLogin) -> RequireLogin:
    app = Starlette(routes=[Route("/api", _whoami), *login.routes()])
    return RequireLogin(app, login, open_paths=lambda path: path != "/api")


async def _token(http: httpx.AsyncClient, creds: CredentialsFile) -> str:
    answer = await http.post(
        "/oauth/token",
        data={"grant_type": "client_credentials"},
        auth=(creds.client_id, creds.secret),
    )
    assert answer.status_code == 200, answer.text
    return str(answer.json()["access_token"])


async def test_expired_foreign_and_replaced_tokens_are_refused(
    secured: Secured, login: tuple[GatewayLogin, ManualClock]
) -> None:
    gateway, clock = login
    watcher = CredentialsFile.read(secured.watcher)
    transport = httpx.ASGITransport(app=_app(gateway))
    async with (
        httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8080") as here,
        httpx.AsyncClient(transport=transport, base_url="http://localhost:8080") as there,
    ):
        token = await _token(here, watcher)
        bearer = {"authorization": f"Bearer {token}"}
        # the watcher holds level 2, the gateway 3: the lower counts
        assert (await here.get("/api", headers=bearer)).json() == {"caller": "watcher", "level": 2}

        # minted for http://127.0.0.1:8080/api, shown to http://localhost:8080/api
        foreign = await there.get("/api", headers=bearer)
        assert foreign.status_code == 401
        assert 'error="invalid_token"' in foreign.headers["www-authenticate"]

        # a second login of the same client: the first token still names a live login
        second = await _token(here, watcher)
        assert (await here.get("/api", headers=bearer)).status_code == 200
        assert (await here.get("/api", headers={"authorization": f"Bearer {second}"})).is_success

        # past its life (and the leeway), every token is refused, remembered or not
        clock.advance(ACCESS_TTL_SEC + 10)
        for old in (token, second):
            late = await here.get("/api", headers={"authorization": f"Bearer {old}"})
            assert late.status_code == 401
            assert "expired" in late.headers["www-authenticate"]
        # a fresh login works again
        fresh = await _token(here, watcher)
        assert (await here.get("/api", headers={"authorization": f"Bearer {fresh}"})).is_success
