"""An Agent and a ReachClient given a connection: a reach Connection or a connected
nats-py client, on an open and on a secured fabric. Whoever opened the connection closes
it: the agent and the client leave it open."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import nats
import nats.errors
import pytest
from nats.aio.client import Client as NatsClient

from reach.agent.agent import Agent
from reach.audit import AuditFilter, read_events
from reach.caller.client import ReachClient
from reach.errors import ConfigurationError, PermissionDenied
from reach.registry import Registrar
from reach.security.credentials import CredentialsFile
from reach.security.membership import connect_as
from reach.testing import NatsServer
from reach.transport import Connection, connect
from reach.transport.adopt import adopt
from reach.wire import subjects

from .conftest import Fabric
from .up_helpers import Secured

#: the environment of `reach` runs: not the developer's fabric
CLEAN_ENV = {k: v for k, v in os.environ.items() if k not in ("REACH_URL", "REACH_CREDS")}


def echo_agent(agent_id: str, capability: str = "echo", level: int = 1, **kwargs: Any) -> Agent:
    """An agent whose one capability answers with what it was sent and who it is."""
    manifest = {
        "agent_id": agent_id,
        "agent_name": "echo",
        "version": "1.0.0",
        "capabilities": [
            {"name": capability, "tags": ["echo"], "latency_sla_ms": 500, "security_level": level}
        ],
        "health": {"interval_sec": 0.5, "timeout_sec": 0.3, "failures_before_unhealthy": 2},
    }
    agent = Agent(manifest, **kwargs)

    @agent.capability(capability)
    async def echo(request: Any) -> Any:
        return {"by": agent_id, "echo": request}

    return agent


async def call_through(client: ReachClient, capability: str = "echo") -> None:
    await client.routes.wait_for(lambda c: bool(c.find(capability)), timeout=5)
    result = await client.call(capability, {"n": 1})
    assert result.value["echo"] == {"n": 1}


async def test_an_agent_and_a_client_share_one_reach_connection(
    nats_server: NatsServer, registrar: Registrar
) -> None:
    conn = await connect([nats_server.url], name="shared")
    try:
        async with (
            echo_agent("shared-1", connection=conn) as agent,
            ReachClient(connection=conn) as client,
        ):
            assert agent.connection is conn
            assert client.connection is conn
            await call_through(client)
            # the audit writer writes over the same connection: nothing else is opened
            assert client.audit is not None
            await client.audit.flush()
            assert client.audit.written >= 1
        # both stopped: the connection they were given is still open and serves others
        assert conn.is_connected
        async with echo_agent("shared-2", connection=conn), ReachClient(connection=conn) as again:
            await call_through(again)
        assert conn.is_connected
    finally:
        await conn.close()


async def test_a_connected_nats_py_client_is_adopted_once_and_left_open(
    nats_server: NatsServer, registrar: Registrar
) -> None:
    nc = await nats.connect(nats_server.url, name="raw")
    try:
        async with (
            echo_agent("raw-1", connection=nc) as agent,
            ReachClient(connection=nc) as client,
        ):
            # one wrapper for both: one request inbox, one list of reconnect listeners
            assert agent.connection is client.connection is adopt(nc)
            await call_through(client)
        assert nc.is_connected
        # what the agent subscribed to went with it: the connection stays, its calls not
        for subject in (subjects.capability("echo"), subjects.capability_instance("echo", "raw-1")):
            with pytest.raises(nats.errors.NoRespondersError):
                await nc.request(subject, b"", timeout=2)
    finally:
        await nc.close()


async def test_calls_over_a_given_connection_are_audited(
    nats_server: NatsServer, registrar: Registrar
) -> None:
    conn = await connect([nats_server.url], name="audited")
    try:
        async with echo_agent("audited-1", connection=conn), ReachClient(connection=conn) as c:
            await call_through(c)
            assert c.audit is not None
            await c.audit.flush()
            events = [e async for e in read_events(conn, AuditFilter(capability="echo"))]
            assert [(e.outcome, e.callee) for e in events] == [("ok", "audited-1")]
    finally:
        await conn.close()


async def test_on_a_secured_fabric_a_shared_connection_carries_checked_tokens(
    fabric: Fabric,
) -> None:
    creds = fabric.creds["vault"]
    conn, _ = await connect_as([fabric.url], name="vault", credentials=creds)
    try:
        async with (
            echo_agent("vault-1", "customer_orders", level=3, connection=conn, credentials=creds),
            ReachClient(connection=conn, credentials=creds) as client,
        ):
            await call_through(client, "customer_orders")
            # the call carried a token the agent checked: the fabric issues them here
            assert client._security.own is not None
        assert conn.is_connected
    finally:
        await conn.close()


async def test_on_a_secured_fabric_a_nats_py_client_logged_in_as_a_client_works(
    fabric: Fabric,
) -> None:
    creds = CredentialsFile.read(fabric.creds["auditor"])
    nc = await nats.connect(
        fabric.url,
        user=creds.client_id,
        password=creds.secret,
        inbox_prefix=f"_INBOX.{creds.client_id}",
    )
    try:
        async with (
            echo_agent(
                "vault-1",
                "customer_orders",
                level=3,
                servers=fabric.url,
                credentials=fabric.creds["vault"],
            ),
            ReachClient(connection=nc, credentials=fabric.creds["auditor"]) as client,
        ):
            await call_through(client, "customer_orders")
        assert nc.is_connected
    finally:
        await nc.close()


async def test_what_cannot_be_adopted_is_refused_with_a_clear_error(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    with pytest.raises(ConfigurationError, match="not connected"):
        adopt(NatsClient())
    with pytest.raises(ConfigurationError, match="not str"):
        adopt("nats://127.0.0.1:4222")  # type: ignore[arg-type]
    closed = await connect([nats_server.url], name="closed")
    await closed.close()
    with pytest.raises(ConfigurationError, match="closed Connection"):
        adopt(closed)
    with pytest.raises(ConfigurationError, match="closed Connection"):
        await ReachClient(connection=closed).connect()


async def test_a_reach_connection_is_adopted_as_it_is(conn: Connection) -> None:
    assert adopt(conn) is conn


async def test_an_adopted_nats_py_client_tells_its_wrapper_of_reconnects(
    nats_server: NatsServer,
) -> None:
    theirs = asyncio.Event()

    async def reconnected() -> None:
        theirs.set()

    nc = await nats.connect(
        nats_server.url,
        reconnect_time_wait=0.1,
        max_reconnect_attempts=-1,
        reconnected_cb=reconnected,
    )
    try:
        conn = adopt(nc)
        ours = asyncio.Event()
        conn.on_reconnect(ours.set)
        await asyncio.to_thread(nats_server.restart)
        # the wrapper hears of it (route cache, audit writer, calls follow reconnects), and
        # the callback the client was connected with still runs
        await asyncio.wait_for(asyncio.gather(ours.wait(), theirs.wait()), 10)
        assert conn.reconnects == 1
    finally:
        await nc.close()


async def test_an_adopted_nats_py_client_reports_refusals_as_permission_denied(
    secured: Secured,
) -> None:
    creds = CredentialsFile.read(secured.watcher)
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    nc = await nats.connect(
        secured.url,
        user=creds.client_id,
        password=creds.secret,
        inbox_prefix=f"_INBOX.{creds.client_id}",
        error_cb=on_error,
    )
    try:
        conn = adopt(nc)
        # only the registrar probes agents: the server refuses the caller's request, and
        # the request ends as that refusal, not as a timeout
        with pytest.raises(PermissionDenied, match=r"reach\.v1\.probe\.a-1"):
            await conn.request(subjects.probe("a-1"), b"", timeout=5)
        assert any("permissions violation" in e.lower() for e in errors)  # theirs heard it too
    finally:
        await nc.close()


async def test_on_a_fabric_reach_up_started_a_shared_and_a_nats_py_connection_call(
    secured: Secured,
) -> None:
    """NATS permissions hold each login to its own inbox and subjects: an agent and a
    client sharing the agent's connection, and a caller's nats-py client, all call."""
    conn, _ = await connect_as([secured.url], name="a-1", credentials=secured.agent)
    creds = CredentialsFile.read(secured.watcher)
    nc = await nats.connect(
        secured.url,
        user=creds.client_id,
        password=creds.secret,
        inbox_prefix=f"_INBOX.{creds.client_id}",
    )
    try:
        async with (
            echo_agent("a-1", level=2, connection=conn, credentials=secured.agent),
            ReachClient(connection=conn, credentials=secured.agent) as shared,
            ReachClient(connection=nc, credentials=secured.watcher) as caller,
        ):
            await call_through(shared)
            await call_through(caller)
            assert caller.audit is not None
            await caller.audit.flush()
            assert caller.audit.written >= 1
            assert caller.audit.dropped == 0
        assert conn.is_connected
        assert nc.is_connected
    finally:
        await nc.close()
        await conn.close()
