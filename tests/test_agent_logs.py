"""What an agent says while its fabric goes away and comes back: the lost connection and
the reconnect are logged, with the agent's id (losing it as a warning), rather than
passing in silence."""

from __future__ import annotations

import asyncio
import logging

import pytest

from reach.caller.client import ReachClient
from reach.testing import NatsServer

from .calls_helpers import make_agent, wait_routable
from .poll_helpers import until


async def test_an_agent_logs_losing_its_fabric_and_getting_it_back(
    nats_server: NatsServer, client: ReachClient, caplog: pytest.LogCaptureFixture
) -> None:
    agent, _ = make_agent(nats_server.url, "logged-1")
    async with agent:
        await wait_routable(client, "work", 1)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="reach.transport"):
            await asyncio.to_thread(nats_server.restart)
            await until(
                lambda: any(
                    "logged-1" in r.getMessage() and "reconnected to NATS after" in r.getMessage()
                    for r in caplog.records
                ),
                "the agent logged its reconnect",
                timeout=20,
            )
        lost = [
            r
            for r in caplog.records
            if "logged-1" in r.getMessage() and "disconnected from NATS" in r.getMessage()
        ]
        assert lost
        assert lost[0].levelno == logging.WARNING
        back = await client.call("work", {})
        assert back.agent_id == "logged-1"
        caplog.clear()
    # stopping says nothing of a lost connection
    assert not [r for r in caplog.records if "disconnected from NATS" in r.getMessage()]
