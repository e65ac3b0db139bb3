"""Calling for another client: only a credential with the ``gateway`` role may, only for a
client whose fabric token it holds, and never above its own clearance.

The attacker speaks to the token issuer with plain nats-py, holding its own credential
and a victim's fabric token it somehow got; the gateway side is the SDK's
``TokenSession`` with an ``actor``.
"""

from __future__ import annotations

from pathlib import Path

import jwt
import msgpack
import nats
import pytest

from reach.errors import AuthenticationFailed
from reach.security.credentials import CredentialsFile, CredentialStore
from reach.security.membership import connect_as
from reach.security.session import TokenSession
from reach.wire import envelope

from ..up_helpers import Secured, secured

__all__ = ["secured"]


async def _add(fabric: Secured, client_id: str, level: int, *roles: str) -> CredentialsFile:
    conn, _ = await connect_as([fabric.url], name="acting-test", credentials=fabric.admin)
    try:
        store = await CredentialStore.open(conn)
        record, secret = await store.add(client_id, level, roles=list(roles))
    finally:
        await conn.close()
    made = CredentialsFile(fabric.url, record.client_id, secret)
    made.write(fabric.admin.parent.parent / f"{client_id}.creds")
    return made


def _file(fabric: Secured, client_id: str) -> Path:
    return fabric.admin.parent.parent / f"{client_id}.creds"


async def _ask(
    fabric: Secured, creds: CredentialsFile, request: dict[str, object]
) -> envelope.Reply:
    """A token request sent with plain nats-py as ``creds``' client."""
    nc = await nats.connect(
        fabric.url,
        user=creds.client_id,
        password=creds.secret,
        inbox_prefix=f"_INBOX.{creds.client_id}".encode(),
    )
    try:
        data = envelope.pack_request(envelope.RequestMeta(call_id="t-1"), msgpack.packb(request))
        msg = await nc.request("reach.v1.auth.token", data, timeout=5)
        return envelope.unpack_reply(msg.data)
    finally:
        await nc.close()


async def test_a_gateway_calls_for_its_caller_at_the_lower_level_and_names_itself(
    secured: Secured,
) -> None:
    gateway = await _add(secured, "gw2", 2, "gateway")
    alice = await _add(secured, "alice", 4)
    conn, _ = await connect_as([secured.url], name="gw2", credentials=_file(secured, "gw2"))
    try:
        own = TokenSession(conn, gateway)
        await own.start()
        session = TokenSession(conn, alice, actor=own)
        await session.start()
        token = await session.fetch_call_token("echo", "a-1")
        claims = jwt.decode(token, options={"verify_signature": False})
        assert claims["sub"] == "alice"
        assert claims["act"] == {"sub": "gw2"}
        assert claims["lvl"] == 2  # alice holds 4, the gateway 2: never more than the gateway
        await session.stop()
        await own.stop()
    finally:
        await conn.close()


async def test_a_client_without_the_gateway_role_cannot_act_for_another(
    secured: Secured,
) -> None:
    mallory = await _add(secured, "mallory", 2)
    victim = await _add(secured, "victim", 4)
    conn, _ = await connect_as([secured.url], name="victim", credentials=_file(secured, "victim"))
    try:
        victim_session = TokenSession(conn, victim)
        await victim_session.start()
        mallory_session = TokenSession(conn, mallory)
        await mallory_session.start()
        # mallory holds the victim's fabric token and shows her own as the actor
        reply = await _ask(
            secured,
            mallory,
            {
                "client_id": "victim",
                "token": victim_session.token,
                "audience": "echo",
                "actor_token": mallory_session.token,
            },
        )
        assert not reply.ok
        assert "lacks the 'gateway' role" in reply.description
        # an actor token that is not a fabric token at all
        forged = await _ask(
            secured,
            mallory,
            {"client_id": "victim", "token": victim_session.token, "audience": "echo",
             "actor_token": "eyJhbGciOiJub25lIn0.e30."},
        )  # fmt: skip
        assert not forged.ok
        # an actor token without the client's own token proves nothing
        alone = await _ask(
            secured,
            mallory,
            {"client_id": "victim", "secret": "x", "actor_token": mallory_session.token},
        )
        assert not alone.ok
        await victim_session.stop()
        await mallory_session.stop()
    finally:
        await conn.close()


async def test_a_revoked_gateway_gets_no_more_call_tokens_for_its_callers(
    secured: Secured,
) -> None:
    gateway = await _add(secured, "gw3", 4, "gateway")
    bob = await _add(secured, "bob", 2)
    # (over bob's connection: revoking gw3 closes gw3's own, and the issuer's refusal is
    # what is shown here)
    conn, _ = await connect_as([secured.url], name="bob", credentials=_file(secured, "bob"))
    admin, _ = await connect_as([secured.url], name="admin", credentials=secured.admin)
    try:
        own = TokenSession(conn, gateway)
        await own.start()
        session = TokenSession(conn, bob, actor=own)
        await session.start()
        await session.fetch_call_token("echo", "a-1")
        await (await CredentialStore.open(admin)).revoke("gw3")
        with pytest.raises(AuthenticationFailed):
            await session.fetch_call_token("other", "a-1")
        await session.stop()
        await own.stop()
    finally:
        await conn.close()
        await admin.close()
