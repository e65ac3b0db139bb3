"""Malformed control messages get a typed error reply (or are dropped with a log line),
and never stop the registrar from serving well-formed ones: among them announces of a
manifest no caller could follow (an SLA no deadline can follow, NaN in a schema), and
requests whose reply subject is no inbox."""

from __future__ import annotations

import gc
import logging
import math
import secrets
import time
import warnings
from dataclasses import dataclass

import msgpack
import pytest

from reach.agent.agent import Agent
from reach.caller.client import ReachClient
from reach.registry import Registrar
from reach.testing import NatsServer
from reach.transport import Connection, connect
from reach.wire import envelope, subjects
from reach.wire.modelcodec import decode_model, encode_model
from reach.wire.models import AnnounceReply, Heartbeat, HeartbeatReply, Manifest

from .calls_helpers import capability, make_agent, wait_routable
from .conftest import manifest
from .manifest_helpers import manifest_with_schema, manifest_with_sla


def _request(body: bytes) -> bytes:
    return envelope.pack_request(envelope.RequestMeta(call_id=secrets.token_hex(8)), body)


async def _ask(conn: Connection, subject: str, data: bytes) -> envelope.Reply:
    return envelope.unpack_reply(await conn.request(subject, data, timeout=2))


BAD_PAYLOADS = {
    "garbage bytes": b"\x00\xff\xfe garbage",
    "empty": b"",
    "not a map": msgpack.packb([1, 2, 3]),
    "wrong protocol version": msgpack.packb({"v": 99, "id": "x", "b": b""}),
    "body is not msgpack": _request(b"\xc1\xc1"),
    "body of wrong type": _request(msgpack.packb({"manifest": "nope", "instance_id": 5})),
    "missing call id": msgpack.packb({"v": 1, "b": b""}),
}


