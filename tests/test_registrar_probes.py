"""The registrar's probes under attack: forged, stray, malformed and foreign replies.

The probed instance is a foreign client (plain nats-py and the wire envelopes of
docs/protocol.md); the registrar is a real one on a real nats-server. A reply that does
not answer a probe in flight changes nothing and is counted; a reply that answers one
but is not a valid answer of this instance is that probe's failure; none stops the
registrar.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import nats
import pytest
from nats.aio.msg import Msg

from reach.registry import Registrar, RegistrarConfig
from reach.tasks import cancel_and_wait
from reach.testing import NatsServer
from reach.wire import envelope, subjects
from reach.wire.modelcodec import decode_model, encode_model
from reach.wire.models import AnnounceReply, AnnounceRequest, Heartbeat, Instance, ProbeReply

from .hbsim import request, sim_manifest
from .poll_helpers import until

INTERVAL = 0.6
TIMEOUT = 0.3

#: what a probe is answered with: the probe's message in, the bytes to reply (None: none)
Answer = Callable[[Msg], bytes | None]


@dataclass
class Foreign:
    """One instance on plain nats-py: announces, heartbeats, answers probes with ``answer``."""

    nc: Any
    agent_id: str
    instance_id: str
    answer: Answer
    #: reply subjects the registrar's probes came with
    reply_subjects: list[str] = field(default_factory=list)

    def good(self, msg: Msg | None = None, instance_id: str | None = None) -> bytes:
        reply = ProbeReply(
            agent_id=self.agent_id,
            instance_id=instance_id or self.instance_id,
            in_flight=0,
            max_concurrency=4,
        )
        return envelope.pack_ok(encode_model(reply), self.agent_id)

    async def on_probe(self, msg: Msg) -> None:
        self.reply_subjects.append(msg.reply)
        data = self.answer(msg)
        if data is not None:
            await self.nc.publish(msg.reply, data)

    async def heartbeat_forever(self) -> None:
        seq = 0
        while True:
            seq += 1
            hb = Heartbeat(
                agent_id=self.agent_id,
                instance_id=self.instance_id,
                seq=seq,
                sent_at=time.time(),
                in_flight=0,
                max_concurrency=4,
            )
            await self.nc.publish(subjects.heartbeat(self.agent_id), request(self.agent_id, hb))
            await asyncio.sleep(INTERVAL * 0.8)


@pytest.fixture
async def reg(nats_server: NatsServer) -> AsyncIterator[Registrar]:
    from reach.transport import connect

    conn = await connect([nats_server.url], name="probed-registrar")
    registrar = Registrar(conn, RegistrarConfig(liveness_interval_sec=0.2))
    await registrar.start()
    try:
        yield registrar
    finally:
        await registrar.stop()
        await conn.close()


async def _foreign(url: str, agent_id: str, answer: Answer | None = None) -> Foreign:
    nc = await nats.connect(url, name=agent_id)
    inst = Foreign(nc, agent_id, f"{agent_id}-{secrets.token_hex(3)}", lambda m: None)
    inst.answer = answer or inst.good
    await nc.subscribe(subjects.probe(agent_id), cb=inst.on_probe)
    await nc.flush()
    req = AnnounceRequest(
        manifest=sim_manifest(agent_id, INTERVAL, TIMEOUT),
        instance_id=inst.instance_id,
        started_at=time.time(),
    )
    msg = await nc.request(subjects.announce(agent_id), request(agent_id, req), 5.0)
    reply = envelope.unpack_reply(msg.data)
    assert reply.ok
    assert decode_model(AnnounceReply, reply.body).accepted
    return inst


async def _record(reg: Registrar, agent_id: str) -> Instance:
    found = await reg.store.get(agent_id)
    assert found is not None, f"{agent_id} was evicted"
    return found[0]


async def _until(reg: Registrar, agent_id: str, ok: Callable[[Instance], bool]) -> Instance:
    """The record of ``agent_id`` once ``ok`` holds for it."""

    async def record_if_ok() -> Instance | None:
        inst = await _record(reg, agent_id)
        return inst if ok(inst) else None

    return await until(
        record_if_ok, f"the record of {agent_id} as wanted", timeout=8, interval=0.05
    )


async def test_forged_and_stray_replies_change_nothing_and_are_counted(
    nats_server: NatsServer, reg: Registrar
) -> None:
    """Whoever sees a probe's reply subject may publish there: answers to tokens that
    were never sent, to a probe already answered, or to one that expired are dropped."""
    inst = await _foreign(nats_server.url, "forged-1")
    attacker = await nats.connect(nats_server.url, name="attacker")
    beats = asyncio.create_task(inst.heartbeat_forever())
    try:
        await _until(reg, "forged-1", lambda i: i.last_probe_ms is not None)
        before = reg._sweeper.probes.strays
        sent = 0
        await until(
            lambda: len(inst.reply_subjects) >= 4, "four probes received", timeout=8, interval=0.05
        )
        for subject in list(inst.reply_subjects):
            base = subject.rsplit(".", 1)[0]
            bad = inst.good(instance_id="someone-else")
            not_ready = envelope.pack_error("unavailable", "down", "forged", "forged-1")
            # answered long ago (or expired), a made-up token, garbage on both
            for target in (subject, f"{base}.{secrets.token_hex(8)}", f"{base}.x.y"):
                for data in (bad, not_ready, b"\xc1garbage"):
                    await attacker.publish(target, data)
                    sent += 1
        await attacker.flush()
        # the two-token subject is not on the wildcard: the server does not deliver it
        await until(
            lambda: reg._sweeper.probes.strays - before >= sent * 2 // 3,
            "the forged replies counted as strays",
            timeout=5,
            interval=0.05,
        )
        await asyncio.sleep(INTERVAL)  # a probe or two more, answered well
        record = await _record(reg, "forged-1")
        assert record.status == "healthy"
        assert record.consecutive_failures == 0
        assert not [t for t in record.transitions if "another instance" in t.reason]
    finally:
        await cancel_and_wait([beats])
        await attacker.close()
        await inst.nc.close()


def _garbage(inst: Foreign, msg: Msg) -> bytes:
    return b"\xc1\xc1\xc1 not msgpack"


def _not_a_map(inst: Foreign, msg: Msg) -> bytes:
    return msgpack.packb([1, 2, 3])


def _not_a_probe_reply(inst: Foreign, msg: Msg) -> bytes:
    return envelope.pack_ok(msgpack.packb({"agent_id": inst.agent_id, "in_flight": -5}))


def _another_instance(inst: Foreign, msg: Msg) -> bytes:
    return inst.good(msg, instance_id="an-impostor")


def _oversized(inst: Foreign, msg: Msg) -> bytes:
    # over the registrar's max_message_bytes (256 KiB), under NATS' max_payload
    reply = {
        "agent_id": inst.agent_id,
        "instance_id": inst.instance_id,
        "in_flight": 0,
        "max_concurrency": 4,
        "readiness": {"ready": True, "reason": "x" * 400_000},
    }
    return envelope.pack_ok(msgpack.packb(reply))


@pytest.mark.parametrize(
    ("bad", "said"),
    [
        (_garbage, "CodecError"),
        (_not_a_map, "CodecError"),
        (_not_a_probe_reply, "ContractError"),
        (_another_instance, "another instance"),
        (_oversized, "CodecError"),
    ],
)
async def test_a_malformed_or_foreign_reply_is_a_failed_probe_and_the_registrar_goes_on(
    nats_server: NatsServer,
    reg: Registrar,
    bad: Callable[[Foreign, Msg], bytes],
    said: str,
) -> None:
    agent_id = f"bad-{bad.__name__.strip('_').replace('_', '-')}"
    mode = {"bad": True}
    holder: list[Foreign] = []

    def answer(msg: Msg) -> bytes:
        me = holder[0]
        return bad(me, msg) if mode["bad"] else me.good(msg)

    inst = await _foreign(nats_server.url, agent_id, answer)
    holder.append(inst)
    beats = asyncio.create_task(inst.heartbeat_forever())
    try:
        marked = await _until(reg, agent_id, lambda i: i.status == "unhealthy")
        assert "probe failures" in marked.status_reason
        assert said in marked.status_reason, marked.status_reason
        mode["bad"] = False  # answers well again: healthy at the next probe
        healthy = await _until(reg, agent_id, lambda i: i.status == "healthy")
        assert healthy.consecutive_failures == 0
    finally:
        await cancel_and_wait([beats])
        await inst.nc.close()


async def test_probes_beyond_the_limit_in_flight_wait_their_turn(nats_server: NatsServer) -> None:
    """With two probes allowed at once and instances that answer late, every instance is
    still probed and measured: the others wait, none is dropped or failed."""
    from reach.transport import connect

    conn = await connect([nats_server.url], name="few-slots")
    reg = Registrar(conn, RegistrarConfig(liveness_interval_sec=0.2, max_concurrent_probes=2))
    await reg.start()
    pending: set[asyncio.Task[None]] = set()
    foreign: list[Foreign] = []
    beats: list[asyncio.Task[None]] = []
    try:
        for n in range(6):
            inst = await _foreign(nats_server.url, f"slot-{n}", lambda m: None)

            def late(msg: Msg, me: Foreign = inst) -> None:
                async def reply() -> None:
                    await asyncio.sleep(0.05)
                    await me.nc.publish(msg.reply, me.good(msg))

                task = asyncio.create_task(reply())
                pending.add(task)
                task.add_done_callback(pending.discard)
                return None

            inst.answer = late
            foreign.append(inst)
            beats.append(asyncio.create_task(inst.heartbeat_forever()))
        for inst in foreign:
            measured = await _until(reg, inst.agent_id, lambda i: i.last_probe_ms is not None)
            assert measured.consecutive_failures == 0
        assert reg._sweeper.probes.in_flight <= 6
    finally:
        await cancel_and_wait(beats)
        for inst in foreign:
            await inst.nc.close()
        await reg.stop()
        await conn.close()
