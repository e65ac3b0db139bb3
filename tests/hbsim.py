"""Many simulated agent instances in one process, as a foreign client would run them:
plain nats-py, the wire envelopes of docs/protocol.md, an open fabric (no tokens).

Each instance announces, heartbeats every ``interval`` (spread over the interval) and
answers the registrar's probes; the simulator counts the replies to its heartbeats by the
registrar that answered them. ``sonar`` asks which registrar hears each heartbeat
partition now: a heartbeat of an unregistered agent id in that partition is answered
(``reannounce``) by the partition's owner, which names itself in its reply.
"""

from __future__ import annotations

import asyncio
import heapq
import random
import secrets
import time
from collections import Counter
from typing import Any

import nats
from nats.aio.msg import Msg

from reach.registry.partitions import partition_of
from reach.tasks import cancel_and_wait
from reach.wire import envelope, subjects
from reach.wire.modelcodec import decode_model, encode_model
from reach.wire.models import (
    AnnounceReply,
    AnnounceRequest,
    Heartbeat,
    HeartbeatReply,
    Manifest,
    ProbeReply,
)

#: announces tried per instance (a busy host may answer one late)
ANNOUNCE_ATTEMPTS = 5


def sim_manifest(agent_id: str, interval: float, timeout: float) -> Manifest:
    return Manifest.model_validate(
        {
            "agent_id": agent_id,
            "agent_name": agent_id.rsplit("-", 1)[0],
            "version": "1.0.0",
            "max_concurrency": 16,
            "capabilities": [{"name": "sim", "tags": ["sim"], "security_level": 1}],
            "health": {
                "interval_sec": interval,
                "timeout_sec": timeout,
                "failures_before_unhealthy": 2,
            },
        }
    )


def request(agent_id: str, model: Any) -> bytes:
    meta = envelope.RequestMeta(call_id=secrets.token_hex(8), caller=agent_id)
    return envelope.pack_request(meta, encode_model(model))


def ids_per_partition(prefix: str) -> list[str]:
    """One agent id in each heartbeat partition."""
    found: dict[int, str] = {}
    n = 0
    while len(found) < subjects.HEARTBEAT_PARTITIONS:
        agent_id = f"{prefix}-{n}"
        found.setdefault(partition_of(agent_id), agent_id)
        n += 1
    return [found[p] for p in range(subjects.HEARTBEAT_PARTITIONS)]


