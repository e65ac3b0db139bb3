"""Checks any agent implementation can be run against, made over the wire as an
attacker or a careless caller would (nats-py and PyJWT, no ``reach`` call path): the
library's own agent, the raw nats-py one and the Node.js example each pass them all.

On a secured fabric (protocol section 9.6) an agent must refuse a call without a token,
with a forged token, or with a token for another audience; refuse a request it already
served, byte for byte (a replayed ``(id, at)``); answer a repeated call id from memory
only once the repeat's own token is checked, and only to the client that made the call;
and honour ``au`` (a caller that records its calls itself: the agent records nothing,
and its reply does not say ``aud``).
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from nats.aio.client import Client

from ..attacks.conftest import UpFabric
from ..poll_helpers import until
from .agents import NO_NODE, node_agent, node_modules, raw_agent, reach_agent
from .conftest import audit_events
from .wire import Creds, WireError, ask, body_of, call_token, connect, fabric_token, request, unpack

#: an end-to-end run of whole programs: `make test-long` (CI runs it after `make test`)
pytestmark = pytest.mark.long

Starter = Callable[[UpFabric, str, str], contextlib.AbstractAsyncContextManager[str]]
AGENTS: dict[str, Starter] = {"reach": reach_agent, "raw": raw_agent, "node": node_agent}


@dataclass(frozen=True)
class Served:
    """The agent under test: its id and the capability it serves (adds a and b)."""

    agent_id: str
    capability: str

    @property
    def subject(self) -> str:
        return f"reach.v1.cap.{self.capability}.{self.agent_id}"


@pytest.fixture(params=list(AGENTS))
async def served(request: pytest.FixtureRequest, up: UpFabric) -> AsyncIterator[Served]:
    kind: str = request.param
    if kind == "node":
        if NO_NODE is not None:
            pytest.skip(NO_NODE)
        node_modules()
    capability = f"chk_{kind}_{secrets.token_hex(3)}"
    async with AGENTS[kind](up, f"{kind}-{capability[-6:]}", capability) as agent_id:
        yield Served(agent_id, capability)


class Caller:
    """A caller on the wire: logged in with its own credential, holding its fabric token."""

    def __init__(self, creds: Creds, nc: Client, fabric: str) -> None:
        self.creds, self.nc, self.fabric = creds, nc, fabric

    async def token(self, served: Served, *, instance: bool = True) -> str:
        """A genuine call token for the agent's instance (or its capability's queue)."""
        answer = await call_token(
            self.nc,
            self.creds,
            self.fabric,
            served.capability,
            served.agent_id if instance else None,
        )
        return str(answer["token"])

    async def send(self, subject: str, data: bytes) -> bytes:
        """The reply to ``data`` sent on ``subject``."""
        return await ask(self.nc, self.creds.client_id, subject, data, 5)


@contextlib.asynccontextmanager
async def caller(up: UpFabric) -> AsyncIterator[Caller]:
    _, path = await up.add_client(level=1)
    creds = Creds.load(path)
    nc = await connect(creds)
    try:
        yield Caller(creds, nc, (await fabric_token(nc, creds))["token"])
    finally:
        await nc.close()


def call(payload: Any, *, token: str | None, call_id: str = "", attempt: int = 1) -> bytes:
    """A request envelope for one attempt of a call (a fresh call id unless given)."""
    return request(
        payload,
        id=call_id or secrets.token_hex(12),
        tok=token,
        at=attempt,
        dl=int((time.time() + 5) * 1000),
    )


def refusal(reply: bytes) -> tuple[str, str]:
    """The kind and code of a refused call's reply (AssertionError if it was served)."""
    try:
        body = body_of(reply)
    except WireError as exc:
        return exc.kind, exc.code
    raise AssertionError(f"served, not refused: {body!r}")


async def test_a_call_without_a_token_is_refused(up: UpFabric, served: Served) -> None:
    async with caller(up) as c:
        reply = await c.send(served.subject, call({"a": 1, "b": 2}, token=None))
    assert refusal(reply) == ("denied", "no_token")


