"""Attacks a fabric already refused, kept as tests so that it goes on refusing them:
forged tokens of every kind, logins without or with a wrong secret, subscriptions to what
is not the attacker's, announces in another agent's name, and payloads meant to crash.

Each against a `reach up` fabric, from plain nats-py, with a real echo agent to attack.
"""

from __future__ import annotations

import base64
import json
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

import jwt
import msgpack
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from reach.agent.agent import Agent
from reach.wire import subjects

from ..calls_helpers import Behaviour
from .conftest import (
    Refusals,
    UpFabric,
    ask,
    attacker,
    code_of,
    fabric_state,
    fabric_token,
    login_for_calls,
    raw_login,
    request_bytes,
)

INSTANCE = subjects.capability_instance("vault", "vault-1")


@pytest.fixture
async def vault(up_fabric: UpFabric) -> AsyncIterator[tuple[Agent, Behaviour]]:
    agent, served, _ = await up_fabric.add_agent("vault-1", "vault", level=3)
    async with agent:
        yield agent, served


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def forgeries(real: str) -> dict[str, str]:
    """Tokens an attacker makes from a real level-1 call token of the vault."""
    header = jwt.get_unverified_header(real)
    claims = jwt.decode(real, options={"verify_signature": False})
    head, body, sig = real.split(".")
    raised = {**claims, "lvl": 4}
    stranger = Ed25519PrivateKey.generate()
    return {
        "alg none": ".".join(
            [_b64(json.dumps({"alg": "none", "typ": "JWT"}).encode()), body, ""]
        ),
        "level raised, signature kept": ".".join(
            [head, _b64(json.dumps(raised).encode()), sig]
        ),
        "HS256 keyed with the kid": jwt.encode(
            raised, (header["kid"] * 8)[:64], algorithm="HS256", headers={"kid": header["kid"]}
        ),
        "signed by a key of its own, known kid": jwt.encode(
            raised, stranger, algorithm="EdDSA", headers={"kid": header["kid"]}
        ),
        "signed by a key of its own, new kid": jwt.encode(
            raised, stranger, algorithm="EdDSA", headers={"kid": "attacker"}
        ),
        "expired": jwt.encode(
            {**claims, "exp": int(time.time()) - 3600}, stranger, algorithm="EdDSA",
            headers={"kid": header["kid"]},
        ),
        "garbage": "not.a.token",
        "huge": "a" * 100_000,
    }  # fmt: skip


async def test_forged_tokens_of_every_kind_are_refused_before_the_handler_runs(
    up_fabric: UpFabric, vault: tuple[Agent, Behaviour]
) -> None:
    _, served = vault
    _, creds = await up_fabric.add_client(level=1)
    nc, real = await login_for_calls(up_fabric, creds, "vault", "vault-1")
    try:
        token = await fabric_token(nc, *up_fabric.secret_of(creds))
        # its own token, honestly: below the vault's level
        reply = await ask(nc, INSTANCE, request_bytes({}, real))
        assert code_of(reply) == "insufficient_level:3:1", reply
        before = served.calls
        for name, forged in forgeries(real).items():
            reply = await ask(nc, INSTANCE, request_bytes({}, forged))
            assert reply["err"]["kind"] in ("denied", "contract"), (name, reply)
            assert code_of(reply) in ("authentication_failed", "bad_envelope"), (name, reply)
        # its fabric token (audience reach) is no call token either
        reply = await ask(nc, INSTANCE, request_bytes({}, token))
        assert code_of(reply) == "authentication_failed", reply
        reply = await ask(nc, INSTANCE, request_bytes({}))
        assert code_of(reply) == "no_token", reply
    finally:
        await nc.close()
    assert served.calls == before


async def test_logins_without_a_valid_secret_are_refused(up_fabric: UpFabric) -> None:
    client_id, _ = await up_fabric.add_client(level=1)
    port = int(up_fabric.url.rsplit(":", 1)[1])
    for user, password in (("", ""), (client_id, "wrong"), ("nobody", "x"), ("a.b", "x")):
        assert b"Authorization Violation" in await raw_login(port, user, password)


