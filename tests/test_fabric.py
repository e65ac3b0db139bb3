"""``reach.fabric.Fabric``, the one way to start a fabric: its servers, token issuer, login gate and
registrar in this process, secured as ``reach up`` secures them; what dies is started
again, everything stops with it, and options that do not fit are refused by name."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from reach.agent.agent import Agent
from reach.caller.client import ReachClient
from reach.errors import AuthenticationFailed, ConfigurationError
from reach.fabric import Fabric
from reach.fabric.embedded import port_in_use
from reach.registry import RegistrarConfig
from reach.security.membership import connect_as
from reach.testing import NatsServer
from reach.wire import subjects

from .conftest import manifest
from .poll_helpers import until

#: a restart (a pause of half a second, a Python-side start) shows within this
RESTART = 15.0


async def _register_and_call(fabric: Fabric, creds: Path, agent_id: str) -> None:
    """An agent with ``creds`` registers and a client with them calls it."""
    agent = Agent(
        manifest(agent_id, "work", interval=1.0, timeout=0.5), servers=fabric.url, credentials=creds
    )

    @agent.capability("work")
    async def work(request: Any) -> Any:
        return {"by": agent_id}

    async with agent, ReachClient(servers=fabric.url, credentials=creds) as client:
        await client.routes.wait_for(lambda c: bool(c.find("work")), timeout=RESTART)
        assert (await client.call("work", {})).value == {"by": agent_id}


async def test_a_fabric_started_here_lets_in_only_credentials_and_stops_everything(
    tmp_path: Path,
) -> None:
    store = tmp_path / "store"
    async with Fabric(store) as fabric:
        (node,) = fabric.nodes
        assert fabric.urls == [node.url]
        assert fabric.registrar_id is not None
        assert fabric.registrar_id.startswith("reg-")
        assert sorted(p.name for p in fabric.created) == ["admin.creds", "dev.creds"]
        for path in (fabric.creds("dev"), fabric.creds("admin"), store / "nats.conf"):
            assert path.stat().st_mode & 0o777 == 0o600
        assert store.stat().st_mode & 0o777 == 0o700
        with pytest.raises(AuthenticationFailed, match="refused an anonymous client"):
            await connect_as(fabric.urls, name="anonymous", credentials=None)
        analyst = await fabric.add_client("analyst", 2)
        assert analyst == store / "analyst.creds"
        await _register_and_call(fabric, fabric.creds("dev"), "fab-1")
        with pytest.raises(ConfigurationError, match="no credentials file"):
            fabric.creds("nobody")
    assert not node.running
    assert not port_in_use(node.port)


async def test_a_second_start_on_the_same_store_keeps_its_credentials(tmp_path: Path) -> None:
    async with Fabric(tmp_path / "store") as fabric:
        dev = fabric.creds("dev").read_bytes()
    async with Fabric(tmp_path / "store") as fabric:
        assert fabric.created == []
        assert fabric.creds("dev").read_bytes() == dev
        await _register_and_call(fabric, fabric.creds("dev"), "fab-again")


async def test_the_gate_forgets_the_connections_of_both_accounts_as_they_close(
    tmp_path: Path,
) -> None:
    """An admin's tool (the fabric's account) and a caller and an agent (the clients'
    account) are remembered by the login gate while connected, for a revocation to
    close, and forgotten once they are gone."""
    async with Fabric(tmp_path / "store") as fabric:
        services = fabric.services
        assert services is not None
        (gate,) = services.gates
        assert gate.revocations is not None
        registry = gate.revocations.registry
        await fabric.add_client("caller-1", 1)
        await fabric.add_client("agent-1", 1, agent_id="a-1", capabilities=["work"])
        conns = [
            (await connect_as(fabric.urls, name="tool", credentials=fabric.creds("admin")))[0],
            (await connect_as(fabric.urls, name="c", credentials=fabric.creds("caller-1")))[0],
            (await connect_as(fabric.urls, name="a", credentials=fabric.creds("agent-1")))[0],
        ]
        for client_id in ("admin", "caller-1", "agent-1"):
            assert registry.connections(client_id), client_id
        for conn in conns:
            await conn.close()
        await until(
            lambda: not any(registry.connections(c) for c in ("admin", "caller-1", "agent-1")),
            "the disconnects of both accounts",
            timeout=5.0,
        )


async def test_a_killed_server_is_started_again_and_the_registrar_part_comes_through(
    tmp_path: Path,
) -> None:
    said: list[str] = []
    async with Fabric(tmp_path / "store", report=said.append) as fabric:
        (node,) = fabric.nodes
        registrar = fabric.registrar
        node.kill()
        await until(lambda: fabric.restarts.get("nats-server") == 1, "a restart", timeout=RESTART)
        assert node.running
        assert said == [f"nats-server exited unexpectedly; starting it again (see {node.log_file})"]
        # the same registrar part, reconnected: logins, registrations and calls work
        assert fabric.registrar is registrar
        await _register_and_call(fabric, fabric.creds("dev"), "fab-after")


async def test_a_registrar_part_whose_connection_closed_for_good_is_started_again(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    said: list[str] = []
    async with Fabric(tmp_path / "store", servers=[nats_server.url], report=said.append) as fabric:
        services = fabric.services
        assert services is not None
        assert services.conn is not None
        await services.conn.close()
        await until(lambda: fabric.restarts.get("registrar") == 1, "a restart", timeout=RESTART)
        assert fabric.services is not services
        assert said == [
            "registrar exited unexpectedly; starting it again"
            " (a connection to NATS was closed for good)"
        ]
        conn, _ = await connect_as(fabric.urls, name="ping", credentials=fabric.creds("dev"))
        try:
            await conn.request(subjects.REGISTRAR_PING, b"", timeout=5.0)
        finally:
            await conn.close()


async def test_unsupervised_the_fabric_ends_when_its_registrar_part_cannot_go_on(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    async with Fabric(tmp_path / "store", servers=[nats_server.url], supervise=False) as fabric:
        services = fabric.services
        assert services is not None
        assert services.conn is not None
        await services.conn.close()
        reason = await asyncio.wait_for(fabric.wait(), RESTART)
        assert "closed for good" in reason


async def test_an_open_fabric_runs_a_registrar_and_issues_no_credentials(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    config = RegistrarConfig(liveness_interval_sec=0.2)
    async with Fabric(
        tmp_path / "open", servers=[nats_server.url], secure=False, registrar=config
    ) as fabric:
        assert fabric.registrar is not None
        assert fabric.registrar.config.liveness_interval_sec == 0.2
        assert fabric.created == []
        with pytest.raises(ConfigurationError, match="no credentials"):
            await fabric.add_client("someone", 1)
        async with ReachClient(servers=fabric.url) as client:
            assert client.connection is not None


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"cluster": 2}, "cluster 2"),
        ({"servers": ["nats://127.0.0.1:4222"], "port": 4222}, "servers="),
        ({"servers": ["nats://127.0.0.1:4222"], "cluster": 3}, "servers="),
        ({"servers": []}, "servers= is empty"),
        ({"replicas": 3}, "replicas 3"),
        ({"secure": False, "logins": True}, "logins need secure"),
        ({"cluster": 3, "secure": False}, "a cluster started here runs with logins"),
        ({"registrar_part": "child-process", "secure": False}, "child process"),
        ({"registrar_part": "child-process", "registrar": RegistrarConfig()}, "child process"),
        ({"servers": ["nats://127.0.0.1:4222"], "registrar_part": "none"}, "nothing to start"),
    ],
)
def test_options_that_do_not_fit_are_refused_by_name(
    tmp_path: Path, options: dict[str, Any], named: str
) -> None:
    with pytest.raises(ConfigurationError, match=named):
        Fabric(tmp_path / "store", **options)


async def test_a_busy_port_is_named(nats_server: NatsServer, tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match=f"port {nats_server.port} .* in use"):
        await Fabric(tmp_path / "store", port=nats_server.port).start()
