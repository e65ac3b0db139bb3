"""Regressions found in review, on the caller's side: a client-wide fallback with a
backup, heartbeats during a call, an agent with no registrar, and where to connect
when only a credentials file says so."""

from __future__ import annotations

import ast
import asyncio
import sys
from pathlib import Path
from typing import Any

import pytest

from reach.agent import Agent
from reach.client import ReachClient
from reach.errors import DiscoveryError, NotFound
from reach.fallback import Fallback
from reach.models import Instance, Manifest
from reach.registry import Registrar
from reach.registry.routecache import RouteCache
from reach.security.credentials import CredentialsFile
from reach.settings import DEFAULT_URL, resolve_servers
from reach.testing import NatsServer

from .calls_helpers import capability, make_agent, wait_routable

#: a bound on calls that used to recurse or hang: a fallback answers in well under it
CALL_BOUND = 15.0


# -- 1. a client-wide Fallback with a backup ---------------------------------------------


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
    from reach.fallback import NO_FALLBACK  # new with the fix

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


# -- 2. a heartbeat during a call keeps its candidates -----------------------------------


def _instance(heartbeat_at: float, caps: list[dict[str, Any]], agent_id: str = "one-1") -> Instance:
    manifest = Manifest.model_validate(
        {"agent_id": agent_id, "agent_name": "one", "version": "1.0.0", "capabilities": caps}
    )
    return Instance.model_validate(
        {
            "manifest": manifest,
            "instance_id": f"{agent_id}-i",
            "registered_at": 1.0,
            "last_heartbeat_at": heartbeat_at,
        }
    )


def test_an_updated_record_keeps_the_list_a_call_holds() -> None:
    """A call holds ``entries()``'s own list (the index's); a new revision of the same
    instance (a heartbeat) must update it in place, not empty it and index a new one."""
    cache = RouteCache(store=None)  # type: ignore[arg-type]  # _apply needs no store
    caps = [{"name": "slow", "tags": ["t"]}]
    cache._apply("one-1", _instance(1.0, caps), 1)
    held = cache.entries("slow")
    held_tagged = cache.entries("slow", ["t"])
    assert [e.agent_id for e in held] == ["one-1"]
    assert [e.agent_id for e in held_tagged] == ["one-1"]

    cache._apply("one-1", _instance(2.0, caps), 2)  # the heartbeat
    for now, before in ((cache.entries("slow"), held), (cache.entries("slow", ["t"]), held_tagged)):
        assert now is before  # still the index's list
        assert [e.agent_id for e in before] == ["one-1"]
        assert before[0].instance.last_heartbeat_at == 2.0  # with the new record
    assert [i.last_heartbeat_at for i in cache.for_capability("slow", ["t"])] == [2.0]
    assert cache.find(tags=["t"])[0].last_heartbeat_at == 2.0


def test_an_updated_record_still_leaves_what_it_no_longer_offers() -> None:
    cache = RouteCache(store=None)  # type: ignore[arg-type]  # _apply needs no store
    cache._apply(
        "one-1", _instance(1.0, [{"name": "slow", "tags": ["t", "u"]}, {"name": "other"}]), 1
    )
    cache._apply("one-1", _instance(2.0, [{"name": "slow", "tags": ["u"]}]), 2)
    assert [e.agent_id for e in cache.entries("slow")] == ["one-1"]
    assert [e.agent_id for e in cache.entries("slow", ["u"])] == ["one-1"]
    assert list(cache.entries("slow", ["t"])) == []
    assert list(cache.entries("other")) == []
    assert cache.find(tags=["t"]) == []
    assert [i.agent_id for i in cache.find(tags=["u"])] == ["one-1"]
    cache._apply("one-1", None, 3)  # deregistered: gone from every index
    assert list(cache.entries("slow")) == []
    assert list(cache.entries("slow", ["u"])) == []


async def test_a_call_retried_across_heartbeats_still_finds_its_instance(
    nats_server: NatsServer, registrar: Registrar
) -> None:
    """One instance taking one call at a time, heartbeating every 50 ms: a second call
    is refused (over capacity) while the first runs, and its retry must find the
    instance again, not an emptied candidate list (NotFound: a call by tag cannot fall
    back on the capability's queue subject)."""
    tags = ("t",)
    busy = asyncio.Event()

    async def slow(req: dict[str, float]) -> dict[str, bool]:
        if req["s"]:
            busy.set()
        await asyncio.sleep(req["s"])
        return {"ok": True}

    agent, _ = make_agent(
        nats_server.url,
        "one-1",
        capability("slow", sla_ms=3000, tags=("t",)),
        max_concurrency=1,
        handler=slow,
        health={"interval_sec": 0.05, "timeout_sec": 1.0, "failures_before_unhealthy": 5},
    )
    async with agent, ReachClient(servers=nats_server.url) as client:
        await wait_routable(client, "slow", 1)
        first = asyncio.create_task(client.call("slow", {"s": 0.5}, tags=tags))
        try:
            await asyncio.wait_for(busy.wait(), 5)  # the first call holds the only slot
            changes = client.routes.changes
            second = await client.call("slow", {"s": 0.0}, tags=tags, timeout=5)
            assert client.routes.changes > changes  # heartbeats did arrive meanwhile
            assert second.value == {"ok": True}
            assert second.agent_id == "one-1"
            assert second.attempts >= 2  # it was refused once at least, then retried
        finally:
            assert (await first).value == {"ok": True}


