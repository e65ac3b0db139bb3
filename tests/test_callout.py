"""NATS-level isolation through the auth callout, against a real nats-server."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import stat
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import nats
import nats.errors
import nats.js.errors
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import KeyValueConfig, RePublish

from reach.registry.partitions import partition_of
from reach.security import accounts, natsconf
from reach.security.accounts import PARTICIPANT_SUFFIX
from reach.security.callout import (
    AuthCallout,
    CalloutRequest,
    Permissions,
)
from reach.security.callout import permissions_for as perms_for
from reach.security.natsjwt import decode_jwt, encode_jwt
from reach.testing import NatsServer
from reach.transport import Connection, connect, kvfollow
from reach.wire import subjects

SECRET = "s3cret-value"

#: client id -> (role, agent_id, capabilities, async_jobs)
CLIENTS: dict[str, tuple[str, str | None, list[str], bool]] = {
    "svc-a": ("agent", "agent-a", ["echo"], False),
    "svc-b": ("agent", "agent-b", ["echo"], False),
    "svc-jobs": ("agent", "agent-j", ["slow"], True),
    "app": ("caller", None, [], False),
    "app-jobs": ("caller", None, [], True),
    "ops": ("registrar", None, [], False),
}


async def authenticate(user: str, password: str) -> Permissions | None:
    if password != SECRET or user not in CLIENTS:
        return None
    role, agent_id, caps, jobs = CLIENTS[user]
    return perms_for(
        role, agent_id=agent_id, capabilities=caps, inbox_prefix=f"_INBOX.{user}", async_jobs=jobs
    )


@pytest.fixture(scope="module")
def secure(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[NatsServer, natsconf.SecureSetup]]:
    store = tmp_path_factory.mktemp("secure-nats")
    server = NatsServer(store_dir=store)
    setup = dataclasses.replace(natsconf.prepare(store), auth_timeout=2.0)
    server.config_file = natsconf.write_config(
        setup, store / "nats.conf", port=server.port, store_dir=None
    )
    server.start_now()
    try:
        yield server, setup
    finally:
        server.cleanup()


ServiceConn = Callable[[], Awaitable[Connection]]


@pytest.fixture
async def service_conn(
    secure: tuple[NatsServer, natsconf.SecureSetup],
) -> AsyncIterator[ServiceConn]:
    """Connections of the callout service user, closed after the test."""
    server, setup = secure
    conns: list[Connection] = []

    async def _open() -> Connection:
        user = setup.callout_user
        conns.append(
            await connect([server.url], name="callout", user=user.name, password=user.password)
        )
        return conns[-1]

    yield _open
    for conn in conns:
        await conn.close()


@pytest.fixture
async def callout(
    secure: tuple[NatsServer, natsconf.SecureSetup], service_conn: ServiceConn
) -> AsyncIterator[AuthCallout]:
    async with AuthCallout(await service_conn(), secure[1].issuer, authenticate) as service:
        yield service


class Peer:
    """A raw nats-py client that records the errors the server reports."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.nc = Client()

    async def error_cb(self, exc: Exception) -> None:
        self.errors.append(str(exc).lower())

    async def violation(self, fragment: str, timeout: float = 3.0) -> None:
        """Wait until the server reported a permissions violation naming ``fragment``."""
        deadline = asyncio.get_running_loop().time() + timeout
        while not any("permissions violation" in e and fragment.lower() in e for e in self.errors):
            assert asyncio.get_running_loop().time() < deadline, (fragment, self.errors)
            await asyncio.sleep(0.02)


@pytest.fixture
async def login(
    secure: tuple[NatsServer, natsconf.SecureSetup], callout: AuthCallout
) -> AsyncIterator[Callable[..., Awaitable[Peer]]]:
    server, _ = secure
    peers: list[Peer] = []

    async def _login(
        user: str = "", password: str = SECRET, inbox: str | None = None, name: str | None = None
    ) -> Peer:
        peer = Peer()
        kwargs: dict[str, object] = {"user": user, "password": password} if user else {}
        try:
            await peer.nc.connect(
                server.url,
                name=name,
                inbox_prefix=inbox or f"_INBOX.{user or 'anon'}",
                error_cb=peer.error_cb,
                allow_reconnect=False,
                connect_timeout=5,
                **kwargs,  # type: ignore[arg-type]
            )
        except BaseException:
            await peer.nc.close()  # a refused connect leaves its socket open otherwise
            raise
        peers.append(peer)
        return peer

    yield _login
    for peer in peers:
        await peer.nc.close()


