"""Which heartbeats a registrar hears: those of the partitions it owns.

nats-server maps every heartbeat (``reach.v1.hb.<agent_id>``) onto its partition's
subject (``reach.v1.hbp.<partition>.<agent_id>``, :mod:`reach.registry.partitions`); each
registrar subscribes to the partitions it owns (:mod:`reach.registry.ownership`), so an
instance's heartbeats reach the one registrar that judges its silence, and no other.

On a NATS without the mapping (a server configured by hand), heartbeats stay on
``reach.v1.hb.*``: every registrar also listens there in the queue group, handles a
heartbeat of its own partitions and forwards any other to its partition's subject, where
its owner hears it. The heartbeat protocol of agents is the same either way.

Heartbeats are handed to the registrar's handler as the connection reads them (no queue
and no task between): most are answered there and then (:mod:`reach.registry.handlers`).

When a registrar takes a partition over (one joined or one died) it notes when: silence
is counted from then, never from before, so no instance is marked for a handover. A
partition given away is unsubscribed and no longer judged here.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from reach.clock import Clock
from reach.errors import ReachError
from reach.registry.ownership import Ownership
from reach.registry.partitions import partition_token
from reach.tasks import cancel_and_wait
from reach.transport import Connection, Message, Subscription
from reach.wire import subjects

__all__ = ["HeartbeatFeed"]

log = logging.getLogger("reach.registrar")

#: partition subjects whose check is kept (one per instance heard)
_MAPPED_KEPT = 1 << 18

#: takes a heartbeat as it is read off the connection: must not block
MessageHandler = Callable[[Message], None]


class HeartbeatFeed:
    """One registrar's heartbeat subscriptions, following the partitions it owns."""

    def __init__(
        self, conn: Connection, ownership: Ownership, clock: Clock, handler: MessageHandler
    ) -> None:
        self._conn = conn
        self._ownership = ownership
        self._clock = clock
        #: what a heartbeat of one of this registrar's partitions is given to
        self._handler = handler
        self._subs: dict[int, Subscription] = {}
        #: partition → when this registrar began hearing it
        self.since: dict[int, float] = {}
        #: counts the changes of ``since`` (partitions taken or given away)
        self.version = 0
        self._plain: Subscription | None = None
        self._changed = asyncio.Event()
        #: heartbeats that came on the subject without a partition and were forwarded
        self.forwarded = 0
        #: forwards being published
        self._forwarding: set[asyncio.Task[None]] = set()
        #: partition subject → its agent id if it is that agent id's partition, else ""
        #: (a heartbeat published there by hand, forwarded): asked on every heartbeat
        self._mapped: dict[str, str] = {}
        self._stopped = False

    def poke(self) -> None:
        """The live registrars may have changed: follow the partitions owned now."""
        self._changed.set()

    def pending(self) -> int:
        """Heartbeats received and not yet handled (queued behind others)."""
        waiting = sum(sub.pending for sub in self._subs.values())
        return waiting + (self._plain.pending if self._plain is not None else 0)

    def judged_since(self, agent_id: str) -> float | None:
        """When this registrar began hearing the partition of ``agent_id``; None if it
        is not this registrar's (another one judges it)."""
        return self.since.get(self._ownership.partition(agent_id))

    async def start(self) -> None:
        """Subscribe to the owned partitions, and to heartbeats not mapped onto one."""
        await self.follow()
        self._plain = await self._conn.subscribe_inline(
            subjects.HEARTBEAT_ALL, self._on_plain, queue=subjects.REGISTRAR_QUEUE
        )

    async def follow(self) -> None:
        """Subscribe to the partitions this registrar owns now, unsubscribe from those
        it gave away."""
        self._changed.clear()
        if self._stopped:
            return
        now = self._clock.time()
        owned = self._ownership.owned(now)
        given = sorted(set(self._subs) - owned)
        for partition in given:
            sub = self._subs.pop(partition)
            self.since.pop(partition, None)
            await sub.unsubscribe()
        taken = sorted(owned - set(self._subs))
        for partition in taken:
            self._subs[partition] = await self._conn.subscribe_inline(
                subjects.heartbeat_partition(partition), self._on_partition
            )
        if taken:
            await self._conn.flush()
            # counted from when the subscriptions are in place at the server
            at = self._clock.time()
            for partition in taken:
                self.since[partition] = at
        if taken or given:
            self.version += 1
            log.info(
                "registrar %s hears %d heartbeat partitions (%d taken, %d given away)",
                self._ownership.registrar_id,
                len(self._subs),
                len(taken),
                len(given),
            )

    async def run(self) -> None:
        """Follow ownership changes until cancelled."""
        while True:
            await self._changed.wait()
            await self.follow()

    async def stop(self) -> None:
        self._stopped = True
        subs = [*self._subs.values(), *([self._plain] if self._plain else [])]
        self._subs.clear()
        self.since.clear()
        self.version += 1
        self._plain = None
        for sub in subs:
            await sub.unsubscribe()
        await cancel_and_wait(list(self._forwarding))

    def _on_partition(self, msg: Message) -> None:
        subject = msg.subject
        mapped = self._mapped.get(subject)
        if mapped is None:
            agent_id = subjects.last_token(subject)
            ok = partition_token(subject) == self._ownership.partition(agent_id)
            if len(self._mapped) >= _MAPPED_KEPT:
                self._mapped.clear()
            mapped = self._mapped[subject] = agent_id if ok else ""
        if mapped:
            self._handler(msg)
        else:  # published there by hand: to the partition the agent id belongs to
            self._forward(msg, subjects.last_token(subject))

    def _on_plain(self, msg: Message) -> None:
        self._forward(msg, subjects.last_token(msg.subject))

    def _forward(self, msg: Message, agent_id: str) -> None:
        partition = self._ownership.partition(agent_id)
        if partition in self._subs:
            self._handler(msg)
            return
        self.forwarded += 1
        forward = self._conn.publish(
            subjects.heartbeat_partition(partition, agent_id), msg.data, reply=msg.reply or ""
        )
        task = asyncio.create_task(_published(forward, agent_id))
        self._forwarding.add(task)
        task.add_done_callback(self._forwarding.discard)


async def _published(forward: Awaitable[None], agent_id: str) -> None:
    try:
        await forward
    except ReachError as exc:  # NATS away: the instance's next heartbeat goes again
        log.warning("could not forward the heartbeat of %s: %s", agent_id, exc)