@pytest.mark.parametrize("case", sorted(BAD_PAYLOADS))
async def test_malformed_announce_gets_a_contract_error_reply(
    conn: Connection, registrar: Registrar, case: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="reach.registrar"):
        reply = await _ask(conn, subjects.announce("bad-1"), BAD_PAYLOADS[case])
    assert not reply.ok
    assert reply.kind == "contract"
    assert reply.description
    assert any("malformed" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("case", sorted(BAD_PAYLOADS))
async def test_malformed_heartbeat_gets_an_error_and_bye_too(
    conn: Connection, registrar: Registrar, case: str
) -> None:
    for subject in (subjects.heartbeat("bad-1"), subjects.bye("bad-1")):
        reply = await _ask(conn, subject, BAD_PAYLOADS[case])
        assert not reply.ok
        assert reply.kind == "contract"


async def test_wrong_field_names_the_field(conn: Connection, registrar: Registrar) -> None:
    hb = {
        "agent_id": "x-1",
        "instance_id": "i",
        "seq": -4,
        "sent_at": 1.0,
        "in_flight": "many",
        "max_concurrency": 1,
    }
    reply = await _ask(conn, subjects.heartbeat("x-1"), _request(msgpack.packb(hb)))
    assert not reply.ok
    assert "seq" in reply.description
    assert "in_flight" in reply.description


async def test_oversized_announce_is_refused_with_the_limit_named(
    conn: Connection, registrar: Registrar
) -> None:
    big = _request(b"\x00" * (registrar.config.max_message_bytes + 10))
    reply = await _ask(conn, subjects.announce("big-1"), big)
    assert not reply.ok
    assert "limit" in reply.description


async def test_announce_on_another_agents_subject_is_refused(
    conn: Connection, registrar: Registrar
) -> None:
    from reach.wire.models import AnnounceRequest

    req = AnnounceRequest(
        manifest=Manifest.model_validate(manifest("real-1")), instance_id="i1", started_at=1.0
    )
    reply = await _ask(conn, subjects.announce("other-1"), _request(encode_model(req)))
    assert reply.ok
    answer = decode_model(AnnounceReply, reply.body)
    assert not answer.accepted
    assert "other-1" in answer.reason


async def test_heartbeat_from_unknown_instance_asks_to_announce_and_imposter_is_refused(
    conn: Connection, client: ReachClient, nats_server: object
) -> None:
    hb = Heartbeat(
        agent_id="ghost-1", instance_id="i", seq=1, sent_at=1.0, in_flight=0, max_concurrency=1
    )
    reply = await _ask(conn, subjects.heartbeat("ghost-1"), _request(encode_model(hb)))
    assert decode_model(HeartbeatReply, reply.body).reannounce

    agent = Agent(manifest("real-2"), servers=client.servers)

    @agent.capability("echo")
    async def echo(req: object) -> object:
        return req

    async with agent:
        await client.routes.wait_for(lambda c: c.get("real-2") is not None, timeout=5)
        before = client.routes.get("real-2")
        imposter = hb.model_copy(update={"agent_id": "real-2", "in_flight": 60})
        reply = await _ask(conn, subjects.heartbeat("real-2"), _request(encode_model(imposter)))
        answer = decode_model(HeartbeatReply, reply.body)
        assert not answer.ok
        assert agent.instance_id in answer.reason
        after = client.routes.get("real-2")
        assert after is not None
        assert before is not None
        assert after.in_flight == 0


async def test_registrar_keeps_serving_after_a_flood_of_garbage(
    conn: Connection, client: ReachClient
) -> None:
    for i in range(300):
        await conn.publish(subjects.heartbeat(f"g-{i % 7}"), secrets.token_bytes(i % 50 + 1))
        await conn.publish(subjects.announce(f"g-{i % 7}"), secrets.token_bytes(i % 50 + 1))
    agent = Agent(manifest("after-flood-1"), servers=client.servers)

    @agent.capability("echo")
    async def echo(req: object) -> object:
        return req

    async with agent:
        await client.routes.wait_for(lambda c: c.get("after-flood-1") is not None, timeout=5)


# -- announces of manifests a caller cannot follow -------------------------------------


@pytest.mark.parametrize("sla", [math.inf, 1e20])
async def test_a_raw_announce_with_an_sla_no_deadline_can_follow_is_refused(
    conn: Connection, registrar: Registrar, sla: float
) -> None:
    """From an agent in another language (msgpack carries an infinity): registered, it
    would make every caller's deadline uncomputable."""
    body = msgpack.packb(
        {"manifest": manifest_with_sla(sla), "instance_id": "i1", "started_at": time.time()}
    )
    raw = await conn.request(
        subjects.announce("slow-1"),
        envelope.pack_request(envelope.RequestMeta(secrets.token_hex(8)), body),
        timeout=2,
    )
    reply = envelope.unpack_reply(raw)
    assert not reply.ok, decode_model(AnnounceReply, reply.body)
    assert reply.kind == "contract"
    assert "latency_sla_ms" in reply.description
    assert await registrar.store.get("slow-1") is None


@pytest.mark.parametrize("bound", [math.nan, math.inf])
async def test_a_raw_announce_whose_schema_holds_nan_is_refused_not_accepted(
    nats_server: NatsServer, conn: Connection, registrar: Registrar, bound: float
) -> None:
    """An agent in another language: msgpack floats may be NaN, JSON's may not (the record
    would say ``"maximum": null``, which no route cache reads)."""
    body = msgpack.packb(
        {
            "manifest": manifest_with_schema("nan-1", bound),
            "instance_id": "i1",
            "started_at": time.time(),
        }
    )
    raw = await conn.request(
        subjects.announce("nan-1"),
        envelope.pack_request(envelope.RequestMeta(secrets.token_hex(8)), body),
        timeout=2,
    )
    reply = envelope.unpack_reply(raw)
    if reply.ok:  # an answer that is not a refusal would have to say accepted=False
        answer = decode_model(AnnounceReply, reply.body)
        pytest.fail(f"the announce was answered as a success: {answer}")
    assert reply.kind == "contract"
    assert "NaN or an infinity" in reply.description
    assert await registrar.store.get("nan-1") is None
    # the registrar keeps serving well-formed announces
    agent, _ = make_agent(nats_server.url, "fine-1", capability("work"))
    async with agent:
        assert await registrar.store.get("fine-1") is not None


# -- replies go to inboxes only --------------------------------------------------------


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


@dataclass
class _Msg:
    subject: str
    reply: str
    data: bytes


async def test_a_registrar_stopped_before_its_handlers_ran_leaves_no_coroutine_unawaited(
    registrar: Registrar,
) -> None:
    """A heartbeat whose answer needs a task (here: an unknown instance, asked to announce)
    and a registrar stopped before that task ran: nothing it made is left unawaited (a
    coroutine made outside its task, never run, warns when it is collected)."""
    hb = Heartbeat(
        agent_id="ghost-2", instance_id="i", seq=1, sent_at=1.0, in_flight=0, max_concurrency=1
    )
    msg = _Msg(subjects.heartbeat("ghost-2"), "", _request(encode_model(hb)))
    handlers = registrar._handlers
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handlers.heartbeat(msg)
        assert handlers.tasks  # its answer waits in a task that has not run yet
        await registrar.stop()
        gc.collect()
    assert not [w for w in caught if "never awaited" in str(w.message)]