@pytest.fixture
async def registrar(secure: tuple[NatsServer, natsconf.SecureSetup]) -> AsyncIterator[Client]:
    """The registrar's service user: a password from the config, no callout."""
    server, setup = secure
    nc = await nats.connect(
        server.url, user=setup.registrar_user.name, password=setup.registrar_user.password
    )
    yield nc
    await nc.close()


async def _refused(login: Callable[..., Awaitable[Peer]], *args: str) -> str:
    with pytest.raises(Exception) as info:  # noqa: PT011 - nats-py raises several kinds
        await login(*args)
    return str(info.value).lower()


async def settle(nc: Client) -> None:
    """Wait until the server has our subscriptions: nats-py 2.16 sends flush()'s PING ahead
    of a SUB still in its buffer, so one round trip is not enough."""
    await nc.flush()
    await nc.flush()


def _counter() -> tuple[list[Msg], Callable[[Msg], Awaitable[None]]]:
    got: list[Msg] = []

    async def cb(msg: Msg) -> None:
        got.append(msg)

    return got, cb


# -- keys, config, JWTs -----------------------------------------------------------------------


def test_nkey_matches_the_nats_docs_vector() -> None:
    key = natsconf.NKey("SAANDLKMXL6CUS3CP52WIXBEDN6YJ545GDKC65U5JZPPV6WH6ESWUA6YAI")
    assert key.public_key == "ABJHLOVMPA4CI6R5KLNGOB4GSLNIY7IOUPAJC4YFNDLQVIOBYQGUWVLA"
    assert natsconf.NKey(key.seed).public_key == key.public_key
    assert natsconf.verify_signature(key.public_key, b"x", key.sign(b"x"))
    assert not natsconf.verify_signature(key.public_key, b"y", key.sign(b"x"))


def test_secrets_are_private_and_stable(tmp_path: Path) -> None:
    first = natsconf.prepare(tmp_path)
    again = natsconf.prepare(tmp_path)
    assert again.issuer.public_key == first.issuer.public_key
    assert again.registrar_user.password == first.registrar_user.password
    conf = natsconf.write_config(first, tmp_path / "nats.conf", port=4222, store_dir=tmp_path)
    for path in [conf, *(tmp_path / "auth").iterdir()]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    text = conf.read_text()
    assert first.issuer.public_key in text
    assert first.issuer.seed not in text
    assert "no_auth_user" not in text
    assert 'listen: "127.0.0.1:4222"' in text


def test_decode_jwt_rejects_tampering() -> None:
    key = natsconf.NKey.create(natsconf.PREFIX_SERVER)
    token = encode_jwt({"sub": "x", "nats": {"level": 1}}, key)
    assert decode_jwt(token)["iss"] == key.public_key
    head, body, sig = token.split(".")
    forged = encode_jwt({"sub": "x", "nats": {"level": 4}}, key).split(".")[1]
    for bad in (f"{head}.{forged}.{sig}", f"{head}.{body}.", "a.b", "garbage.x.y"):
        with pytest.raises(ValueError, match="JWT"):
            decode_jwt(bad)


