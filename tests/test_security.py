"""Tokens end to end on a real nats-server: clearance levels, forged tokens, replays,
and agents that may only speak for themselves and serve only what their credential
lists."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import time
from pathlib import Path
from typing import Any

import jwt
import pytest

from reach.caller.client import ReachClient
from reach.errors import (
    AuthenticationFailed,
    Disconnected,
    NotAuthorized,
    RegistrationRefused,
    Unavailable,
)
from reach.registry import Registrar
from reach.resilience.fallback import Fallback
from reach.security.credentials import CredentialsFile
from reach.security.issuer import TokenService
from reach.security.tokens import KeyRing, TokenIssuer, call_audience
from reach.testing import NatsServer
from reach.transport import connect
from reach.wire import envelope, subjects

from .calls_helpers import Behaviour, capability, make_agent, wait_routable
from .cli_helpers import run_reach
from .conftest import Fabric, vault_agent


async def test_cleared_caller_gets_through_and_a_lower_level_is_refused_before_the_handler(
    fabric: Fabric,
) -> None:
    b = Behaviour()
    async with (
        vault_agent(fabric, b),
        ReachClient(servers=fabric.url, credentials=fabric.creds["auditor"]) as auditor,
        ReachClient(servers=fabric.url, credentials=fabric.creds["analyst"]) as analyst,
    ):
        await wait_routable(auditor, "customer_orders", 1)
        await wait_routable(analyst, "customer_orders", 1)
        assert (await auditor.call("customer_orders", {"user": 7})).agent_id == "vault-1"
        with pytest.raises(NotAuthorized) as refused:
            await analyst.call("customer_orders", {"user": 7})
    assert refused.value.level_required == 3
    assert refused.value.level_held == 2
    assert "requires clearance level 3" in str(refused.value)
    assert b.calls == 1


def _forged(fabric: Fabric, kind: str) -> str:
    now = int(time.time())
    claims: dict[str, Any] = {
        "iss": "reach",
        "aud": call_audience("customer_orders"),
        "sub": "auditor",
        "lvl": 4,
        "iat": now,
        "nbf": now,
        "exp": now + 600,
        "jti": "x",
    }
    assert fabric.issuer.ring is not None
    kid = fabric.issuer.ring.active.kid
    if kind == "none":
        return jwt.encode(claims, None, algorithm="none", headers={"kid": kid})
    if kind == "hs256-with-public-key":
        # the classic key confusion: HMAC keyed with the (public) verification key
        pem = fabric.issuer.ring.active.public().pem().encode()
        head = _b64({"alg": "HS256", "typ": "JWT", "kid": kid})
        body = _b64(claims)
        sig = hmac.new(pem, f"{head}.{body}".encode(), hashlib.sha256).digest()
        return f"{head}.{body}.{base64.urlsafe_b64encode(sig).rstrip(b'=').decode()}"
    if kind == "unknown-kid":
        stranger = TokenIssuer(KeyRing.generate())
        from reach.security.credentials import ClientRecord

        record = ClientRecord(client_id="auditor", level=4, secret_hash="x", created_at=now)
        return stranger.issue_with_claims(record, audience=call_audience("customer_orders"))[0]
    if kind == "tampered-level":
        good = _real_token(fabric, level=1)
        head, body, sig = good.split(".")
        payload = json.loads(base64.urlsafe_b64decode(body + "=="))
        payload["lvl"] = 4
        body = base64.urlsafe_b64encode(json.dumps(payload).encode()).rstrip(b"=").decode()
        return f"{head}.{body}.{sig}"
    if kind == "expired":
        return _real_token(fabric, level=4, shift=-3 * 3600)
    return "garbage.not.a-token"


def _b64(value: dict[str, Any]) -> str:
    return base64.urlsafe_b64encode(json.dumps(value).encode()).rstrip(b"=").decode()


def _real_token(fabric: Fabric, *, level: int, shift: float = 0.0) -> str:
    from reach.clock import ManualClock
    from reach.security.credentials import ClientRecord

    assert fabric.issuer.ring is not None
    clock = ManualClock(wall=time.time() + shift)
    issuer = TokenIssuer(fabric.issuer.ring, clock=clock)
    record = ClientRecord(client_id="forger", level=level, secret_hash="x", created_at=1.0)
    return issuer.issue_with_claims(record, audience=call_audience("customer_orders"))[0]


@pytest.mark.parametrize(
    "kind",
    ["none", "hs256-with-public-key", "unknown-kid", "tampered-level", "expired", "garbage"],
)
async def test_forged_tokens_are_refused_and_the_handler_never_runs(
    fabric: Fabric, kind: str
) -> None:
    b = Behaviour()
    async with vault_agent(fabric, b) as agent:
        request = envelope.pack_request(
            envelope.RequestMeta(call_id=f"forged-{kind}", token=_forged(fabric, kind)),
            b"\x80",
        )
        data = await fabric.conn.request(
            subjects.capability_instance("customer_orders", "vault-1"), request, 2
        )
        reply = envelope.unpack_reply(data)
        assert not reply.ok
        assert reply.kind == "denied"
        assert agent._server.denials == 1
    assert b.calls == 0


async def test_a_flood_of_refused_calls_writes_a_few_log_lines_not_one_each(
    fabric: Fabric, caplog: pytest.LogCaptureFixture
) -> None:
    """Each denied call used to log its own line: a caller (or an attacker) sending
    forged tokens wrote the agent's log as fast as it sent. The first few of an interval
    get a line; the rest are counted and said once."""
    b = Behaviour()
    subject = subjects.capability_instance("customer_orders", "vault-1")
    async with vault_agent(fabric, b) as agent:
        with caplog.at_level(logging.WARNING, logger="reach"):
            for n in range(200):
                request = envelope.pack_request(
                    envelope.RequestMeta(call_id=f"flood-{n}", token="garbage.not.a-token"),
                    b"\x80",
                )
                reply = envelope.unpack_reply(await fabric.conn.request(subject, request, 2))
                assert reply.kind == "denied"
        assert agent._server.denials == 200
    lines = [r for r in caplog.records if "refused" in r.getMessage()]
    assert 1 <= len(lines) <= 6, [r.getMessage() for r in lines]
    assert b.calls == 0


async def test_a_replayed_call_is_refused(fabric: Fabric) -> None:
    b = Behaviour()
    async with (
        vault_agent(fabric, b),
        ReachClient(servers=fabric.url, credentials=fabric.creds["auditor"]) as auditor,
    ):
        await wait_routable(auditor, "customer_orders", 1)
        token = await auditor._security.fetch_call_token("customer_orders", "vault-1")
        request = envelope.pack_request(envelope.RequestMeta(call_id="once", token=token), b"\x80")
        subject = subjects.capability_instance("customer_orders", "vault-1")
        first = envelope.unpack_reply(await fabric.conn.request(subject, request, 2))
        again = envelope.unpack_reply(await fabric.conn.request(subject, request, 2))
    assert first.ok
    assert again.kind == "denied"
    assert again.code == "replayed"
    assert b.calls == 1


async def test_a_callee_cannot_use_the_tokens_its_callers_send_it_anywhere_else(
    fabric: Fabric,
) -> None:
    """A callee sees every token its callers send: here intruder-1 (level 1, serving
    "weather") keeps the auditor's (level 3). Those are call tokens for its own
    capability: the vault's customer_orders refuses them, the issuer will not exchange
    them, and the registrar's verifier does not take them. The auditor's fabric token
    never reaches a callee."""
    import asyncio

    from reach.security.tokenexchange import TokenRequest
    from reach.security.tokens import TokenRejected
    from reach.wire.modelcodec import encode_model

    kept: list[str] = []
    got = asyncio.Event()

    async def keep(msg: Any) -> None:  # what intruder-1 receives, seen as it is
        meta, _ = envelope.unpack_request(msg.data)
        kept.append(meta.token or "")
        got.set()

    intruder, _ = make_agent(fabric.url, "intruder-1", capability("weather", level=1))
    intruder.credentials = fabric.creds["intruder"]
    b = Behaviour()
    spy = await fabric.conn.subscribe(subjects.capability_instance("weather", "intruder-1"), keep)
    try:
        async with (
            vault_agent(fabric, b),
            intruder,
            ReachClient(servers=fabric.url, credentials=fabric.creds["auditor"]) as auditor,
        ):
            await wait_routable(auditor, "customer_orders", 1)
            await wait_routable(auditor, "weather", 1)
            await auditor.call("weather", {})
            await asyncio.wait_for(got.wait(), 5)
            token = kept[0]
            assert token != auditor._security.token()
            claims = jwt.decode(token, options={"verify_signature": False})
            assert claims["aud"] == call_audience("weather", "intruder-1")
            assert claims["lvl"] == 3  # the auditor's clearance, worth stealing

            # replayed to the vault (level 3, which the intruder's own token cannot reach)
            request = envelope.pack_request(
                envelope.RequestMeta(call_id="replayed-1", token=token), b"\x80"
            )
            reply = envelope.unpack_reply(
                await fabric.conn.request(
                    subjects.capability_instance("customer_orders", "vault-1"), request, 2
                )
            )
            assert reply.kind == "denied"
            assert "audience" in reply.description
            # exchanged at the issuer for a token to customer_orders
            ask = TokenRequest(client_id="auditor", token=token, audience="customer_orders")
            request = envelope.pack_request(envelope.RequestMeta(call_id="x"), encode_model(ask))
            reply = envelope.unpack_reply(await fabric.conn.request(subjects.TOKEN, request, 2))
            assert reply.kind == "denied"
            assert "audience" in reply.description
            # shown to the registrar (which checks tokens with the fabric's audience)
            assert fabric.issuer._verifier is not None
            with pytest.raises(TokenRejected, match="audience"):
                fabric.issuer._verifier.verify(token)
    finally:
        await spy.unsubscribe()
    assert b.calls == 0


async def test_a_revoked_client_gets_no_new_call_token(fabric: Fabric) -> None:
    async with (
        vault_agent(fabric, Behaviour()),
        ReachClient(servers=fabric.url, credentials=fabric.creds["auditor"]) as auditor,
    ):
        await wait_routable(auditor, "customer_orders", 1)
        assert fabric.issuer.credentials is not None
        await fabric.issuer.credentials.revoke("auditor")
        with pytest.raises(AuthenticationFailed, match="revoked"):
            await auditor.call("customer_orders", {})


async def test_a_retired_signing_key_cannot_mint_call_tokens(fabric: Fabric) -> None:
    """The issuer checks a fabric token it is to exchange against REACH_KEYS, as agents
    do: a key rotated away signs nothing that outlives its retirement (it had kept every
    key it ever had, without their limits, and exchanged such a token for a fresh call
    token signed with the current key)."""
    import jwt as pyjwt

    from reach.security.tokenexchange import TokenRequest
    from reach.wire.modelcodec import encode_model

    assert fabric.issuer.ring is not None
    old = fabric.issuer.ring.active
    await fabric.issuer.rotate(settle_sec=0.1)
    now = int(time.time())
    forged = pyjwt.encode(
        {"iss": "reach", "aud": "reach", "sub": "auditor", "lvl": 3, "roles": [], "iat": now,
         "nbf": now, "exp": now + 30 * 86400, "jti": "long-lived"},
        old.private_key, algorithm="EdDSA", headers={"kid": old.kid},
    )  # fmt: skip
    ask = TokenRequest(client_id="auditor", token=forged, audience="customer_orders")
    request = envelope.pack_request(envelope.RequestMeta(call_id="x"), encode_model(ask))
    reply = envelope.unpack_reply(await fabric.conn.request(subjects.TOKEN, request, 5))
    assert reply.kind == "denied"
    assert "retired" in reply.description


async def test_a_failed_call_token_renewal_is_tried_again_after_a_while_not_on_every_call(
    fabric: Fabric,
) -> None:
    import asyncio

    asked = 0

    async def count(msg: Any) -> None:
        nonlocal asked
        asked += 1

    spy = await fabric.conn.subscribe(subjects.TOKEN, count)
    try:
        async with (
            vault_agent(fabric, Behaviour()),
            ReachClient(servers=fabric.url, credentials=fabric.creds["auditor"]) as auditor,
        ):
            await wait_routable(auditor, "customer_orders", 1)
            await auditor.call("customer_orders", {})
            session = auditor._security.own
            assert session is not None
            assert fabric.issuer.credentials is not None
            await fabric.issuer.credentials.revoke("auditor")  # renewals now fail
            token, _, expires_at = session._calls["customer_orders.vault-1"]
            session._calls["customer_orders.vault-1"] = (token, time.time() - 1, expires_at)
            before = asked
            for _ in range(50):
                await auditor.call("customer_orders", {})  # the token in hand still works
                await asyncio.sleep(0.005)
            assert asked - before <= 2  # one renewal, not one per call
            # a stopped session starts nothing more, and tells a waiting caller why
            await session.stop()
            with pytest.raises(Disconnected):
                await session.fetch_call_token("weather")
    finally:
        await spy.unsubscribe()


async def test_an_agent_cannot_announce_as_another(fabric: Fabric) -> None:
    impostor, _ = make_agent(fabric.url, "vault-1", capability("customer_orders", level=3))
    impostor.credentials = fabric.creds["intruder"]
    with pytest.raises(RegistrationRefused, match="bound to agent_id 'intruder-1'"):
        await impostor.start()


async def test_without_credentials_a_secure_fabric_refuses_at_connect(fabric: Fabric) -> None:
    client = ReachClient(servers=fabric.url)
    client.credentials = None
    with pytest.raises(AuthenticationFailed, match="requires credentials"):
        await client.connect()


async def test_a_wrong_secret_is_refused(fabric: Fabric, tmp_path: Path) -> None:
    bad = tmp_path / "bad.creds"
    CredentialsFile(fabric.url, "auditor", "not-the-secret").write(bad)
    with pytest.raises(AuthenticationFailed, match="token refused"):
        async with ReachClient(servers=fabric.url, credentials=bad):
            pass


async def test_creds_cli_adds_lists_and_revokes(fabric: Fabric, tmp_path: Path) -> None:
    out = tmp_path / "ops.creds"
    code, text, _ = await run_reach(
        "creds", "add", "ops", "--level", "2", "--out", str(out), "--servers", fabric.url
    )
    assert code == 0, text
    assert out.stat().st_mode & 0o777 == 0o600
    assert CredentialsFile.read(out).client_id == "ops"
    code, text, _ = await run_reach("creds", "list", "--json", "--servers", fabric.url)
    rows = {json.loads(line)["client_id"]: json.loads(line) for line in text.splitlines()}
    assert rows["ops"]["level"] == 2
    assert "secret_hash" not in rows["ops"]
    async with ReachClient(servers=fabric.url, credentials=out):
        pass
    code, _, _ = await run_reach("creds", "revoke", "ops", "--servers", fabric.url)
    assert code == 0
    with pytest.raises(AuthenticationFailed):
        async with ReachClient(servers=fabric.url, credentials=out):
            pass


async def test_key_rotation_while_calls_flow_fails_no_call(fabric: Fabric) -> None:
    import asyncio

    assert fabric.issuer.credentials is not None
    _, secret = await fabric.issuer.credentials.add("root", 4, roles=["admin"])
    admin = fabric.creds["auditor"].with_name("root.creds")
    CredentialsFile(fabric.url, "root", secret).write(admin)
    b = Behaviour()
    failures: list[BaseException] = []
    async with (
        vault_agent(fabric, b),
        ReachClient(servers=fabric.url, credentials=fabric.creds["auditor"]) as auditor,
    ):
        await wait_routable(auditor, "customer_orders", 1)
        stop = asyncio.Event()

        async def load() -> None:
            while not stop.is_set():
                try:
                    await auditor.call("customer_orders", {"n": 1})
                except Exception as exc:
                    failures.append(exc)
                await asyncio.sleep(0.005)

        runner = asyncio.create_task(load())
        code, _text, err = await run_reach(
            "keys", "rotate", "--servers", fabric.url, "--creds", str(admin)
        )
        assert code == 0, err
        # a fresh token from the new key, while the old token still works
        assert auditor._security.own is not None
        await auditor._security.own.refresh()
        await asyncio.sleep(0.3)
        stop.set()
        await runner
    assert failures == []
    assert b.calls > 10
    code, _, err = await run_reach(
        "keys", "rotate", "--servers", fabric.url, "--creds", str(fabric.creds["analyst"])
    )
    assert code == 1
    assert "not an admin" in err


async def test_issuer_down_the_token_works_until_it_expires_then_calls_fail_closed(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    import asyncio

    conn = await connect([nats_server.url], name="short-lived")
    issuer = TokenService(conn, key_file=tmp_path / "signing.key", ttl_sec=3)
    await issuer.start()
    assert issuer.credentials is not None
    creds = {}
    for client_id, agent_id, caps in (
        ("vault", "vault-1", ("customer_orders",)),
        ("auditor", None, ()),
    ):
        _, secret = await issuer.credentials.add(client_id, 3, agent_id=agent_id, capabilities=caps)
        creds[client_id] = tmp_path / f"{client_id}.creds"
        CredentialsFile(nats_server.url, client_id, secret).write(creds[client_id])
    registrar = Registrar(conn)
    await registrar.start()
    fabric = Fabric(nats_server.url, conn, issuer, creds)
    try:
        async with (
            vault_agent(fabric, Behaviour()),
            ReachClient(servers=nats_server.url, credentials=creds["auditor"]) as client,
        ):
            await wait_routable(client, "customer_orders", 1)
            # a capability called before: its call token is at hand
            assert (await client.call("customer_orders", {})).agent_id == "vault-1"
            await issuer.stop()  # the issuer goes away
            assert (await client.call("customer_orders", {})).agent_id == "vault-1"
            # a first call to another capability needs the issuer for its token: the issuer
            # is away, as an instance may be (at once, and a fallback applies)
            with pytest.raises(Unavailable, match="issuer did not answer"):
                await client.call("weather", {}, timeout=30)
            fallback = Fallback(default={"weather": "unknown"})
            result = await client.call("weather", {}, fallback=fallback)
            assert result.value == {"weather": "unknown"}
            session = client._security.own
            assert session is not None
            # renewal fails (no issuer); the token is used until it expires, then no longer
            await asyncio.sleep(max(0.0, session.expires_at - time.time()) + 0.05)
            with pytest.raises(AuthenticationFailed, match="no valid token"):
                await client.call("customer_orders", {})
    finally:
        await registrar.stop()
        await conn.close()


async def test_heartbeat_and_bye_as_another_agent_are_refused_and_leave_its_record_alone(
    fabric: Fabric,
) -> None:
    from reach.wire.modelcodec import encode_model
    from reach.wire.models import Bye, Heartbeat

    b = Behaviour()
    async with (
        vault_agent(fabric, b) as vault,
        ReachClient(servers=fabric.url, credentials=fabric.creds["intruder"]) as intruder,
    ):
        await wait_routable(intruder, "customer_orders", 1)
        before = intruder.routes.get("vault-1")
        assert before is not None
        token = intruder._security.token()
        hb = Heartbeat(
            agent_id="vault-1",
            instance_id=vault.instance_id,
            seq=99,
            sent_at=time.time(),
            in_flight=63,
            max_concurrency=64,
        )
        bye = Bye(agent_id="vault-1", instance_id=vault.instance_id)
        for subject, body in (
            (subjects.heartbeat("vault-1"), encode_model(hb)),
            (subjects.bye("vault-1"), encode_model(bye)),
        ):
            request = envelope.pack_request(envelope.RequestMeta(call_id="x", token=token), body)
            reply = envelope.unpack_reply(await fabric.conn.request(subject, request, 2))
            assert reply.kind == "denied"
            assert "bound to agent_id 'intruder-1'" in reply.description
        after = intruder.routes.get("vault-1")
        assert after is not None
        assert after.instance_id == before.instance_id
        assert after.in_flight == 0


@pytest.mark.parametrize("skew_sec", [3 * 3600.0, -3600.0])
async def test_a_client_whose_clock_is_off_keeps_a_usable_token(
    fabric: Fabric, skew_sec: float
) -> None:
    """The token's expiry was read as the issuer's absolute time on the client's clock:
    3 h ahead, every token looked expired; 1 h behind, renewal came after expiry. The
    client counts the token's lifetime from when it got it, on its own clock."""
    from reach.clock import ManualClock
    from reach.security.issuer import DEFAULT_TTL_SEC
    from reach.security.session import TokenSession

    conn = await connect([fabric.url], name="skewed")
    clock = ManualClock(wall=time.time() + skew_sec)
    try:
        session = TokenSession(conn, CredentialsFile.read(fabric.creds["auditor"]), clock=clock)
        await session.refresh()
        assert session.token  # not refused as expired on arrival
        lifetime = session.expires_at - clock.time()
        assert 0 < lifetime <= DEFAULT_TTL_SEC
        clock.advance(lifetime * 0.5)  # halfway through its life, on this clock
        assert session.token
    finally:
        await conn.close()


# -- an agent serves what its credential lists -----------------------------------------


async def test_an_agent_credential_serves_only_the_capabilities_it_lists(
    fabric: Fabric, tmp_path: Path
) -> None:
    """NATS lets an agent subscribe to any capability's subject for its own agent_id, so
    an L1 agent with `--cap transcribe` could announce `customer_orders` and be routed
    (and handed) other callers' L3 calls. The registrar refuses the announce, audited."""
    assert fabric.issuer.credentials is not None
    _, secret = await fabric.issuer.credentials.add(
        "squatter", 1, agent_id="squat-1", capabilities=["transcribe"]
    )
    creds = tmp_path / "squatter.creds"
    CredentialsFile(fabric.url, "squatter", secret).write(creds)

    squat, _ = make_agent(fabric.url, "squat-1", capability("customer_orders", level=3))
    squat.credentials = creds
    with pytest.raises(RegistrationRefused, match="may serve transcribe; not customer_orders"):
        await squat.start()

    honest, _ = make_agent(fabric.url, "squat-1", capability("transcribe"))
    honest.credentials = creds
    async with honest:  # what it lists, it may serve
        pass