async def test_a_forged_token_is_refused(up: UpFabric, served: Served) -> None:
    """The claims and key id of a genuine token, signed with another key."""
    async with caller(up) as c:
        genuine = await c.token(served)
        claims = jwt.decode(genuine, options={"verify_signature": False})
        header = jwt.get_unverified_header(genuine)
        forged = jwt.encode(
            claims, Ed25519PrivateKey.generate(), algorithm="EdDSA", headers={"kid": header["kid"]}
        )
        reply = await c.send(served.subject, call({"a": 1, "b": 2}, token=forged))
    assert refusal(reply) == ("denied", "authentication_failed")


async def test_a_token_for_another_audience_is_refused(up: UpFabric, served: Served) -> None:
    """A genuine token for the capability's queue group, sent to one instance."""
    async with caller(up) as c:
        queue_token = await c.token(served, instance=False)
        reply = await c.send(served.subject, call({"a": 1, "b": 2}, token=queue_token))
    assert refusal(reply) == ("denied", "authentication_failed")


async def test_a_replayed_request_is_refused(up: UpFabric, served: Served) -> None:
    async with caller(up) as c:
        data = call({"a": 1, "b": 2}, token=await c.token(served))
        assert body_of(await c.send(served.subject, data)) == {"sum": 3}
        replayed = await c.send(served.subject, data)
    assert refusal(replayed) == ("denied", "replayed")


async def test_a_repeated_call_id_is_answered_only_after_its_token_and_to_its_caller(
    up: UpFabric, served: Served
) -> None:
    """The reply a call id got is not handed to a repeat without a token, nor to another
    client that reuses the id: that one's call is its own."""
    async with caller(up) as victim, caller(up) as thief:
        call_id = secrets.token_hex(12)
        secret = {"a": 40, "b": 2}
        first = await victim.send(
            served.subject, call(secret, token=await victim.token(served), call_id=call_id)
        )
        assert body_of(first) == {"sum": 42}
        bare = await thief.send(served.subject, call({}, token=None, call_id=call_id, attempt=2))
        assert refusal(bare) == ("denied", "no_token")
        own = await thief.send(
            served.subject,
            call({"a": 1, "b": 1}, token=await thief.token(served), call_id=call_id, attempt=2),
        )
        assert body_of(own) == {"sum": 2}
        # the victim's own retry of the call is answered as the first time
        again = await victim.send(
            served.subject,
            call(secret, token=await victim.token(served), call_id=call_id, attempt=2),
        )
        assert body_of(again) == {"sum": 42}


async def test_au_is_honoured(up: UpFabric, served: Served) -> None:
    """A request that says ``au`` is recorded by its caller: the agent records nothing
    and its reply does not say ``aud``; one that does not is recorded by the agent."""
    async with caller(up) as c:
        token = await c.token(served)
        by_caller = secrets.token_hex(12)
        reply = await c.send(
            served.subject,
            request(
                {"a": 1, "b": 2},
                id=by_caller,
                tok=token,
                at=1,
                dl=int((time.time() + 5) * 1000),
                au=True,
            ),
        )
        assert body_of(reply) == {"sum": 3}
        assert not unpack(reply).get("aud")
        by_agent = secrets.token_hex(12)
        reply = await c.send(served.subject, call({"a": 2, "b": 2}, token=token, call_id=by_agent))
        assert body_of(reply) == {"sum": 4}
        assert unpack(reply).get("aud") is True

    async def recorded() -> list[dict[str, Any]] | None:
        events = [e for e in await audit_events(up) if e["call_id"] in (by_caller, by_agent)]
        return events if any(e["call_id"] == by_agent for e in events) else None

    # the agent writes its events in order: once the second call's is there, the first
    # one's would be too
    events = await until(recorded, "the agent's event of the call it recorded", timeout=10)
    assert [(e["call_id"], e["side"]) for e in events] == [(by_agent, "callee")]