def test_callout_rejects_requests_it_cannot_trust() -> None:
    issuer = natsconf.NKey.create()
    server = natsconf.NKey.create(natsconf.PREFIX_SERVER)
    user = natsconf.NKey.create(natsconf.PREFIX_USER).public_key
    service = AuthCallout(None, issuer, authenticate, server_ids=[server.public_key])  # type: ignore[arg-type]

    def request(signer: natsconf.NKey = server, **over: object) -> bytes:
        nats_part = {
            "server_id": {"id": server.public_key, "name": "s", "host": "h"},
            "user_nkey": user,
            "connect_opts": {"user": "app", "pass": SECRET, "protocol": 1},
            "type": "authorization_request",
            "version": 2,
        }
        claims = {
            "aud": "nats-authorization-request",
            "sub": issuer.public_key,
            "exp": int(time.time()) + 2,
            "nats": nats_part,
        }
        return encode_jwt(
            {k: v for k, v in (claims | over).items() if v is not None}, signer
        ).encode()

    assert service.verify_request(request()).user == "app"
    other = natsconf.NKey.create(natsconf.PREFIX_SERVER)
    for bad in (
        request(signer=other),  # a server we do not know (and not the one it names)
        request(aud="someone-else"),
        request(sub=natsconf.NKey.create().public_key),  # for another issuer
        request(exp=1),  # expired
        request(exp=None),  # no expiry
        request(nats={"type": "authorization_request", "server_id": "x", "user_nkey": 5}),
        request(nats={"type": "authorization_request"}),  # no user nkey, no server
        request()[:-4] + b"AAAA",  # bad signature
    ):
        with pytest.raises(ValueError, match=r"request|JWT"):
            service.verify_request(bad)


def test_callers_and_agents_are_placed_outside_the_jetstream_account() -> None:
    """Callers and agents land in the clients' account whatever their connection is
    named; an admin's login lands in the fabric account unless it joins as a
    participant (its agent's or client's connection)."""
    service = AuthCallout(None, natsconf.NKey.create(), authenticate)  # type: ignore[arg-type]

    def placed(role: str, name: str) -> str:
        request = CalloutRequest("N", "U", "u1", "p", name, "127.0.0.1")
        perms = perms_for(role, agent_id="a1", capabilities=["echo"], inbox_prefix="_INBOX.u1")
        return service.account_of(request, perms)

    for role in ("caller", "agent"):
        for name in ("", "agent:a1", "anything" + PARTICIPANT_SUFFIX, "REACH"):
            assert placed(role, name) == natsconf.CLIENT_ACCOUNT
    for role in ("admin", "registrar"):
        assert placed(role, "reach-cli") == natsconf.APP_ACCOUNT
        assert placed(role, "agent:a1" + PARTICIPANT_SUFFIX) == natsconf.CLIENT_ACCOUNT


def test_the_clients_account_reaches_the_fabric_account_through_one_export(
    tmp_path: Path,
) -> None:
    """An answer handed back onto a subject the clients' account imports must not be
    passed on into the fabric account: nats-server drops a message that would go out
    again through the export it came back through, so every service the clients import
    comes through the same single export; the clients' account has no JetStream."""
    setup = natsconf.prepare(tmp_path)
    text = natsconf.render_auth(setup)
    fabric = text.split(f"  {natsconf.APP_ACCOUNT}: {{", 1)[1].split(
        f"  {natsconf.CLIENT_ACCOUNT}: {{", 1
    )
    app_part, clients_part = fabric[0], fabric[1].split(f"  {natsconf.SYSTEM_ACCOUNT}:", 1)[0]
    assert app_part.count("{ service:") == 1 + len(accounts.fabric_service_imports())
    assert f'{{ service: ">", accounts: [ {natsconf.CLIENT_ACCOUNT} ]' in app_part
    assert "jetstream" not in clients_part
    for subject in accounts.client_service_imports():
        assert f"account: {natsconf.APP_ACCOUNT}, subject: {json.dumps(subject)}" in clients_part
    # what a client may publish into the fabric account, it can only through an import
    caller = perms_for("caller", agent_id=None, capabilities=[], inbox_prefix="_INBOX.c2")
    imported = accounts.client_service_imports()
    for subject in caller.publish_allow:
        if subject.startswith(("$JS.", "$KV.", "reach.v1.audit", "reach.v1.auth")):
            assert any(subject_matches(subject, pattern) for pattern in imported), subject


def subject_matches(subject: str, pattern: str) -> bool:
    """Whether every subject ``subject`` (wildcards allowed) stands for is in ``pattern``."""
    have, want = subject.split("."), pattern.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return len(have) > i
        if i >= len(have) or (token != "*" and token != have[i]) or have[i] == ">":
            return False
    return len(have) == len(want)


