"""Connections that never give up: agents and clients come back after the server restarts
while the login gate is down, and say why they cannot log in meanwhile."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from reach.agent import Agent
from reach.client import ReachClient
from reach.registry import Registrar, RegistrarConfig
from reach.security import natsconf
from reach.security.gate import LoginGate
from reach.security.issuer import TokenService, ensure_first_credentials
from reach.testing import NatsServer
from reach.transport import Connection, connect

from .calls_helpers import Behaviour, capability, make_agent


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

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def dev(self) -> Path:
        return self.store / "dev.creds"

    async def start_gate(self) -> None:
        assert self.gate is None and self.issuer.credentials is not None
        self.gate = LoginGate(self.setup, self.issuer.credentials)
        await self.gate.start([self.url])

    async def stop_gate(self) -> None:
        if self.gate is not None:
            await self.gate.stop()
            self.gate = None


@pytest.fixture
async def secure(tmp_path: Path) -> AsyncIterator[SecureFabric]:
    store = tmp_path / "store"
    store.mkdir()
    server = NatsServer(store_dir=store / "nats")
    setup = natsconf.prepare(store)
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


async def _until(condition: Callable[[], Awaitable[bool]], timeout: float, what: str) -> None:
    """Wait until ``condition()`` holds, checking every 0.1 s, for at most ``timeout`` s."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await condition():
        if loop.time() > deadline:
            raise AssertionError(f"not within {timeout:g}s: {what}")
        await asyncio.sleep(0.1)


async def test_agents_and_clients_come_back_after_a_restart_while_the_gate_was_down(
    secure: SecureFabric, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="reach")
    agents = [await _secure_agent(secure, f"worker-{i}") for i in range(2)]
    client = ReachClient(servers=secure.url, credentials=secure.dev)
    await client.connect()
    try:
        async def listed() -> bool:
            ids = {i.agent_id for i in client.routes.find("work")}
            return ids == {"worker-0", "worker-1"}

        await _until(listed, 5.0, "the route cache lists every agent")
        assert await client.call("work", {"n": 1}) is not None

        await secure.stop_gate()
        secure.server.kill()
        await secure.server.start()
        # logins are refused (nobody answers the callout) for a while
        await asyncio.sleep(8.0)
        await secure.start_gate()

        async def all_back() -> bool:
            conns = [client.connection, *(agent.connection for agent, _ in agents)]
            return all(c.is_connected for c in conns)

        await _until(all_back, 15.0, "every agent and the client reconnected")

        await _until(listed, 10.0, "the route cache lists every agent")
        for _ in range(20):
            await client.call("work", {"n": 2})
        assert all(served.calls > 1 for _, served in agents)
    finally:
        await client.close()
        for agent, _ in agents:
            await agent.stop()
