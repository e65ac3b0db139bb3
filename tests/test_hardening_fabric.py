"""What one participant of the fabric sends (a registry record, a batch reply, a readiness
reason, a job result, audit notices) must not break the others: route caches keep
watching, calls get their own replies, records stay small, jobs finish, the alert rules'
memory stays bounded. Real nats-server throughout; the alert engine also on a manual clock."""

from __future__ import annotations

import asyncio
import json
import math
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest
from pydantic import ValidationError

from reach import envelope, subjects
from reach.agent import Agent
from reach.audit.alerts import AlertEngine
from reach.client import ReachClient
from reach.clock import ManualClock
from reach.errors import CodecError, ConfigurationError, ContractError, RegistrationRefused
from reach.messages import encode_model
from reach.models import (
    AnnounceRequest,
    Bye,
    Manifest,
    Readiness,
    Transition,
    parse_manifest,
)
from reach.registry import Registrar, RegistrarConfig
from reach.registry.store import decode_instance
from reach.security.credentials import CredentialsFile
from reach.testing import NatsServer
from reach.transport import Connection, Message, connect

from .calls_helpers import capability, make_agent, wait_routable
from .conftest import Fabric

# -- 2. a registry record whose schema is nested 500 deep -------------------------------


def _nested_schema(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {}
    for _ in range(depth):
        schema = {"not": schema}
    return schema


def _poisoned_record(agent_id: str) -> bytes:
    """A record no registrar of ours writes (anyone may, on an open fabric)."""
    now = time.time()
    manifest = {
        "agent_id": agent_id,
        "agent_name": "evil",
        "version": "1.0.0",
        "capabilities": [{"name": "work", "input_schema": _nested_schema(500)}],
    }
    record = {
        "manifest": manifest,
        "instance_id": "i",
        "registered_at": now,
        "last_heartbeat_at": now,
    }
    return bytes(msgpack.packb(record))


def test_a_schema_nested_too_deep_is_refused_in_a_manifest_and_in_a_record() -> None:
    deep = {
        "agent_id": "deep-1",
        "agent_name": "deep",
        "version": "1.0.0",
        "capabilities": [{"name": "work", "input_schema": _nested_schema(500)}],
    }
    with pytest.raises(ConfigurationError, match="nested more than"):
        parse_manifest(deep)
    with pytest.raises(CodecError):
        decode_instance(_poisoned_record("evil-1"))
    # a contract as deep as any needs is fine
    fine = {**deep, "capabilities": [{"name": "work", "input_schema": _nested_schema(20)}]}
    assert parse_manifest(fine).capabilities[0].name == "work"


async def test_a_poisoned_registry_record_stops_no_route_cache_client_or_registrar(
    nats_server: NatsServer, registrar: Registrar, client: ReachClient, conn: Connection
) -> None:
    bucket = await conn.key_value(subjects.REGISTRY_BUCKET)
    await bucket.put(subjects.agent_key("evil-1"), _poisoned_record("evil-1"))
    # announced after the bad record (a later revision): every watch meets the bad one first
    agent, _ = make_agent(nats_server.url, "late-1", capability("work"))
    async with agent:
        # a running client's route cache still follows the registry
        await wait_routable(client, "work", 1)
        assert [i.agent_id for i in client.routes.find("work")] == ["late-1"]
        assert (await client.call("work", {"n": 1})).agent_id == "late-1"
        # a new client still connects (its first sync reads past the bad record)
        async with ReachClient(servers=nats_server.url, sync_timeout=5) as fresh:
            await wait_routable(fresh, "work", 1)
            assert [i.agent_id for i in fresh.routes.find("work")] == ["late-1"]
        # and a registrar starting now still syncs
        other_conn = await connect([nats_server.url], name="test-registrar-2")
        other = Registrar(other_conn, RegistrarConfig(liveness_interval_sec=0.2))
        try:
            await asyncio.wait_for(other.start(), 10)
            assert "late-1" in [i.agent_id for i in other.instances()]
        finally:
            await other.stop()
            await other_conn.close()


# -- 3. a batch reply that answers requests of other batches ----------------------------


async def test_a_batch_reply_settles_only_the_requests_of_its_own_batch(
    conn: Connection,
) -> None:
    """A responder answering its batch in parts, every part also carrying "answers" to
    the tokens of other requests in flight (tokens are a counter: easy to guess)."""
    forged_sent = asyncio.Event()

    async def victim(msg: Message) -> None:
        await asyncio.wait_for(forged_sent.wait(), 5)  # the forged answers go first
        await conn.respond(msg, b"victim:" + msg.data)

    async def rogue(msg: Message) -> None:
        if not envelope.is_batch(msg.data):
            await conn.respond(msg, b"single:" + msg.data)
            return
        items = envelope.unpack_batch(msg.data)
        mine = {token for token, _ in items}
        others = [f"{i:x}" for i in range(1, 0x80) if f"{i:x}" not in mine]
        for token, request in items:  # its own answers, one per part, out of order below
            forged = others[: envelope.MAX_BATCH_ITEMS - 1]
            part = [(token, b"rogue:" + request), *((t, b"forged") for t in forged)]
            await conn.respond(msg, envelope.pack_batch(part))
        for start in range(0, len(others), envelope.MAX_BATCH_ITEMS):  # and more after them
            chunk = others[start : start + envelope.MAX_BATCH_ITEMS]
            await conn.respond(msg, envelope.pack_batch([(t, b"forged") for t in chunk]))
        forged_sent.set()

    await conn.subscribe("reach.test.victim", victim)
    await conn.subscribe("reach.test.rogue", rogue)
    await conn.flush()
    request = conn.raw_request
    assert await request("reach.test.rogue", b"first", 2.0, True) == b"single:first"
    # a request to the victim in flight, then three to the rogue in one turn: one batch
    replies = await asyncio.gather(
        request("reach.test.victim", b"v", 5.0, False),
        *(request("reach.test.rogue", b"r%d" % i, 5.0, True) for i in range(3)),
    )
    assert replies == [b"victim:v", b"rogue:r0", b"rogue:r1", b"rogue:r2"]
    assert forged_sent.is_set()


async def test_a_rogue_agent_cannot_answer_a_call_to_another_agent(
    nats_server: NatsServer, registrar: Registrar, client: ReachClient, conn: Connection
) -> None:
    """End to end: an agent that announced the "batch" feature answers its batch with
    forged replies to the caller's call in flight to bank-1."""
    forged_sent = asyncio.Event()

    async def balance(req: Any) -> Any:
        await asyncio.wait_for(forged_sent.wait(), 5)
        return {"balance": 100}

    bank, _ = make_agent(
        nats_server.url, "bank-1", capability("balance", sla_ms=2000), handler=balance
    )

    async def rogue(msg: Message) -> None:
        if not envelope.is_batch(msg.data):
            _, body = envelope.unpack_request(msg.data)
            await conn.respond(msg, envelope.pack_ok(body, "rogue-1"))
            return
        items = envelope.unpack_batch(msg.data)
        mine = {token for token, _ in items}
        ok = envelope.pack_ok(msgpack.packb({"joke": "ok"}), "rogue-1")
        await conn.respond(msg, envelope.pack_batch([(t, ok) for t in mine]))
        forged = envelope.pack_ok(msgpack.packb({"balance": -1_000_000}), "bank-1")
        others = [f"{i:x}" for i in range(1, 0x100) if f"{i:x}" not in mine]
        for start in range(0, len(others), envelope.MAX_BATCH_ITEMS):
            chunk = others[start : start + envelope.MAX_BATCH_ITEMS]
            await conn.respond(msg, envelope.pack_batch([(t, forged) for t in chunk]))
        forged_sent.set()

    await conn.subscribe(subjects.capability_instance("joke", "rogue-1"), rogue)
    manifest = Manifest.model_validate(
        {
            "agent_id": "rogue-1",
            "agent_name": "rogue",
            "version": "1.0.0",
            "capabilities": [{"name": "joke", "latency_sla_ms": 2000, "security_level": 1}],
            "health": {"interval_sec": 3600, "timeout_sec": 5},
        }
    )
    announce = AnnounceRequest(
        manifest=manifest, instance_id="r1", started_at=time.time(), features=["batch"]
    )
    raw = await conn.request(
        subjects.announce("rogue-1"),
        envelope.pack_request(envelope.RequestMeta("a1"), encode_model(announce)),
        timeout=2,
    )
    assert envelope.unpack_reply(raw).ok
    async with bank:
        await wait_routable(client, "balance", 1)
        await wait_routable(client, "joke", 1)
        # a call to bank-1 in flight, and two calls to rogue-1 in the same turn (a batch)
        paid, *jokes = await asyncio.gather(
            client.call("balance", {}),
            client.call("joke", {"n": 1}),
            client.call("joke", {"n": 2}),
        )
    assert forged_sent.is_set()
    assert paid.value == {"balance": 100}
    assert paid.agent_id == "bank-1"
    assert [j.value for j in jokes] == [{"joke": "ok"}] * 2


# -- 7. readiness reasons and details stay small ----------------------------------------

MAX_REASON = 500  # reach.models.MAX_REASON


def test_reasons_are_clipped_and_details_are_bounded() -> None:
    huge = "x" * 250_000
    readiness = Readiness(ready=False, reason=huge)
    assert len(readiness.reason) == MAX_REASON
    assert readiness.reason.endswith("…")
    assert Readiness(ready=False, reason="short").reason == "short"
    assert len(Readiness(details={huge: huge}).details) == 1
    ((key, value),) = Readiness(details={huge: huge}).details.items()
    assert len(key) == MAX_REASON
    assert isinstance(value, str)
    assert len(value) == MAX_REASON
    assert len(Readiness(details={f"g{i}": i for i in range(32)}).details) == 32
    with pytest.raises(ValidationError):
        Readiness(details={f"g{i}": i for i in range(33)})
    assert len(Transition(at=1.0, status="degraded", reason=huge).reason) == MAX_REASON
    assert len(Bye(agent_id="a-1", instance_id="i", reason=huge).reason) == MAX_REASON


async def test_flips_with_a_huge_readiness_reason_keep_the_record_small_and_current(
    nats_server: NatsServer, registrar: Registrar, client: ReachClient, conn: Connection
) -> None:
    state = {"ready": True}

    def readiness() -> Readiness:
        if state["ready"]:
            return Readiness(ready=True)
        return Readiness(ready=False, reason="pool exhausted: " + "x" * 250_000)

    # heartbeats are sent by the test (a long interval: none of the agent's own)
    agent, _ = make_agent(
        nats_server.url,
        "bloat-1",
        capability("work"),
        readiness=readiness,
        health={"interval_sec": 60, "timeout_sec": 2, "failures_before_unhealthy": 2},
    )
    bucket = await conn.key_value(subjects.REGISTRY_BUCKET)
    async with agent:
        await wait_routable(client, "work", 1)
        for flip in range(8):
            state["ready"] = flip % 2 == 1  # not ready, ready, ..., ready
            await agent._presence.send_heartbeat()  # answered (it raises on no answer)
        state["ready"] = False
        await agent._presence.send_heartbeat()
        entry = await bucket.get(subjects.agent_key("bloat-1"))
        assert entry is not None
        assert len(entry.value) < 64 * 1024
        record = decode_instance(entry.value)
        assert record.status == "degraded"
        assert record.readiness.reason.startswith("pool exhausted: ")
        assert len(record.readiness.reason) == MAX_REASON
        assert len(record.status_reason) <= MAX_REASON
        assert all(len(t.reason) <= MAX_REASON for t in record.transitions)
        # callers' route caches follow it
        await client.routes.wait_for(
            lambda c: (i := c.get("bloat-1")) is not None and i.status == "degraded", timeout=5
        )
        # and back
        state["ready"] = True
        await agent._presence.send_heartbeat()
        await client.routes.wait_for(
            lambda c: (i := c.get("bloat-1")) is not None and i.status == "healthy", timeout=5
        )


# -- 8. async-mode results that JSON cannot carry ---------------------------------------


def _async_agent(url: str, output: dict[str, Any]) -> Agent:
    agent = Agent(
        {
            "agent_id": "job-1",
            "agent_name": "job",
            "version": "1.0.0",
            "mode": "async",
            "capabilities": [capability("work")],
            "health": {"interval_sec": 0.5, "timeout_sec": 0.3},
        },
        servers=url,
    )

    @agent.capability("work")
    async def work(req: Any) -> Any:
        return output["value"]

    return agent


async def test_an_async_job_keeps_bytes_and_nan_in_its_result(
    nats_server: NatsServer, client: ReachClient
) -> None:
    output: dict[str, Any] = {}
    async with _async_agent(nats_server.url, output):
        await wait_routable(client, "work", 1)
        output["value"] = {"blob": b"\xff\xfe\x00", "n": 1}  # not UTF-8
        job = await client.submit("work", {})
        assert await job.result(timeout=5) == {"blob": b"\xff\xfe\x00", "n": 1}
        assert (await job.status()).status == "succeeded"
        output["value"] = {"x": math.nan, "y": math.inf}
        job = await client.submit("work", {})
        result = await job.result(timeout=5)
        assert math.isnan(result["x"])
        assert result["y"] == math.inf
        output["value"] = {"x": 1}
        assert await (await client.submit("work", {})).result(timeout=5) == {"x": 1}


async def test_an_async_job_whose_result_cannot_be_stored_fails_and_says_why(
    nats_server: NatsServer, client: ReachClient
) -> None:
    """A result just under the codec's limit (packed: 8 bytes around the string): the job
    record around it is over it. The job is failed (a contract error), not left
    "accepted" for ever."""
    output: dict[str, Any] = {"value": {"s": "a" * (1024 * 1024 - 8 - 40)}}
    async with _async_agent(nats_server.url, output):
        await wait_routable(client, "work", 1)
        job = await client.submit("work", {})
        with pytest.raises(ContractError, match="cannot be stored"):
            await job.result(timeout=5)
        record = await job.status()
        assert record.status == "failed"
        output["value"] = {"x": 1}  # and the agent goes on
        assert await (await client.submit("work", {})).result(timeout=5) == {"x": 1}


# -- 9. the alert rules' memory under notices with many names ---------------------------

MAX_TRACKED = 10_000  # reach.audit.alerts.MAX_TRACKED


def _breaker_rejection(capability: str) -> dict[str, Any]:
    return {"side": "caller", "capability": capability, "caller": "c", "error": "breaker"}


def _retried(caller: str, callee: str, capability: str = "query") -> dict[str, Any]:
    return {
        "side": "caller",
        "capability": capability,
        "caller": caller,
        "attempts": [{"agent_id": callee, "outcome": "timeout"}, {"agent_id": "ok-1"}],
    }


def test_the_alert_engine_tracks_a_bounded_number_of_names_and_forgets_empty_windows() -> None:
    clock = ManualClock()
    engine = AlertEngine(clock=clock)
    # a few names over the limit each (each of those costs the engine a pass over all)
    engine.count_calls({f"cap-{i}": 1 for i in range(MAX_TRACKED + 20)})
    for i in range(MAX_TRACKED + 20):
        engine.observe(_breaker_rejection(f"cap-{i}"))
    for i in range(MAX_TRACKED + 20):
        engine.observe(_retried("sched", f"callee-{i}", capability="cap-0"))
    assert len(engine._calls) <= MAX_TRACKED
    assert len(engine._rejections) <= MAX_TRACKED
    assert len(engine._retries) <= MAX_TRACKED
    # windows that emptied are forgotten
    clock.advance(max(engine.rules.breaker_window_sec, engine.rules.retry_window_sec) + 1)
    engine.prune(clock.time())
    assert (len(engine._calls), len(engine._rejections), len(engine._retries)) == (0, 0, 0)
    # full again: once its windows emptied, a new name is counted (room made by pruning)
    engine.count_calls({f"again-{i}": 1 for i in range(MAX_TRACKED)})
    assert len(engine._calls) == MAX_TRACKED
    engine.count_calls({"late": 1})
    assert "late" not in engine._calls
    clock.advance(engine.rules.breaker_window_sec + 1)
    engine.count_calls({"later": 1})
    assert list(engine._calls) == ["later"]


def test_a_window_that_still_counts_is_kept_by_prune() -> None:
    clock = ManualClock()
    engine = AlertEngine(clock=clock)
    engine.count_calls({"old": 1})
    clock.advance(engine.rules.breaker_window_sec / 2)
    engine.count_calls({"recent": 1})
    clock.advance(engine.rules.breaker_window_sec / 2 + 1)
    engine.prune(clock.time())
    assert list(engine._calls) == ["recent"]


async def test_forged_notices_with_many_names_keep_the_registrars_alert_state_bounded(
    registrar: Registrar, conn: Connection
) -> None:
    watcher = registrar._alerts
    assert watcher is not None
    engine = watcher.engine
    subject = subjects.audited("x", subjects.ANONYMOUS)

    def notice(calls: dict[str, int]) -> bytes:
        return json.dumps({"seq": 1, "calls": calls, "notable": 0}).encode()

    await conn.publish(subject, notice({"sentinel": 1}))
    for n in range(2):  # 10,100 names: just over the limit
        await conn.publish(subject, notice({f"n{n}-{i}": 1 for i in range(5050)}))
    await conn.publish(subject, notice({"sentinel": 1000}))  # the last one: all are counted
    await conn.flush()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        sentinel = engine._calls.get("sentinel")
        if sentinel is not None and sentinel.total >= 1001:
            break
        await asyncio.sleep(0.05)
    else:
        pytest.fail("the registrar did not count the notices")
    assert len(engine._calls) <= MAX_TRACKED


# -- replies go to inboxes only -------------------------------------------------------------


async def test_a_reply_subject_that_is_no_inbox_is_never_published_to(
    nats_server: NatsServer, registrar: Registrar, client: ReachClient
) -> None:
    """NATS does not check a request's reply subject: a ping whose reply names a registry
    key would have the registrar overwrite that record with its answer (or purge a bucket:
    "$JS.API.STREAM.PURGE.…"), with the registrar's rights. Replies go to inboxes only."""
    agent, _ = make_agent(nats_server.url, "victim-1", capability("work"))
    async with agent:
        await wait_routable(client, "work", 1)
        store = registrar.store
        before = await store.get("victim-1")
        assert before is not None
        raw = await connect([nats_server.url], name="injector")
        try:
            await raw.publish(
                subjects.REGISTRAR_PING, b"", reply="$KV.REACH_REGISTRY.agent.victim-1"
            )
            await raw.publish(
                subjects.REGISTRAR_PING, b"", reply="$JS.API.STREAM.PURGE.KV_REACH_REGISTRY"
            )
            # the same subscription answers in order: once this ping is answered, the two
            # above were handled too
            await raw.request(subjects.REGISTRAR_PING, b"", timeout=5)
        finally:
            await raw.close()
        after = await store.get("victim-1")
        assert after is not None  # still there (no purge) and still an Instance
        assert after[0].instance_id == before[0].instance_id
        assert await client.call("work", {}) is not None


# -- an agent serves what its credential lists ------------------------------------------


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