def test_permissions_policy() -> None:
    agent = perms_for("agent", agent_id="a1", capabilities=["echo"], inbox_prefix="_INBOX.c1")
    assert "reach.v1.hb.a1" in agent.publish_allow
    assert not any(
        s.startswith("reach.v1.hb.") and s != "reach.v1.hb.a1" for s in agent.publish_allow
    )
    assert "reach.v1.cap.echo echo" in agent.subscribe_allow  # queue group only
    assert "reach.v1.cap.echo.a1" in agent.subscribe_allow  # its own capabilities only
    assert not any(s.startswith("reach.v1.cap.*") for s in agent.subscribe_allow)
    assert "_INBOX.c1.>" in agent.subscribe_allow
    # replies through a publish permission on call-reply subjects, never NATS responses
    assert not agent.allow_responses
    assert "_INBOX.*.r.*.*" in agent.publish_allow
    unbound = perms_for("agent", agent_id="a2", capabilities=[], inbox_prefix="_INBOX.c3")
    assert not any(s.startswith("reach.v1.cap.") for s in unbound.subscribe_allow)
    assert not any("$KV" in s for s in agent.publish_allow)
    caller = perms_for("caller", agent_id=None, capabilities=[], inbox_prefix="_INBOX.c2")
    # audit batches and notices under its own client id only: readers trust the subject
    assert {"reach.v1.audit.*.c2", "reach.v1.audited.*.c2"} <= set(caller.publish_allow)
    assert not any(s.startswith("reach.v1.audit") and s.endswith("*") for s in caller.publish_allow)
    assert "reach.v1.audit.*.c1" in agent.publish_allow
    assert caller.subscribe_allow == (
        "_INBOX.c2.>",
        "reach.v1.kv.REACH_REGISTRY.>",  # the registry's and the keys' changes, read-only
        "reach.v1.kv.REACH_KEYS.>",
    )
    assert not any("CONSUMER" in s for s in caller.publish_allow + agent.publish_allow)
    assert not caller.allow_responses
    assert perms_for(
        "registrar", agent_id=None, capabilities=[], inbox_prefix=""
    ).publish_allow == (">",)
    for bad in (
        {"role": "root"},
        {"role": "agent", "agent_id": None},
        {"role": "agent", "agent_id": "a.*"},
        {"role": "agent", "capabilities": [">"]},
        {"role": "caller", "inbox_prefix": "_INBOX"},
        {"role": "caller", "inbox_prefix": "_INBOX.>"},
    ):
        args: dict[str, object] = {
            "agent_id": "a1",
            "capabilities": [],
            "inbox_prefix": "_INBOX.c",
        } | bad
        with pytest.raises(ValueError, match=r"role|agent_id|capability|inbox"):
            perms_for(**args)  # type: ignore[arg-type]
    assert Permissions().claims() == {"pub": {"deny": [">"]}, "sub": {"deny": [">"]}}


# -- authentication against the real server ---------------------------------------------------


async def test_anonymous_connect_is_refused(login: Callable[..., Awaitable[Peer]]) -> None:
    assert "authorization violation" in await _refused(login)


async def test_wrong_or_unknown_credentials_are_refused(
    login: Callable[..., Awaitable[Peer]], callout: AuthCallout
) -> None:
    assert "authorization violation" in await _refused(login, "app", "wrong")
    assert "authorization violation" in await _refused(login, "nobody", SECRET)
    assert "authorization violation" in await _refused(login, "app.>", SECRET)
    assert callout.refused == 3


async def test_no_callout_means_no_login(
    secure: tuple[NatsServer, natsconf.SecureSetup],
    login: Callable[..., Awaitable[Peer]],
    callout: AuthCallout,
) -> None:
    await callout.stop()  # fail closed: the server waits auth_timeout, then refuses
    assert "authorization violation" in await _refused(login, "app", SECRET)


