"""Fallbacks end to end: when no instance can answer, a cached result, a backup
capability or a default answers instead, within what is left of the call's time; a
client-wide fallback's backup call never falls back itself, and a contract error is never
hidden by a fallback."""

from __future__ import annotations

import asyncio
import time
from contextlib import AsyncExitStack
from typing import Any

import pytest

from reach.agent.context import current_call
from reach.audit import read_events
from reach.audit.reader import AuditFilter
from reach.caller.client import ReachClient
from reach.errors import ContractError, NotFound
from reach.registry import Registrar
from reach.resilience.fallback import NO_FALLBACK, Fallback
from reach.testing import NatsServer
from reach.transport import Connection

from .calls_helpers import REPORT_INPUT, capability, make_agent, wait_routable


async def test_fallbacks_cached_result_backup_capability_and_default_body(
    nats_server: NatsServer, client: ReachClient
) -> None:
    primary, bp = make_agent(nats_server.url, "primary-1", capability("summary", sla_ms=300))
    backup, _ = make_agent(nats_server.url, "backup-1", capability("summary_lite", sla_ms=300))
    cache = Fallback(cache_max_age_sec=60)
    async with AsyncExitStack() as stack:
        await stack.enter_async_context(primary)
        await stack.enter_async_context(backup)
        await wait_routable(client, "summary", 1)
        fresh = await client.call("summary", {"q": 1}, fallback=cache)
        assert not fresh.from_fallback
        bp.sleep = 5.0
        cached = await client.call("summary", {"q": 1}, fallback=cache)
        assert cached.from_fallback
        assert cached.fallback is not None
        assert cached.fallback.source == "cache"
        assert "ReachTimeout" in cached.fallback.reason
        assert cached.value == fresh.value
        backed = await client.call(
            "summary", {"q": 2}, fallback=Fallback(backup_capability="summary_lite")
        )
        assert backed.fallback is not None
        assert backed.fallback.source == "backup"
        assert backed.agent_id == "backup-1"
        default = await client.call(
            "summary", {"q": 3}, fallback=Fallback(default={"summary": None, "stale": True})
        )
        assert default.value == {"summary": None, "stale": True}
        assert default.fallback is not None
        assert default.fallback.source == "default"


async def test_a_call_no_fallback_could_answer_fails_and_is_audited(
    nats_server: NatsServer, client: ReachClient, conn: Connection
) -> None:
    """A cache with nothing in it yet, or a backup that fails too: the call fails with
    its own error, and its audit event says so."""
    with pytest.raises(NotFound):
        await client.call("nobody_serves", {"q": 1}, fallback=Fallback(cache_max_age_sec=60))
    with pytest.raises(NotFound):
        await client.call("nobody_serves", {"q": 2}, fallback=Fallback(backup_capability="none"))
    assert client.audit is not None
    await asyncio.wait_for(client.audit.flush(), 10)
    events = [e async for e in read_events(conn, AuditFilter(capability="nobody_serves"))]
    assert [(e.outcome, e.error, e.fallback) for e in events] == [("error", "discovery", None)] * 2


async def test_fallback_never_hides_a_contract_error(
    nats_server: NatsServer, client: ReachClient
) -> None:
    agent, _ = make_agent(
        nats_server.url, "strict-2", capability("report", input_schema=REPORT_INPUT)
    )
    async with agent:
        await wait_routable(client, "report", 1)
        with pytest.raises(ContractError):
            await client.call("report", {}, fallback=Fallback(default={}))


# -- a client-wide fallback ------------------------------------------------------------


#: a bound on calls whose fallback could recurse or hang: a fallback answers well within it
CALL_BOUND = 15.0


async def test_a_client_wide_fallback_whose_backup_is_missing_returns_the_default(
    nats_server: NatsServer, registrar: Registrar
) -> None:
    """The backup's own call must not fall back again: with the client's Fallback it
    would call the backup, whose failure calls the backup, … (RecursionError)."""
    fb = Fallback(backup_capability="lite", default={"fallback": True})
    async with ReachClient(servers=nats_server.url, fallback=fb) as client:
        result = await asyncio.wait_for(client.call("missing_cap", {}), CALL_BOUND)
    assert result.value == {"fallback": True}
    assert result.fallback is not None
    assert result.fallback.source == "default"
    # the backup was tried once, and its failure is part of the reason
    assert result.fallback.reason.count("backup lite failed") == 1
    assert "NotFound" in result.fallback.reason


async def test_a_client_wide_fallback_uses_its_backup_and_no_fallback_turns_it_off(
    nats_server: NatsServer, registrar: Registrar
) -> None:
    lite, _ = make_agent(nats_server.url, "lite-1", capability("lite"))
    fb = Fallback(backup_capability="lite", default={"fallback": True})
    async with lite, ReachClient(servers=nats_server.url, fallback=fb) as client:
        await wait_routable(client, "lite", 1)
        backed = await asyncio.wait_for(client.call("missing_cap", {"q": 1}), CALL_BOUND)
        assert backed.fallback is not None
        assert backed.fallback.source == "backup"
        assert backed.fallback.backup == "lite"
        assert backed.agent_id == "lite-1"
        assert backed.value == {"by": "lite-1", "echo": {"q": 1}}
        # the sentinel the backup call is made with: this call does not fall back at all
        with pytest.raises(NotFound):
            await asyncio.wait_for(client.call("missing_cap", {}, fallback=NO_FALLBACK), CALL_BOUND)


# -- a backup has what is left of the call's time --------------------------------------


async def test_a_backup_fallback_gets_only_what_is_left_of_the_calls_timeout(
    nats_server: NatsServer, registrar: Registrar
) -> None:
    told: list[float] = []

    async def lite(req: Any) -> Any:
        call = current_call()
        assert call is not None
        assert call.deadline_ms is not None
        told.append(call.deadline_ms / 1000)
        await asyncio.sleep(0.9)  # more than is left once the primary timed out
        return {"lite": True}

    # the primary's attempt times out after 0.3 s (1.5 x its SLA); not idempotent: no retry
    main, slow = make_agent(nats_server.url, "main-1", capability("work", sla_ms=200))
    slow.sleep = 5
    backup, _ = make_agent(nats_server.url, "lite-1", capability("lite", sla_ms=5000), handler=lite)
    fb = Fallback(backup_capability="lite", default={"fallback": True})
    async with main, backup, ReachClient(servers=nats_server.url) as client:
        await wait_routable(client, "work", 1)
        await wait_routable(client, "lite", 1)
        t0 = time.time()
        result = await asyncio.wait_for(client.call("work", {}, timeout=1.0, fallback=fb), 10)
        elapsed = time.time() - t0
    assert result.fallback is not None
    assert result.fallback.source == "default"  # the backup ran out of the call's time
    assert "backup lite failed: ReachTimeout" in result.fallback.reason
    assert result.value == {"fallback": True}
    assert elapsed < 1.5  # not 0.3 s + a second of its own
    (deadline,) = told
    assert deadline <= t0 + 1.05  # the backup's callee was told the call's deadline
