"""Malformed control messages get a typed error reply (or are dropped with a log line),
and never stop the registrar from serving well-formed ones."""

from __future__ import annotations

import logging
import secrets

import msgpack
import pytest

from reach import envelope, subjects
from reach.agent import Agent
from reach.client import ReachClient
from reach.messages import decode_model, encode_model
from reach.models import AnnounceReply, Heartbeat, HeartbeatReply, Manifest
from reach.registry import Registrar
from reach.transport import Connection

from .conftest import manifest


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
    from reach.models import AnnounceRequest

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