# -- 3. an agent with no registrar -------------------------------------------------------


async def test_an_agent_without_a_registrar_fails_to_start_with_a_discovery_error(
    nats_server: NatsServer,
) -> None:
    """Compiled, an await inside the announce's except block let nats-py's own
    NoRespondersError escape instead of the documented DiscoveryError."""
    agent = Agent(
        {
            "agent_id": "lonely-1",
            "agent_name": "lonely",
            "version": "1.0.0",
            "capabilities": [{"name": "echo", "security_level": 1}],
        },
        servers=nats_server.url,
        announce_timeout=1.0,
    )

    @agent.capability("echo")
    async def echo(req: Any) -> Any:
        return req

    # awaited directly (announce_timeout bounds it): inside a wait_for task, the old
    # compiled code happened to raise the right error
    with pytest.raises(DiscoveryError, match="no registrar answered") as caught:
        await agent.start()
    assert "reach up" in str(caught.value)
    # handled is handled: nothing is left behind as the current exception (compiled, an
    # await in the clean-up's except block left it there for the next error to chain to)
    assert sys.exc_info() == (None, None, None)


def test_no_compiled_module_awaits_inside_an_except_block() -> None:
    """mypyc's coroutines lose track of the exception being handled across an await in
    an except block: the wrong error escapes, or a handled one lingers. The compiled
    modules wait after the block instead."""
    root = Path(__file__).resolve().parent.parent
    setup = ast.parse((root / "setup.py").read_text())
    compiled = next(
        ast.literal_eval(node.value)
        for node in setup.body
        if isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "COMPILED" for t in node.targets)
    )
    found = [
        f"{module}:{inner.lineno}"
        for module in compiled
        for node in ast.walk(ast.parse((root / module).read_text()))
        if isinstance(node, ast.ExceptHandler)
        for inner in ast.walk(node)
        if isinstance(inner, ast.Await)
    ]
    assert found == []


# -- 8. the credentials file's url -------------------------------------------------------


def _creds(path: Path, url: str) -> Path:
    CredentialsFile(url, "watcher", "not-a-real-secret").write(path)
    return path


def test_the_credentials_files_url_is_used_without_servers_or_reach_url(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("REACH_URL", raising=False)
    monkeypatch.delenv("REACH_CREDS", raising=False)
    creds = _creds(tmp_path / "w.creds", "nats://fabric.example:4333")
    assert resolve_servers(None, creds) == ["nats://fabric.example:4333"]
    # an explicit servers= wins over it, and REACH_URL too
    assert resolve_servers("nats://here:1", creds) == ["nats://here:1"]
    monkeypatch.setenv("REACH_URL", "nats://env:2,nats://env:3")
    assert resolve_servers(None, creds) == ["nats://env:2", "nats://env:3"]


def test_clients_and_agents_connect_where_their_credentials_file_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("REACH_URL", raising=False)
    creds = _creds(tmp_path / "w.creds", "nats://fabric.example:4333")
    assert ReachClient(credentials=creds).servers == ["nats://fabric.example:4333"]
    agent = Agent(
        {"agent_id": "a-1", "agent_name": "a", "version": "1.0.0"}, credentials=str(creds)
    )
    assert agent.servers == ["nats://fabric.example:4333"]
    monkeypatch.setenv("REACH_URL", "nats://env:2")
    assert ReachClient(credentials=creds).servers == ["nats://env:2"]


@pytest.mark.parametrize(
    "body",
    [None, b"{not json", b"[1, 2]", b'{"url": ""}', b'{"url": 7}', b"\xff\xfe"],
    ids=["missing", "not-json", "not-an-object", "empty-url", "url-not-a-string", "binary"],
)
def test_an_unreadable_credentials_file_falls_back_to_the_default_url(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: bytes | None
) -> None:
    monkeypatch.delenv("REACH_URL", raising=False)
    path = tmp_path / "w.creds"
    if body is not None:
        path.write_bytes(body)
    assert resolve_servers(None, path) == [DEFAULT_URL]
    assert resolve_servers(None, tmp_path) == [DEFAULT_URL]  # a directory
    assert resolve_servers(None, None) == [DEFAULT_URL]


def test_a_route_cache_forgets_the_peer_of_an_instance_that_left() -> None:
    """Whoever owns the cache (a client, `reach top`, a tool): the caller's view of an
    instance goes with its record, and does not pile up over the instances ever seen."""
    cache = RouteCache(store=None)  # type: ignore[arg-type]  # _apply needs no store
    for n in range(50):
        cache._apply(f"gone-{n}", _instance(1.0, [{"name": "slow"}], f"gone-{n}"), n + 1)
    assert len(cache.peers) == 50
    for n in range(50):
        cache._apply(f"gone-{n}", None, 100 + n)
    assert len(cache.peers) == 0
