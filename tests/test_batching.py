"""Calls made together travel together: requests to one subject in one turn of the
caller's event loop go out as one message, and their replies come back batched.

Against a real nats-server: a plain subscription on the instance subject watches what
actually goes over the wire.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from pathlib import Path
from typing import Any

import msgpack
import nats.errors
import pytest
from hypothesis import given
from hypothesis import strategies as st

from reach import envelope, subjects
from reach.client import CallResult, ReachClient
from reach.envelope import MAX_BATCH_ITEMS, RequestMeta
from reach.errors import CodecError
from reach.messages import encode_model
from reach.models import AnnounceReply, AnnounceRequest, Manifest
from reach.testing import NatsServer
from reach.transport import Connection, Message, connect

from .calls_helpers import capability, make_agent, wait_routable
from .conftest import manifest

# -- the wire format ---------------------------------------------------------------------


@given(st.lists(st.tuples(st.text(min_size=1, max_size=32), st.binary()), min_size=1, max_size=32))
def test_batches_round_trip(items: list[tuple[str, bytes]]) -> None:
    data = envelope.pack_batch(items)
    assert envelope.is_batch(data)
    assert envelope.unpack_batch(data) == items


@given(st.binary())
def test_any_bytes_are_a_batch_or_a_codec_error(data: bytes) -> None:
    with contextlib.suppress(CodecError):
        envelope.unpack_batch(data)


def test_an_envelope_is_not_a_batch() -> None:
    assert not envelope.is_batch(envelope.pack_request(RequestMeta(call_id="c1"), b"\x01"))
    assert not envelope.is_batch(envelope.pack_ok(b"\x01"))
    assert not envelope.is_batch(b"")


@pytest.mark.parametrize(
    ("items", "names"),
    [
        ([], "non-empty"),
        ([["t", b"x"]] * (MAX_BATCH_ITEMS + 1), "max_array_len"),
        ([[1, b"x"]], "batch[0]"),
        ([["t", "not bytes"]], "batch[0]"),
        ([["t", b"x", b"y"]], "batch[0]"),
        ([["t" * 33, b"x"]], "batch[0]"),
        ([["t", b"x"], ["u"]], "batch[1]"),
    ],
)
def test_a_malformed_batch_is_named(items: list[Any], names: str) -> None:
    with pytest.raises(CodecError, match=names.replace("[", r"\[")):
        envelope.unpack_batch(msgpack.packb(items))


# -- the caller's side -------------------------------------------------------------------


async def test_a_batch_nobody_receives_fails_every_request_as_no_responders(
    conn: Connection,
) -> None:
    request = conn.raw_request
    await conn.flush()
    results = await asyncio.gather(
        *(request("reach.test.nobody", b"x", 2.0, True) for _ in range(10)), return_exceptions=True
    )
    assert all(isinstance(r, nats.errors.NoRespondersError) for r in results), results


async def test_a_batch_answered_as_a_whole_goes_again_one_request_at_a_time(
    conn: Connection,
) -> None:
    """One reply to a whole batch means the callee did not serve its requests one by one
    (none of them ran): each is sent again on its own, and gets its own answer."""
    seen: list[bytes] = []

    async def refuse_batches(msg: Message) -> None:
        seen.append(msg.data)
        if envelope.is_batch(msg.data):
            await conn.respond(msg, b"\x81\xa1v\x01")  # a map: an answer to the whole message
        else:
            await conn.respond(msg, b"single:" + msg.data)

    await conn.subscribe("reach.test.refuser", refuse_batches)
    await conn.flush()
    await conn.raw_request("reach.test.refuser", b"first", 2.0, True)  # the reply inbox is in place
    seen.clear()
    replies = await asyncio.gather(
        *(conn.raw_request("reach.test.refuser", b"r%d" % i, 2.0, True) for i in range(10))
    )
    assert replies == [b"single:r%d" % i for i in range(10)]
    batches = [envelope.unpack_batch(d) for d in seen if envelope.is_batch(d)]
    assert batches  # some went as one batch, and then each of those alone
    again = [request for batch in batches for _, request in batch]
    assert sorted(d for d in seen if not envelope.is_batch(d)) == sorted(
        [b"r%d" % i for i in range(10) if b"r%d" % i not in again] + again
    )


async def test_replies_to_one_batch_may_come_back_in_parts(conn: Connection) -> None:
    """A responder answering the requests of a batch one by one, out of order."""

    async def answer_in_parts(msg: Message) -> None:
        items = envelope.unpack_batch(msg.data) if envelope.is_batch(msg.data) else []
        if not items:
            await conn.respond(msg, b"single:" + msg.data)
            return
        random.Random(7).shuffle(items)
        for token, request in items:
            await conn.respond(msg, envelope.pack_batch([(token, b"batched:" + request)]))

    await conn.subscribe("reach.test.parts", answer_in_parts)
    await conn.flush()
    await conn.raw_request("reach.test.parts", b"first", 2.0, True)  # the reply inbox is in place
    replies = await asyncio.gather(
        *(conn.raw_request("reach.test.parts", b"%d" % i, 2.0, True) for i in range(20))
    )
    assert [r.split(b":", 1)[1] for r in replies] == [b"%d" % i for i in range(20)]
    assert any(r.startswith(b"batched:") for r in replies)


# -- end to end: an agent serving batches ------------------------------------------------


async def _watch(conn: Connection, subject: str) -> list[bytes]:
    """Every message sent on ``subject`` (a second, plain subscription sees them all)."""
    wire: list[bytes] = []

    async def record(msg: Message) -> None:
        wire.append(msg.data)

    await conn.subscribe(subject, record)
    await conn.flush()
    return wire


async def test_concurrent_calls_go_in_batches_and_each_gets_its_own_reply(
    nats_server: Any, client: ReachClient, conn: Connection
) -> None:
    delays = random.Random(3)

    async def handler(req: dict[str, Any]) -> dict[str, Any]:
        if req["i"] % 3 == 0:  # some wait: their replies leave the batch later
            await asyncio.sleep(delays.uniform(0, 0.02))
        return {"i": req["i"], "twice": req["i"] * 2}

    agent, _ = make_agent(nats_server.url, "batch-1", capability("work"), handler=handler)
    wire = await _watch(conn, subjects.capability_instance("work", "batch-1"))
    async with agent:
        await wait_routable(client, "work", 1)
        await client.call("work", {"i": -1})  # the reply inbox is in place
        results = await asyncio.gather(*(client.call("work", {"i": i}) for i in range(200)))
        assert [r.value for r in results] == [{"i": i, "twice": 2 * i} for i in range(200)]
        assert len({r.call_id for r in results}) == 200
        assert all(r.agent_id == "batch-1" for r in results)
        # one bad item in a batch fails alone; the agent goes on serving
        bad = envelope.pack_batch(
            [
                ("1", b"\xc1garbage"),
                ("2", envelope.pack_request(RequestMeta(call_id="ok-1"), msgpack.packb({"i": 5}))),
            ]
        )
        raw = await conn.request(subjects.capability_instance("work", "batch-1"), bad, 2.0)
        answers = dict(envelope.unpack_batch(raw)) if envelope.is_batch(raw) else {}
        assert envelope.unpack_reply(answers["1"]).code == "bad_envelope"
        ok = envelope.unpack_reply(answers["2"])
        assert ok.ok
        assert msgpack.unpackb(ok.body) == {"i": 5, "twice": 10}
        # a batch that cannot be read is refused as a whole, with a reason
        reply = envelope.unpack_reply(
            await conn.request(subjects.capability_instance("work", "batch-1"), b"\x91\x01", 2.0)
        )
        assert (reply.kind, reply.code) == ("contract", "bad_batch")
        assert "batch[0]" in reply.description
        assert (await client.call("work", {"i": 9})).value == {"i": 9, "twice": 18}
    batches = [d for d in wire if envelope.is_batch(d)]
    assert batches, "200 calls at once should have gone in batches"
    assert len(wire) < 150


async def test_a_callee_that_cannot_read_batches_still_serves_every_request(
    conn: Connection,
) -> None:
    """A responder that refuses batches as a whole (as an agent speaking only the base
    protocol does) still answers every request: they come again one at a time."""

    async def map_only(msg: Message) -> None:
        if envelope.is_batch(msg.data):
            await conn.respond(msg, envelope.pack_error("contract", "bad_envelope", "a map only"))
        else:
            await conn.respond(msg, envelope.pack_ok(msg.data))

    await conn.subscribe("reach.test.map-only", map_only)
    await conn.flush()
    await conn.raw_request("reach.test.map-only", b"first", 2.0, True)
    replies = [
        envelope.unpack_reply(r)
        for r in await asyncio.gather(
            *(conn.raw_request("reach.test.map-only", b"%d" % i, 2.0, True) for i in range(10))
        )
    ]
    assert [(r.ok, r.body) for r in replies] == [(True, b"%d" % i) for i in range(10)]


async def _base_protocol_agent(
    conn: Connection, agent_id: str, capability: str, *, features: list[str] | None
) -> list[bytes]:
    """An agent that speaks only the base protocol, as one in another language might: it
    answers single request envelopes and refuses batches. With ``features`` it announces
    itself (with those features); without, it only serves the capability's queue group.
    Returns what it received."""
    wire: list[bytes] = []

    async def serve(msg: Message) -> None:
        wire.append(msg.data)
        if envelope.is_batch(msg.data):
            await conn.respond(msg, envelope.pack_error("contract", "bad_envelope", "a map only"))
            return
        _, body = envelope.unpack_request(msg.data)
        await conn.respond(msg, envelope.pack_ok(body, agent_id))

    await conn.subscribe(subjects.capability(capability), serve, queue=capability)
    if features is None:
        await conn.flush()
        return wire
    await conn.subscribe(subjects.capability_instance(capability, agent_id), serve)
    announce = AnnounceRequest(
        # probes and heartbeats are not answered: a health interval longer than the test
        manifest=Manifest.model_validate(manifest(agent_id, capability, interval=60, timeout=5)),
        instance_id=f"{agent_id}-1",
        started_at=time.time(),
        features=features,
    )
    data = envelope.pack_request(RequestMeta(call_id=f"hello-{agent_id}"), encode_model(announce))
    reply = envelope.unpack_reply(await conn.request(subjects.announce(agent_id), data, 2.0))
    assert reply.ok
    assert AnnounceReply.model_validate(msgpack.unpackb(reply.body)).accepted
    return wire


async def test_batches_go_only_to_instances_that_announced_they_read_them(
    client: ReachClient, conn: Connection
) -> None:
    """Batches are a feature an instance announces: one that did not (an agent in another
    language speaking the base protocol, say) gets every request on its own, and so does
    a capability's queue group, which may hold such instances."""
    plain = await _base_protocol_agent(conn, "plain-1", "plain", features=[])
    modern = await _base_protocol_agent(conn, "modern-1", "modern", features=["batch"])
    queued = await _base_protocol_agent(conn, "queued-1", "queued", features=None)
    await wait_routable(client, "plain", 1)
    await wait_routable(client, "modern", 1)
    assert not client.routes.find("plain")[0].batches
    assert client.routes.find("modern")[0].batches
    assert client.routes.find("queued") == []
    for cap in ("plain", "modern", "queued"):
        await client.call(cap, {"i": -1})  # the reply inbox is in place
        results = await asyncio.gather(
            *(client.call(cap, {"i": i}) for i in range(50)), return_exceptions=True
        )
        # modern-1 claimed batches it cannot read: it refused them, and they came again
        # one request at a time
        assert [r.value for r in results if isinstance(r, CallResult)] == [
            {"i": i} for i in range(50)
        ]
    assert len(plain) == len(queued) == 51
    assert not any(envelope.is_batch(d) for d in plain + queued)
    assert any(envelope.is_batch(d) for d in modern)  # the same load does go in batches