async def test_answer_signed_by_another_issuer_is_refused(
    secure: tuple[NatsServer, natsconf.SecureSetup],
    login: Callable[..., Awaitable[Peer]],
    callout: AuthCallout,
    service_conn: ServiceConn,
) -> None:
    server, _ = secure
    await callout.stop()
    rogue = AuthCallout(await service_conn(), natsconf.NKey.create(), authenticate)
    rogue.verify_request = callout.verify_request  # type: ignore[method-assign]  # answer all
    async with rogue:
        assert "authorization violation" in await _refused(login, "app", SECRET)
    assert rogue.accepted == 1  # it did answer, and the server threw the answer away
    assert "auth callout signing key is unknown" in server.log_file.read_text().lower()


async def test_valid_client_connects_and_calls_an_agent(
    login: Callable[..., Awaitable[Peer]], callout: AuthCallout
) -> None:
    agent = await login("svc-a")
    app = await login("app")

    async def echo(msg: Msg) -> None:
        await msg.respond(b"echo:" + msg.data)  # to a call-reply subject: a publish permission

    await agent.nc.subscribe("reach.v1.cap.echo", queue="echo", cb=echo)
    await settle(agent.nc)
    replies: asyncio.Queue[Msg] = asyncio.Queue()
    await app.nc.subscribe("_INBOX.app.r.b1.*", cb=replies.put)  # the caller's own inbox
    await settle(app.nc)
    await app.nc.publish("reach.v1.cap.echo", b"hi", reply="_INBOX.app.r.b1.t1")
    reply = await asyncio.wait_for(replies.get(), 3)
    assert (reply.subject, reply.data) == ("_INBOX.app.r.b1.t1", b"echo:hi")
    assert callout.accepted == 2
    assert not agent.errors
    assert not app.errors
    # the rest of the caller's inbox (where nats-py's own requests are answered) is not
    # the agent's to publish to: no response permission stretches it there
    await app.nc.publish("reach.v1.cap.echo", b"hi", reply=app.nc.new_inbox())
    await agent.violation("_inbox.app.")


async def test_user_jwt_expiry_ends_the_connection(
    secure: tuple[NatsServer, natsconf.SecureSetup],
    login: Callable[..., Awaitable[Peer]],
    callout: AuthCallout,
    service_conn: ServiceConn,
) -> None:
    """With ``user_ttl`` a revoked client is out at the latest when its user JWT expires."""
    await callout.stop()
    async with AuthCallout(await service_conn(), secure[1].issuer, authenticate, user_ttl=1):
        app = await login("app")
        started = asyncio.get_running_loop().time()
        for _ in range(300):
            if app.nc.is_closed:
                break
            await asyncio.sleep(0.01)
        assert app.nc.is_closed
        assert "authentication expired" in str(app.nc.last_error)
        assert asyncio.get_running_loop().time() - started > 0.5


# -- subject isolation ------------------------------------------------------------------------


async def test_agent_cannot_listen_beyond_its_own_subjects(
    login: Callable[..., Awaitable[Peer]], registrar: Client
) -> None:
    agent = await login("svc-a")
    got, cb = _counter()
    own, own_cb = _counter()
    forbidden = {
        "reach.v1.cap.echo.agent-b": None,  # another agent's instance subject
        "_INBOX.>": None,  # everybody's replies
        "_INBOX.app.>": None,  # a caller's replies
        "$JS.API.>": None,  # the JetStream / KV API
        "$KV.REACH_REGISTRY.>": None,
        "reach.v1.cap.echo": None,  # its capability without the queue group: a copy of all
        "reach.v1.probe.agent-b": None,
    }
    for subject in forbidden:
        await agent.nc.subscribe(subject, cb=cb)
    await agent.nc.subscribe("reach.v1.cap.echo.agent-a", cb=own_cb)
    await settle(agent.nc)
    for subject in forbidden:
        await agent.violation(f'subscription to "{subject}"')
    # an admin that joins as a participant may publish anything among the callers and
    # agents; the registrar, in the fabric account, reaches none of their subjects
    ops = await login("ops", name="ops" + PARTICIPANT_SUFFIX)
    for sender in (ops.nc, registrar):
        for subject in [
            "reach.v1.cap.echo.agent-b",
            "_INBOX.app.x1",
            "$JS.API.STREAM.INFO.KV_REACH_REGISTRY",
            "$KV.REACH_REGISTRY.agent.x",
            "reach.v1.cap.echo",
            "reach.v1.probe.agent-b",
            "reach.v1.cap.echo.agent-a",
        ]:
            await sender.publish(subject, b"secret")
        await settle(sender)
    await asyncio.sleep(0.3)
    assert len(got) == 0
    assert len(own) == 1


