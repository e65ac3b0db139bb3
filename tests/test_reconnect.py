"""Connections that never give up: agents and clients come back after the server restarts
while the login gate is down, and say why they cannot log in meanwhile."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from reach.agent.agent import Agent
from reach.caller.client import ReachClient
from reach.errors import (
    AuthenticationFailed,
    ConfigurationError,
    Disconnected,
    LoginUnanswered,
    ReachError,
    ReachTimeout,
)
from reach.fabric.embedded import free_port
from reach.registry import Registrar, RegistrarConfig
from reach.security import natsconf
from reach.security.gate import LoginGate
from reach.security.issuer import TokenService, ensure_first_credentials
from reach.security.membership import connect_as
from reach.settings import resolve_reconnect_for
from reach.testing import NatsServer
from reach.transport import Connection, connect, link
from reach.wire import subjects

from .calls_helpers import Behaviour, capability, make_agent
from .conftest import Fabric
from .poll_helpers import until


@dataclass
class SecureFabric:
    """A fabric secured as `reach up` secures it (auth callout, login gate), run in this
    process so that a test can stop its gate and restart its server."""

    server: NatsServer
    setup: natsconf.SecureSetup
    store: Path
    conn: Connection
    issuer: TokenService
    registrar: Registrar
    gate: LoginGate | None = None
    #: where the gate connects (None: the one server)
    gate_servers: list[str] | None = None

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def dev(self) -> Path:
        return self.store / "dev.creds"

    async def start_gate(self) -> None:
        assert self.gate is None
        assert self.issuer.credentials is not None
        self.gate = LoginGate(self.setup, self.issuer.credentials)
        await self.gate.start(self.gate_servers or [self.url])

    async def stop_gate(self) -> None:
        if self.gate is not None:
            await self.gate.stop()
            self.gate = None


@pytest.fixture
def auth_timeout() -> float | None:
    """The server's wait for the login gate's answer (None: ``reach up``'s)."""
    return None


@pytest.fixture
async def secure(tmp_path: Path, auth_timeout: float | None) -> AsyncIterator[SecureFabric]:
    store = tmp_path / "store"
    store.mkdir()
    server = NatsServer(store_dir=store / "nats")
    setup = natsconf.prepare(store)
    if auth_timeout is not None:
        setup = dataclasses.replace(setup, auth_timeout=auth_timeout)
    server.config_file = natsconf.write_config(
        setup, store / "nats.conf", port=server.port, store_dir=None
    )
    await server.start()
    conn = await connect(
        [server.url],
        name="reach-up",
        user=setup.registrar_user.name,
        password=setup.registrar_user.password,
    )
    issuer = TokenService(conn, key_file=store / "signing.key")
    await issuer.start()
    await ensure_first_credentials(issuer, store, server.url)
    registrar = Registrar(conn, RegistrarConfig(liveness_interval_sec=0.2))
    fabric = SecureFabric(server, setup, store, conn, issuer, registrar)
    await fabric.start_gate()
    await registrar.start()
    try:
        yield fabric
    finally:
        await registrar.stop()
        await fabric.stop_gate()
        await issuer.stop()
        await conn.close()
        server.cleanup()


async def _secure_agent(fabric: SecureFabric, agent_id: str) -> tuple[Agent, Behaviour]:
    agent, served = make_agent(fabric.url, agent_id, capability("work", idempotent=True))
    agent.credentials = fabric.dev
    await agent.start()
    return agent, served


def _chain(exc: BaseException) -> str:
    """The messages of ``exc`` and of its causes."""
    said = []
    seen: BaseException | None = exc
    while seen is not None:
        said.append(f"{type(seen).__name__}: {seen}")
        seen = seen.__cause__
    return " <- ".join(said)


async def test_agents_and_clients_come_back_after_a_restart_while_the_gate_was_down(
    secure: SecureFabric,
) -> None:
    """The server restarts while the login gate is down: every login is refused (or
    not answered) until the gate is back. Nobody gives up; meanwhile a call says why it
    fails; afterwards the evicted agents are registered again and serve calls."""
    agents = [await _secure_agent(secure, f"worker-{i}") for i in range(2)]
    client = ReachClient(servers=secure.url, credentials=secure.dev)
    await client.connect()
    try:

        async def listed() -> bool:
            ids = {i.agent_id for i in client.routes.find("work")}
            return ids == {"worker-0", "worker-1"}

        await until(listed, "the route cache lists every agent", timeout=5.0)
        assert await client.call("work", {"n": 1}) is not None

        await secure.stop_gate()
        secure.server.kill()
        await secure.server.start()
        down = client.connection.link

        async def login_failed() -> bool:
            return down.refused is not None or down.unanswered is not None

        await until(login_failed, "a login of the client failed", timeout=15.0)
        with pytest.raises(ReachError) as failed:
            await client.call("work", {"n": 2}, timeout=1.0)
        said = _chain(failed.value)
        assert "login of user 'dev'" in said, said
        assert "reach up" in said, said
        assert "still retrying" in said, said
        await asyncio.sleep(2.0)  # the gate stays away a while longer: logins still fail
        await secure.start_gate()

        async def all_back() -> bool:
            conns = [client.connection, *(agent.connection for agent, _ in agents)]
            return all(c.is_connected for c in conns)

        await until(all_back, "every agent and the client reconnected", timeout=15.0)
        await until(listed, "the route cache lists every agent", timeout=10.0)
        for _ in range(20):
            await client.call("work", {"n": 3})
        assert all(served.calls > 1 for _, served in agents)
        assert not any(c.is_closed for c in (client.connection, secure.conn))
    finally:
        await client.close()
        for agent, _ in agents:
            await agent.stop()


async def test_a_login_no_gate_answers_is_sent_again_before_the_servers_timeout(
    secure: SecureFabric,
) -> None:
    """A restarted server sends a login it gets before the gate is back to nobody, and
    refuses it only at its auth timeout. A reconnecting client gives such a login up
    sooner and sends it again, waiting longer each time (a gate slow under a crowd of
    logins is not sent each again and again), and is in once the gate is back."""
    conn, _ = await connect_as([secure.url], name="patient", credentials=secure.dev)
    try:
        await secure.stop_gate()
        secure.server.kill()
        await secure.server.start()
        waits: list[float] = []

        async def two_unanswered() -> bool:
            waited = conn.link.unanswered
            if waited is not None and (not waits or waits[-1] != waited):
                waits.append(waited)
            return len(waits) >= 2

        await until(two_unanswered, "two logins went unanswered", timeout=20.0)
        auth_timeout = secure.setup.auth_timeout
        assert waits[0] < auth_timeout - 1.0, waits  # given up before the server's timeout
        assert waits[1] > waits[0] + 1.0, waits
        await secure.start_gate()

        async def back() -> bool:
            return conn.is_connected

        await until(back, "the client logged in again", timeout=15.0)
    finally:
        await conn.close()


async def test_the_login_gate_is_back_as_soon_as_its_server_is(secure: SecureFabric) -> None:
    """The gate's connection does not back off as clients' do: a server that has been
    down a while and comes back has its gate at once, so the logins it gets are answered
    rather than sent to nobody."""
    assert secure.gate is not None
    assert secure.gate.connection is not None
    gate = secure.gate.connection
    secure.server.kill()
    await asyncio.sleep(1.5)  # long enough for a backing-off client to wait seconds
    await secure.server.start()

    async def gate_back() -> bool:
        return gate.is_connected

    await until(gate_back, "the login gate reconnected", timeout=0.5)
    conn, _ = await connect_as([secure.url], name="right-after", credentials=secure.dev)
    await conn.close()


@pytest.mark.parametrize("auth_timeout", [2.0])
async def test_a_fresh_connect_and_an_agent_start_name_the_login_while_the_gate_is_down(
    secure: SecureFabric,
) -> None:
    """What `reach agents` (a fresh connect) and a new agent say while no gate answers:
    the login, at once, not a KV timeout after seconds."""
    await secure.stop_gate()
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(LoginUnanswered) as fresh:
        await connect_as([secure.url], name="cli", credentials=secure.dev)
    assert loop.time() - started < 2 * 2.0 + 2.0  # a login sent twice, no more
    said = str(fresh.value)
    assert "user 'dev'" in said, said
    assert "login gate" in said, said
    assert "reach up" in said, said

    agent, _ = make_agent(secure.url, "late-1", capability("work"))
    agent.credentials = secure.dev
    agent._join_timeout = 1.0  # one attempt: the gate does not come back here
    with pytest.raises(LoginUnanswered) as joining:
        await agent.start()
    said = str(joining.value)
    assert said.startswith("late-1 cannot join the fabric: connect and log in to NATS: "), said
    assert "login gate" in said, said

    # a wrong secret is refused at once by a gate that runs, as ever
    await secure.start_gate()
    wrong = secure.store / "wrong.creds"
    wrong.write_text(secure.dev.read_text().replace('"secret": "', '"secret": "x'))
    wrong.chmod(0o600)
    started = loop.time()
    with pytest.raises(AuthenticationFailed, match="check the credentials file"):
        await connect_as([secure.url], name="cli", credentials=wrong)
    assert loop.time() - started < 2.0


async def test_an_expired_login_logs_in_again(
    secure: SecureFabric, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server ends a login when its lifetime ends (User Authentication Expired);
    the connection logs in again instead of closing for good."""
    from reach.security import gate

    await secure.stop_gate()
    monkeypatch.setattr(gate, "USER_TTL_SEC", 1.0)
    await secure.start_gate()
    conn, _ = await connect_as([secure.url], name="short-lived", credentials=secure.dev)
    try:

        async def logged_in_again() -> bool:
            return conn.reconnects >= 2 and conn.is_connected

        await until(logged_in_again, "two expired logins renewed", timeout=10.0)
        assert not conn.is_closed
        registry = await conn.key_value(subjects.REGISTRY_BUCKET, create=False, public=True)
        assert await registry.get("no-such-key") is None
    finally:
        await conn.close()


async def test_a_connection_gives_up_after_reconnect_for(nats_server: NatsServer) -> None:
    conn = await connect([nats_server.url], name="brief", reconnect_for=0.5)
    try:
        nats_server.kill()

        async def gave_up() -> bool:
            return conn.is_closed

        await until(gave_up, "the connection gave up", timeout=5.0)
        with pytest.raises(Disconnected, match=r"gave up reconnecting after 0\.5s"):
            await conn.request("anything", b"", timeout=0.5)
    finally:
        await conn.close()


def test_reconnect_for_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("REACH_RECONNECT_FOR", raising=False)
    assert resolve_reconnect_for() is None
    assert resolve_reconnect_for(3) == 3.0
    for forever in ("forever", "", "inf"):
        monkeypatch.setenv("REACH_RECONNECT_FOR", forever)
        assert resolve_reconnect_for() is None
    monkeypatch.setenv("REACH_RECONNECT_FOR", "30s")
    assert resolve_reconnect_for() == 30.0
    for bad in ("-1", "0", "soon"):
        monkeypatch.setenv("REACH_RECONNECT_FOR", bad)
        with pytest.raises(ConfigurationError, match="REACH_RECONNECT_FOR"):
            resolve_reconnect_for()


def test_each_state_change_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    async def run() -> None:
        state = link.Link("svc", ["nats://x:1"], "dev", None)
        state.disconnected()
        for _ in range(5):
            state.disconnected()
            state.attempt_failed(ConnectionRefusedError(111, "refused"), None, False)
        for _ in range(5):
            state.attempt_failed(TimeoutError(), 4.0, True)
        assert "did not answer the login of user 'dev' in 4.0s" in state.describe()
        for _ in range(5):
            state.attempt_failed(Exception("nats: 'Authorization Violation'"), 5.0, False)
        assert state.refused == "Authorization Violation"
        assert not state.credentials_refused
        assert "after 5.0s without an answer from the login gate" in state.describe()
        state.reconnected()
        assert not state.down

    caplog.set_level(logging.INFO, logger="reach.transport")
    asyncio.run(run())
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 4, said  # disconnected, unanswered, refused, reconnected


@dataclass
class SecureCluster:
    nodes: list[NatsServer]
    fabric: SecureFabric

    @property
    def urls(self) -> list[str]:
        return [node.url for node in self.nodes]


@pytest.fixture
async def secure_cluster(tmp_path: Path) -> AsyncIterator[SecureCluster]:
    """Three nats-servers as one JetStream cluster, secured as `reach up --cluster 3`
    secures it, with one login gate answering for all (the callout crosses the routes)."""
    from reach.fabric.services import cluster_ready as _cluster_ready

    store = tmp_path / "store"
    store.mkdir()
    setup = natsconf.prepare(store)
    password = natsconf.route_user(store).password
    members = [
        natsconf.ClusterNode(f"node-{i}", "127.0.0.1", free_port(), free_port()) for i in range(3)
    ]
    nodes = []
    for i, member in enumerate(members):
        node = NatsServer(store_dir=store / member.name, port=member.port, name=member.name)
        node.config_file = natsconf.write_config(
            setup,
            store / f"{member.name}.conf",
            port=member.port,
            store_dir=None,
            server_name=member.name,
            cluster=natsconf.ClusterPeers.of(members, i, password),
        )
        nodes.append(node)
    try:
        await asyncio.gather(*(node.start(timeout=30.0) for node in nodes))
        urls = [node.url for node in nodes]
        user = setup.registrar_user
        conn = await connect(urls, name="reach-up", user=user.name, password=user.password)
        await _cluster_ready(conn, 3)
        issuer = TokenService(conn, key_file=store / "signing.key", replicas=3)
        await issuer.start()
        await ensure_first_credentials(issuer, store, urls[0])
        registrar = Registrar(conn, RegistrarConfig(replicas=3, liveness_interval_sec=0.2))
        fabric = SecureFabric(nodes[0], setup, store, conn, issuer, registrar)
        fabric.gate_servers = urls
        await fabric.start_gate()
        await registrar.start()
        try:
            yield SecureCluster(nodes, fabric)
        finally:
            await registrar.stop()
            await fabric.stop_gate()
            await issuer.stop()
            await conn.close()
    finally:
        for node in nodes:
            node.cleanup()


@pytest.mark.slow
async def test_a_cluster_node_lost_while_logins_are_refused(
    secure_cluster: SecureCluster,
) -> None:
    """The node an agent and a client are connected to dies while no gate answers: the
    other nodes (which they learnt of from the first) refuse their logins for a few
    seconds, then let them in; they are registered again and serve calls."""
    fabric = secure_cluster.fabric
    first = secure_cluster.urls[0]
    agent, served = make_agent(first, "roamer-1", capability("work", idempotent=True))
    agent.credentials = fabric.dev
    await agent.start()
    client = ReachClient(servers=first, credentials=fabric.dev)
    await client.connect()
    try:

        async def listed() -> bool:
            return [i.agent_id for i in client.routes.find("work")] == ["roamer-1"]

        await until(listed, "the route cache lists the agent", timeout=10.0)
        await client.call("work", {"n": 1})

        await fabric.stop_gate()
        secure_cluster.nodes[0].kill()
        conns = [client.connection, agent.connection]

        async def refused() -> bool:
            return all(c.link.refused is not None or c.link.unanswered for c in conns)

        await until(refused, "the other nodes refused the logins", timeout=15.0)
        fabric.gate_servers = secure_cluster.urls[1:]
        await fabric.start_gate()

        async def back() -> bool:
            return all(c.is_connected for c in conns)

        await until(back, "the agent and the client logged in to another node", timeout=15.0)
        assert all(c.connected_url != first for c in conns)
        await until(listed, "the route cache lists the agent", timeout=15.0)
        calls = served.calls
        for _ in range(10):
            await client.call("work", {"n": 2})
        assert served.calls >= calls + 10
    finally:
        await client.close()
        await agent.stop()


async def test_a_join_step_that_times_out_is_tried_again_then_named(
    fabric: Fabric, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The key follow of REACH_KEYS timing out right after a node loss (a bare
    TimeoutError from its wait) is tried again within the join's deadline; if it never
    catches up, the agent's error is a ReachTimeout naming the step."""
    from reach.agent import agent as agent_module

    real_join = agent_module.FabricSecurity.join
    timeouts = [1]

    async def join_late(*args: Any, **kwargs: Any) -> Any:
        if timeouts[0] > 0:
            timeouts[0] -= 1
            raise TimeoutError
        return await real_join(*args, **kwargs)

    monkeypatch.setattr(agent_module.FabricSecurity, "join", join_late)
    agent, _ = make_agent(fabric.url, "vault-1", capability("customer_orders", level=3))
    agent.credentials = fabric.creds["vault"]
    await agent.start()
    await agent.stop()
    assert timeouts == [0]

    timeouts[0] = 1000
    agent._join_timeout = 0.5
    with pytest.raises(ReachTimeout) as caught:
        await agent.start()
    said = str(caught.value)
    assert said.startswith(
        "vault-1 cannot join the fabric: token session and key follow (REACH_KEYS): no answer"
    ), said
    assert isinstance(caught.value.__cause__, TimeoutError)
