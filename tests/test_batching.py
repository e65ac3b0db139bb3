"""Calls made together travel together: requests to one subject in one turn of the
caller's event loop go out as one message, and their replies come back batched; a
batch reply settles only the requests of its own batch, whatever else it claims to answer.

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

from reach.caller.client import CallResult, ReachClient
from reach.errors import CodecError
from reach.registry import Registrar
from reach.testing import NatsServer
from reach.transport import Connection, Message, connect
from reach.wire import envelope, subjects
from reach.wire.envelope import MAX_BATCH_ITEMS, RequestMeta
from reach.wire.modelcodec import encode_model
from reach.wire.models import AnnounceReply, AnnounceRequest, Manifest

from .calls_helpers import capability, make_agent, wait_routable
from .conftest import manifest
from .schema_helpers import load_schema

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
    from reach.wire.schemas import EnvelopeBatch

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


# -- a batch reply answers only its own batch ------------------------------------------


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