def test_the_exported_schema_describes_a_batch() -> None:
    from reach.schemas import EnvelopeBatch

    from .test_schemas import load_schema

    data = envelope.pack_batch([("a1", b"\x80"), ("a2", b"\x81")])
    assert EnvelopeBatch.model_validate(msgpack.unpackb(data)).root == [
        ("a1", b"\x80"),
        ("a2", b"\x81"),
    ]
    assert load_schema("envelope-batch")["maxItems"] == MAX_BATCH_ITEMS


async def test_batches_stay_under_the_servers_max_payload(tmp_path: Path) -> None:
    """Requests (and replies) that each fit the server's max_payload never fail for
    travelling together."""
    config = tmp_path / "small.conf"
    config.write_text("max_payload: 4096\n")
    async with NatsServer(store_dir=tmp_path / "store", config_file=config) as server:
        conn = await connect([server.url], name="small")
        try:
            assert conn.max_payload == 4096
            wire: list[bytes] = []

            async def echo(msg: Message) -> None:
                wire.append(msg.data)
                if envelope.is_batch(msg.data):
                    replies = conn.reply_batch(msg)  # as an agent answers: together
                    for token, request in envelope.unpack_batch(msg.data):
                        replies.add(token, request * 3)  # 1800 bytes: two would not fit
                    replies.flush()
                else:
                    await conn.respond(msg, msg.data * 3 if len(msg.data) < 2000 else msg.data)

            await conn.subscribe("reach.test.small", echo)
            await conn.flush()
            await conn.raw_request("reach.test.small", b"first", 2.0, True)
            payloads = [bytes([i]) * 600 for i in range(12)] + [b"x" * 3900]
            replies = await asyncio.gather(
                *(conn.raw_request("reach.test.small", p, 2.0, True) for p in payloads)
            )
            assert replies == [p * 3 for p in payloads[:-1]] + payloads[-1:]
            assert any(envelope.is_batch(d) for d in wire)  # the small ones still go together
            assert all(len(d) <= 4096 for d in wire)
        finally:
            await conn.close()