async def test_agent_speaks_only_for_itself(
    login: Callable[..., Awaitable[Peer]], registrar: Client
) -> None:
    agent = await login("svc-a")
    seen, cb = _counter()
    await registrar.subscribe("reach.v1.>", cb=cb)
    await settle(registrar)
    for kind in ("announce", "hb", "bye"):
        await agent.nc.publish(f"reach.v1.{kind}.agent-b", b"forged")
        await agent.nc.publish(f"reach.v1.{kind}.agent-a", b"mine")
    await settle(agent.nc)
    await agent.violation('publish to "reach.v1.hb.agent-b"')
    await agent.violation('publish to "reach.v1.announce.agent-b"')
    await asyncio.sleep(0.2)
    # its heartbeat arrives mapped onto its partition in the fabric account
    assert sorted(m.subject for m in seen) == [
        "reach.v1.announce.agent-a",
        "reach.v1.bye.agent-a",
        subjects.heartbeat_partition(partition_of("agent-a"), "agent-a"),
    ]


async def test_a_caller_writes_audit_batches_and_their_notices_and_nothing_beside(
    login: Callable[..., Awaitable[Peer]], registrar: Client
) -> None:
    app = await login("app")
    seen, cb = _counter()
    await registrar.subscribe("reach.v1.>", cb=cb)
    await settle(registrar)
    await app.nc.publish("reach.v1.audit.echo.app", b"batch")
    await app.nc.publish("reach.v1.audited.echo.app", b"notice")
    # under another client's name, or none: readers would take it for theirs
    await app.nc.publish("reach.v1.audit.echo.other", b"forged")
    await app.nc.publish("reach.v1.audited.echo", b"forged")
    await app.nc.publish("reach.v1.alert.retry_storm", b"forged")
    await settle(app.nc)
    await app.violation('publish to "reach.v1.alert.retry_storm"')
    await app.violation('publish to "reach.v1.audit.echo.other"')
    await app.violation('publish to "reach.v1.audited.echo"')
    await asyncio.sleep(0.2)
    assert sorted(m.subject for m in seen) == [
        "reach.v1.audit.echo.app",
        "reach.v1.audited.echo.app",
    ]
    assert not any(".app" in e for e in app.errors)


async def test_caller_gets_replies_only_on_its_own_inbox(
    login: Callable[..., Awaitable[Peer]],
) -> None:
    app = await login("app")
    _got, cb = _counter()
    await app.nc.subscribe("_INBOX.svc-a.>", cb=cb)
    await app.nc.subscribe("reach.v1.cap.echo", cb=cb)
    await settle(app.nc)
    await app.violation('subscription to "_INBOX.svc-a.>"')
    await app.violation('subscription to "reach.v1.cap.echo"')
    # and it cannot log in with somebody else's inbox prefix: requests get no answer
    other = await login("app", inbox="_INBOX.svc-a")
    with pytest.raises(nats.errors.Error):
        await other.nc.request("reach.v1.registrar.ping", b"", timeout=0.5)
    await other.violation('subscription to "_INBOX.svc-a.')


# -- KV and streams ---------------------------------------------------------------------------


async def test_registrar_creates_buckets(
    login: Callable[..., Awaitable[Peer]], registrar: Client
) -> None:
    kv = await registrar.jetstream().create_key_value(KeyValueConfig(bucket="REACH_REGISTRY"))
    await kv.put("agent.agent-a", b"record")
    ops = await login("ops")  # the registrar role through the callout, too
    keys = await ops.nc.jetstream().create_key_value(KeyValueConfig(bucket="REACH_KEYS"))
    await keys.put("key.k1", b"public")
    assert (await kv.get("agent.agent-a")).value == b"record"
    assert not ops.errors