async def test_subscriptions_to_what_is_not_its_own_are_refused(
    up_fabric: UpFabric, refusals: Refusals
) -> None:
    other_id, _ = await up_fabric.add_client(level=1)
    _, creds = await up_fabric.add_client(agent_id="eve-1", caps=("weather",), level=1)
    nc = await attacker(up_fabric, creds, error_cb=refusals.on_error)
    try:
        for subject in (
            ">",
            "_INBOX.>",
            f"_INBOX.{other_id}.>",
            "$JS.API.>",
            "$KV.REACH_CREDENTIALS.>",
            "$KV.>",
            "$SYS.>",
            "reach.v1.audit.>",
            "reach.v1.auth.token",
            INSTANCE,
            subjects.probe("vault-1"),
            subjects.ANNOUNCE_ALL,
        ):
            await nc.subscribe(subject)
            await refusals.wait_for(subject)
    finally:
        await nc.close()


async def test_an_agent_cannot_speak_for_another(
    up_fabric: UpFabric, refusals: Refusals, vault: tuple[Agent, Behaviour]
) -> None:
    before = await fabric_state(up_fabric)
    # of the vault's level: `reach creds add` makes no credential for a capability served
    # above its level
    client_id, creds = await up_fabric.add_client(agent_id="eve-2", caps=("vault",), level=3)
    _, secret = up_fabric.secret_of(creds)
    nc = await attacker(up_fabric, creds, error_cb=refusals.on_error)
    try:
        token = await fabric_token(nc, client_id, secret)
        for subject in (
            subjects.announce("vault-1"),
            subjects.heartbeat("vault-1"),
            subjects.bye("vault-1"),
        ):
            await nc.publish(subject, request_bytes({"agent_id": "vault-1"}, token))
            await refusals.wait_for(subject)
        # its own subject, another's manifest: the registrar refuses the mismatch
        manifest = {
            "instance_id": secrets.token_hex(8),
            "started_at": time.time(),
            "manifest": {
                "agent_id": "vault-1",
                "agent_name": "v",
                "version": "1.0.0",
                # what its credential may serve: only the other agent's id is wrong
                "capabilities": [{"name": "vault", "security_level": 3}],
            },
        }
        reply = await ask(nc, subjects.announce("eve-2"), request_bytes(manifest, token))
        answer = msgpack.unpackb(reply["b"])
        assert answer["accepted"] is False, answer
        assert "vault-1" in answer["reason"]
    finally:
        await nc.close()
    state = await fabric_state(up_fabric)
    state["REACH_CREDENTIALS"].pop(f"client.{client_id}")  # the attacker's own credential
    assert state == before


def _nested(depth: int) -> bytes:
    data = b"\x91" * depth + b"\xc0"  # fixarray of one, nested, ending in nil
    return data


async def test_payload_bombs_get_typed_errors_and_the_agent_and_registrar_keep_serving(
    up_fabric: UpFabric, vault: tuple[Agent, Behaviour]
) -> None:
    _, creds = await up_fabric.add_client(level=4)
    nc, real = await login_for_calls(up_fabric, creds, "vault", "vault-1")
    try:
        bombs: dict[str, bytes] = {
            "not msgpack": b"\xc1\xc1\xc1",
            "an envelope that is a string": msgpack.packb("x" * 1000),
            "a body nested 10,000 deep": request_bytes(_nested(10_000), real),
            "an envelope nested 10,000 deep": _nested(10_000),
            "a map claiming 2^32 entries": b"\xdf\xff\xff\xff\xff",
            "a body of 200,000 elements": request_bytes([0] * 200_000, real),
            "wrong types in the envelope": msgpack.packb({"v": "1", "id": 5, "b": "x"}),
            "protocol version 2": msgpack.packb({"v": 2, "id": "x", "b": b""}),
        }
        for name, data in bombs.items():
            reply = await ask(nc, INSTANCE, data)
            assert reply.get("ok") is False, (name, reply)
            assert reply["err"]["kind"] in ("contract", "denied"), (name, reply)
        for data in bombs.values():  # the issuer answers anyone
            reply = await ask(nc, subjects.TOKEN, data)
            assert reply.get("ok") is False
        _bomber_id, bomber = await up_fabric.add_client(agent_id="bomb-1", caps=("vault",), level=3)
        agent_nc = await attacker(up_fabric, bomber)
        try:
            for data in bombs.values():  # the registrar answers agents
                reply = await ask(agent_nc, subjects.announce("bomb-1"), data)
                assert reply.get("ok") is False
        finally:
            await agent_nc.close()
        # both still serve
        served: Any = await ask(nc, INSTANCE, request_bytes({}, real))
        assert served.get("ok"), served
        ping = await nc.request(subjects.REGISTRAR_PING, b"", timeout=5)
        assert ping.data
    finally:
        await nc.close()
