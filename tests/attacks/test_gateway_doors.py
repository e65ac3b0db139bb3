"""The HTTP gateways as a web page and a stranger would try them: `reach a2a` and `reach mcp
--http` started on a fabric `reach up` started, attacked with plain HTTP (httpx, no SDK).

A page the user opens can aim the browser at 127.0.0.1: with a rebound name (DNS
rebinding), with ``Content-Type: text/plain`` or a form (requests sent without a CORS
preflight), and from an evil ``Origin``. A stranger on the port has no credential, a
forged or expired token, or one minted for another resource. Each attempt is refused
and no call reaches the agent, whose handlers count what they run.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import re
import signal
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("authlib", reason="the gateways extra: pip install '.[gateways]'")

import httpx
import jwt
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from reach.agent.agent import Agent
from reach.security.credentials import CredentialsFile, CredentialStore
from reach.security.membership import connect_as

from ..cli_helpers import CLEAN_ENV, REACH
from ..up_helpers import Secured, secured

__all__ = ["secured"]

HEALTH = {"interval_sec": 0.5, "timeout_sec": 0.3, "failures_before_unhealthy": 2}
READY = 60.0


async def _creds(
    fabric: Secured, client_id: str, level: int, *roles: str, agent_id: str | None = None
) -> Path:
    conn, _ = await connect_as([fabric.url], name="gateway-test", credentials=fabric.admin)
    try:
        store = await CredentialStore.open(conn)
        record, secret = await store.add(client_id, level, roles=list(roles), agent_id=agent_id)
    finally:
        await conn.close()
    out = fabric.admin.parent.parent / f"{client_id}.creds"
    CredentialsFile(fabric.url, record.client_id, secret).write(out)
    return out


@contextlib.asynccontextmanager
async def _counting_agent(fabric: Secured) -> AsyncIterator[dict[str, int]]:
    """vault-1: `lookup` at level 2 and `export_all` at level 4; what each handler ran."""
    runs = {"lookup": 0, "export_all": 0}
    agent = Agent(
        {
            "agent_id": "vault-1",
            "agent_name": "vault",
            "version": "1.0.0",
            "health": HEALTH,
            "capabilities": [
                {"name": "lookup", "security_level": 2},
                {"name": "export_all", "security_level": 4},
            ],
        },
        servers=fabric.url,
        credentials=fabric.admin,
    )

    @agent.capability("lookup")
    async def lookup(req: Any) -> dict[str, str]:
        runs["lookup"] += 1
        return {"found": "yes"}

    @agent.capability("export_all")
    async def export_all(req: Any) -> dict[str, str]:
        runs["export_all"] += 1
        return {"contacts": "every customer"}

    async with agent:
        yield runs


@contextlib.asynccontextmanager
async def _gateway(command: list[str], creds: Path, fabric: Secured) -> AsyncIterator[str]:
    """A gateway process on a free loopback port; its base URL."""
    proc = subprocess.Popen(  # noqa: ASYNC220 - fork+exec, returns at once
        [REACH, *command, "--servers", fabric.url, "--creds", str(creds)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**CLEAN_ENV, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + READY
        seen = b""
        while time.monotonic() < deadline:
            line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), READY)
            seen += line
            found = re.search(rb"(http://127\.0\.0\.1:\d+)", line)
            if found:
                yield found.group(1).decode()
                break
            assert line, seen.decode()
        else:
            raise AssertionError(seen.decode())
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.to_thread(proc.wait), 20)
        except TimeoutError:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


async def _token(http: httpx.AsyncClient, creds: Path, resource: str | None = None) -> str:
    data = CredentialsFile.read(creds)
    form = {"grant_type": "client_credentials"}
    if resource is not None:
        form["resource"] = resource
    answer = await http.post("/oauth/token", data=form, auth=(data.client_id, data.secret))
    assert answer.status_code == 200, answer.text
    token = answer.json()
    assert token["token_type"] == "Bearer"
    return str(token["access_token"])


def _send(skill: str) -> dict[str, Any]:
    return {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "message/send",
        "params": {
            "message": {
                "role": "user",
                "messageId": "m-1",
                "parts": [{"kind": "data", "data": {"q": 1}}],
                "metadata": {"skill": skill},
            }
        },
    }


async def test_a2a_refuses_browser_tricks_and_strangers_and_runs_calls_as_their_caller(
    secured: Secured,
) -> None:
    gateway_creds = await _creds(secured, "gw", 4, "gateway")
    caller_creds = await _creds(secured, "alice", 2)
    async with (
        _counting_agent(secured) as runs,
        _gateway(["a2a", "--port", "0"], gateway_creds, secured) as base,
        httpx.AsyncClient(base_url=base, timeout=20) as http,
    ):
        rpc = "/agents/vault"
        body = json.dumps(_send("export_all"))
        json_type = {"content-type": "application/json"}
        # no credential at all: 401, naming where the login is described
        bare = await http.post(rpc, content=body, headers=json_type)
        assert bare.status_code == 401
        assert "resource_metadata=" in bare.headers["www-authenticate"]
        metadata = (await http.get("/.well-known/oauth-protected-resource")).json()
        assert metadata["resource"] == base
        server = (await http.get("/.well-known/oauth-authorization-server")).json()
        assert server["token_endpoint"] == base + "/oauth/token"
        assert server["grant_types_supported"] == ["client_credentials"]
        # a rebound name (the page then reads the answer as its own)
        rebound = await http.post(
            rpc, content=body, headers={**json_type, "host": "evil.example:80"}
        )
        assert rebound.status_code == 421
        # simple requests a browser sends without a preflight, from an evil origin
        evil = {"origin": "http://evil.example"}
        for kind, content in (
            ("text/plain", body),
            ("application/x-www-form-urlencoded", "a=" + body),
            ("multipart/form-data; boundary=x", "--x--"),
        ):
            answer = await http.post(rpc, content=content, headers={**evil, "content-type": kind})
            assert answer.status_code == 403, (kind, answer.status_code)
        # the same without an Origin (not a browser): the type alone is refused
        plain = await http.post(rpc, content=body, headers={"content-type": "text/plain"})
        assert plain.status_code in (401, 415)
        # a preflight from an evil origin is refused and allows nothing
        preflight = await http.options(
            rpc, headers={**evil, "access-control-request-method": "POST"}
        )
        assert preflight.status_code == 403
        assert "access-control-allow-origin" not in preflight.headers
        # a body over the limit, announced or not
        huge = b"x" * (2 * 1024 * 1024)
        assert (await http.post(rpc, content=huge, headers=json_type)).status_code == 413

        async def chunks() -> AsyncIterator[bytes]:
            for _ in range(40):
                yield b" " * 65536

        streamed = await http.post(rpc, content=chunks(), headers=json_type)
        assert streamed.status_code in (401, 413)
        # tokens: wrong credential, forged, expired, another resource's
        wrong = await http.post(
            "/oauth/token", data={"grant_type": "client_credentials"}, auth=("alice", "nope")
        )
        assert wrong.status_code == 401
        assert wrong.json()["error"] == "invalid_client"
        token = await _token(http, caller_creds)
        claims = jwt.decode(token, options={"verify_signature": False})
        forged_key = Ed25519PrivateKey.generate()
        forged = jwt.encode({**claims, "lvl": 4}, forged_key, algorithm="EdDSA",
                            headers={"typ": "at+jwt"})  # fmt: skip
        parts = token.split(".")
        raised = (
            base64.urlsafe_b64encode(json.dumps({**claims, "lvl": 4}).encode())
            .rstrip(b"=")
            .decode()
        )
        tampered = ".".join([parts[0], raised, parts[2]])
        other_resource = await http.post(
            "/oauth/token",
            data={"grant_type": "client_credentials", "resource": "http://elsewhere.example/"},
            auth=(claims["client_id"], CredentialsFile.read(caller_creds).secret),
        )
        assert other_resource.status_code == 400
        for bad in (forged, tampered, "not-a-token"):
            answer = await http.post(
                rpc, content=body, headers={**json_type, "authorization": f"Bearer {bad}"}
            )
            assert answer.status_code == 401, bad
            assert 'error="invalid_token"' in answer.headers["www-authenticate"]
        assert runs == {"lookup": 0, "export_all": 0}

        # alice (level 2) logged in: her level-2 call runs, the level-4 one is refused
        bearer = {**json_type, "authorization": f"Bearer {token}"}
        ok = (await http.post(rpc, content=json.dumps(_send("lookup")), headers=bearer)).json()
        assert ok["result"]["status"]["state"] in ("completed", "TASK_STATE_COMPLETED"), ok
        denied = (await http.post(rpc, content=body, headers=bearer)).json()
        text = json.dumps(denied)
        assert "authorization" in text, text
        assert runs == {"lookup": 1, "export_all": 0}

        # a flood of logins from one address is slowed at the gateway, before the fabric's
        # issuer (whose rate it would spend for every caller of this gateway)
        flood = [
            await http.post(
                "/oauth/token", data={"grant_type": "client_credentials"}, auth=("x", "y")
            )
            for _ in range(30)
        ]
        assert {a.status_code for a in flood} == {401, 429}
        assert flood[-1].json()["error"] == "slow_down"
        # calls of a caller already logged in go on
        again = await http.post(rpc, content=json.dumps(_send("lookup")), headers=bearer)
        assert again.status_code == 200


async def test_a_gateway_credential_without_the_gateway_role_does_not_start(
    secured: Secured,
) -> None:
    proc = await asyncio.create_subprocess_exec(
        REACH, "a2a", "--port", "0", "--servers", secured.url, "--creds", str(secured.watcher),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=CLEAN_ENV,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), READY)
    assert proc.returncode == 2, (out + err).decode()
    assert b"lacks the 'gateway' role" in err


async def test_no_login_is_refused_beyond_loopback(secured: Secured) -> None:
    gateway_creds = await _creds(secured, "gw", 4, "gateway")
    for command in (["a2a", "--port", "0"], ["mcp", "--http", "0"]):
        proc = await asyncio.create_subprocess_exec(
            REACH, *command, "--host", "0.0.0.0", "--no-login",
            "--servers", secured.url, "--creds", str(gateway_creds),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=CLEAN_ENV,
        )  # fmt: skip
        out, err = await asyncio.wait_for(proc.communicate(), READY)
        assert proc.returncode == 2, (command, (out + err).decode())
        assert b"must log its callers in" in err


async def test_mcp_over_http_shows_and_runs_only_what_the_caller_may(secured: Secured) -> None:
    gateway_creds = await _creds(secured, "gw", 4, "gateway")
    caller_creds = await _creds(secured, "bob", 2)
    async with (
        _counting_agent(secured) as runs,
        _gateway(["mcp", "--http", "0"], gateway_creds, secured) as base,
        httpx.AsyncClient(base_url=base, timeout=20) as http,
    ):
        init = {
            "jsonrpc": "2.0", "id": 1, "method": "initialize",
            "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                       "clientInfo": {"name": "attacker", "version": "0"}},
        }  # fmt: skip
        headers = {
            "content-type": "application/json",
            "accept": "application/json, text/event-stream",
        }
        bare = await http.post("/mcp", json=init, headers=headers)
        assert bare.status_code == 401
        assert "/.well-known/oauth-protected-resource/mcp" in bare.headers["www-authenticate"]
        rebound = await http.post("/mcp", json=init, headers={**headers, "host": "evil.example"})
        assert rebound.status_code == 421
        evil = await http.post(
            "/mcp",
            content=json.dumps(init),
            headers={"content-type": "text/plain", "origin": "http://evil.example"},
        )
        assert evil.status_code == 403
        token = await _token(http, caller_creds, resource=base + "/mcp")
        assert (await http.post("/mcp", json=init, headers={
            **headers, "authorization": "Bearer " + token + "x"})).status_code == 401  # fmt: skip
        assert runs == {"lookup": 0, "export_all": 0}