async def test_caller_reads_the_registry_but_cannot_write_it(
    login: Callable[..., Awaitable[Peer]], registrar: Client
) -> None:
    public = KeyValueConfig(
        bucket="REACH_REGISTRY",
        direct=True,
        republish=RePublish(src="$KV.REACH_REGISTRY.>", dest="reach.v1.kv.REACH_REGISTRY.>"),
    )
    with contextlib.suppress(nats.js.errors.NotFoundError):  # another test's, not public
        await registrar.jetstream().delete_key_value("REACH_REGISTRY")
    kv = await registrar.jetstream().create_key_value(public)
    await kv.put("agent.agent-a", b"v1")
    await registrar.jetstream().create_key_value(KeyValueConfig(bucket="REACH_CREDENTIALS"))
    app = await login("app")
    js = app.nc.jetstream()
    view = await js.key_value("REACH_REGISTRY")
    assert (await view.get("agent.agent-a")).value == b"v1"
    # followed by a scan and the republished changes, no consumer (reach.transport.kvfollow)
    follow = kvfollow.follow(app.nc, "REACH_REGISTRY", ">", asyncio.Event())
    first = await anext(follow)
    assert first is not None
    assert (first.key, first.value) == ("agent.agent-a", b"v1")
    assert await anext(follow) is None  # caught up
    await kv.put("agent.agent-b", b"v2")
    change = await asyncio.wait_for(anext(follow), 3)
    assert change is not None
    assert change.key == "agent.agent-b"
    await follow.aclose()
    # and may create none: a consumer is server state its creator points anywhere
    with pytest.raises(nats.errors.TimeoutError):
        await app.nc.request("$JS.API.CONSUMER.CREATE.KV_REACH_REGISTRY", b"{}", timeout=0.5)
    await app.violation('publish to "$js.api.consumer.create.kv_reach_registry"')

    quick = app.nc.jetstream(timeout=0.5)  # a denied request gets no answer: time out fast
    with pytest.raises(nats.errors.TimeoutError):
        await quick.publish("$KV.REACH_REGISTRY.agent.agent-a", b"forged")
    await app.violation('publish to "$kv.reach_registry.agent.agent-a"')
    for api in ("STREAM.PURGE.KV_REACH_REGISTRY", "STREAM.DELETE.KV_REACH_REGISTRY"):
        with pytest.raises(nats.errors.TimeoutError):
            await app.nc.request(f"$JS.API.{api}", b"", timeout=0.5)
        await app.violation(f'publish to "$js.api.{api.lower()}"')
    with pytest.raises(nats.errors.TimeoutError):
        await quick.key_value("REACH_CREDENTIALS")  # no read of the other buckets
    await app.violation('publish to "$js.api.stream.info.kv_reach_credentials"')
    assert (await kv.get("agent.agent-a")).value == b"v1"


async def test_async_jobs_need_the_flag(
    login: Callable[..., Awaitable[Peer]], registrar: Client
) -> None:
    public = KeyValueConfig(bucket="REACH_JOBS", direct=True)
    jobs = await registrar.jetstream().create_key_value(public)
    # a job of app-jobs run by agent-j: its key names both (reach.agent.jobs.new_job_id)
    key = "job.app-jobs.agent-j.j1"
    worker = await login("svc-jobs")
    # a KV put: publish + JetStream ack on its inbox
    await worker.nc.jetstream().publish(f"$KV.REACH_JOBS.{key}", b"accepted")
    waiter = await login("app-jobs")
    seen = await (await waiter.nc.jetstream().key_value("REACH_JOBS")).get(key)
    assert seen.value == b"accepted"
    assert (await jobs.get(key)).value == b"accepted"

    plain = await login("svc-a")  # an agent without async jobs
    with pytest.raises(nats.errors.Error):
        await plain.nc.jetstream().publish(f"$KV.REACH_JOBS.{key}", b"forged", timeout=0.5)
    await plain.violation(f'publish to "$kv.reach_jobs.{key}"')
    assert (await jobs.get(key)).value == b"accepted"