class Simulator:
    def __init__(self, url: str, prefix: str, count: int, interval: float, timeout: float):
        self.url = url
        self.interval = interval
        self.timeout = timeout
        self.ids = [f"{prefix}-{n}" for n in range(count)]
        self.instance_ids = [f"{prefix}-i{n}" for n in range(count)]
        self.index = {agent_id: n for n, agent_id in enumerate(self.ids)}
        self.nc: Any = None
        self.inbox = ""
        self.replies_by: Counter[str] = Counter()
        self.not_ok: Counter[str] = Counter()
        self.probes = 0
        #: heartbeats nobody was subscribed to hear (a partition between two owners)
        self.unheard = 0
        self.sent = 0
        self._tasks: list[asyncio.Task[None]] = []
        #: (when, instance) of the next heartbeats
        self._due: list[tuple[float, int]] = []
        self._beats: dict[int, bytes] = {}
        self._probe_replies: dict[int, bytes] = {}

    async def start(self) -> None:
        self.nc = await nats.connect(self.url, name="hbsim", max_reconnect_attempts=0)
        self.inbox = self.nc.new_inbox()
        await self.nc.subscribe(subjects.probe("*"), cb=self._on_probe)
        await self.nc.subscribe(f"{self.inbox}.*", cb=self._on_reply)
        await self.nc.flush()

    async def announce_all(self, batch: int = 25) -> int:
        accepted = 0
        for first in range(0, len(self.ids), batch):
            done = await asyncio.gather(
                *(self._announce(n) for n in range(first, min(len(self.ids), first + batch)))
            )
            accepted += sum(done)
        return accepted

    async def _announce(self, n: int) -> bool:
        agent_id = self.ids[n]
        req = AnnounceRequest(
            manifest=sim_manifest(agent_id, self.interval, self.timeout),
            instance_id=self.instance_ids[n],
            started_at=time.time(),
        )
        for attempt in range(ANNOUNCE_ATTEMPTS):  # as an Agent does, again after a timeout
            try:
                msg = await self.nc.request(
                    subjects.announce(agent_id), request(agent_id, req), 30.0
                )
                break
            except nats.errors.TimeoutError:
                if attempt == ANNOUNCE_ATTEMPTS - 1:
                    raise
        reply = envelope.unpack_reply(msg.data)
        accepted = reply.ok and decode_model(AnnounceReply, reply.body).accepted
        if accepted:  # its first heartbeat one interval on, as an Agent's
            first = self.interval * random.uniform(0.9, 1.0)
            heapq.heappush(self._due, (time.monotonic() + first, n))
        return accepted

    def beat(self) -> None:
        """Heartbeat every announced instance every interval (call before announcing)."""
        self._tasks.append(asyncio.create_task(self._beat()))

    def _heartbeat(self, n: int) -> bytes:
        """Instance ``n``'s heartbeat, encoded once: the same figures every time (the
        registrar reads neither ``seq`` nor ``sent_at``), so the simulator stays cheap."""
        data = self._beats.get(n)
        if data is None:
            hb = Heartbeat(
                agent_id=self.ids[n],
                instance_id=self.instance_ids[n],
                seq=1,
                sent_at=time.time(),
                in_flight=n % 3,
                max_concurrency=16,
            )
            data = self._beats[n] = request(self.ids[n], hb)
        return data

    async def _beat(self) -> None:
        due = self._due
        while True:
            now = time.monotonic()
            while due and due[0][0] <= now:
                at, n = heapq.heappop(due)
                await self.nc.publish(
                    subjects.heartbeat(self.ids[n]), self._heartbeat(n), reply=f"{self.inbox}.{n}"
                )
                self.sent += 1
                heapq.heappush(due, (at + self.interval, n))
            wait = due[0][0] - time.monotonic() if due else 0.02
            await asyncio.sleep(min(0.02, max(0.001, wait)))

    async def _on_reply(self, msg: Msg) -> None:
        if not msg.data:  # no responders: nobody heard the partition at that moment
            self.unheard += 1
            return
        reply = envelope.unpack_reply(msg.data)
        self.replies_by[reply.by] += 1
        if not reply.ok:
            self.not_ok[f"{reply.by}: {reply.code}"] += 1
        elif not (answer := decode_model(HeartbeatReply, reply.body)).ok:
            self.not_ok[f"{reply.by}: {answer.reason}"] += 1

    async def _on_probe(self, msg: Msg) -> None:
        agent_id = subjects.last_token(msg.subject)
        n = self.index.get(agent_id)
        if n is None or not msg.reply:
            return
        data = self._probe_replies.get(n)
        if data is None:
            answer = ProbeReply(
                agent_id=agent_id,
                instance_id=self.instance_ids[n],
                in_flight=n % 3,
                max_concurrency=16,
            )
            data = self._probe_replies[n] = envelope.pack_ok(encode_model(answer), agent_id)
        self.probes += 1
        await self.nc.publish(msg.reply, data)

    async def sonar(self, probe_ids: list[str], timeout: float = 1.0) -> dict[int, str]:
        """Which registrar answers a heartbeat of each partition now (missing: none)."""

        async def ask(partition: int, agent_id: str) -> tuple[int, str]:
            hb = Heartbeat(
                agent_id=agent_id,
                instance_id="sonar",
                seq=0,
                sent_at=time.time(),
                in_flight=0,
                max_concurrency=1,
            )
            try:
                msg = await self.nc.request(
                    subjects.heartbeat(agent_id), request(agent_id, hb), timeout
                )
            except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
                return partition, ""
            return partition, envelope.unpack_reply(msg.data).by

        answers = await asyncio.gather(*(ask(p, a) for p, a in enumerate(probe_ids)))
        return {p: by for p, by in answers if by}

    async def close(self) -> None:
        await cancel_and_wait(self._tasks)
        if self.nc is not None:
            await self.nc.close()
