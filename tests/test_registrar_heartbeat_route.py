"""A heartbeat on a partition subject is handled only if the subject's partition is its
agent id's; the answer is kept per subject, and the same subject is answered the same
way every time (a heartbeat published there by hand is forwarded every time)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from reach.clock import system_clock
from reach.registry import heartbeats
from reach.registry.heartbeats import HeartbeatFeed
from reach.registry.ownership import Ownership
from reach.registry.partitions import partition_of
from reach.testing import NatsServer
from reach.transport import Connection, Message, connect
from reach.wire import subjects


@dataclass
class _Msg:
    subject: str
    reply: str = ""
    data: bytes = b""


class _Feed(HeartbeatFeed):
    """Forwards are noted, not published."""

    def __init__(self, conn: Connection) -> None:
        super().__init__(conn, Ownership("r1"), system_clock, self._handle)
        self.handled: list[str] = []
        self.forwards: list[str] = []

    def _handle(self, msg: Message) -> None:
        self.handled.append(msg.subject)

    def _forward(self, msg: Message, agent_id: str) -> None:
        self.forwards.append(agent_id)


def _msg(subject: str) -> _Msg:
    # a fresh string each time, as the client library makes one per message
    return _Msg(subject=(subject + " ")[:-1])


async def test_a_heartbeat_is_handled_on_its_own_partition_and_forwarded_from_another(
    nats_server: NatsServer,
) -> None:
    conn = await connect([nats_server.url], name="test-hb-route")
    try:
        feed = _Feed(conn)
        right = subjects.heartbeat_partition(partition_of("route-1"), "route-1")
        wrong = subjects.heartbeat_partition((partition_of("route-1") + 1) % 128, "route-1")
        for _ in range(3):
            feed._on_partition(_msg(right))
            feed._on_partition(_msg(wrong))
        assert feed.handled == [right] * 3
        assert feed.forwards == ["route-1"] * 3
    finally:
        await conn.close()


async def test_the_answers_kept_are_bounded(
    nats_server: NatsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(heartbeats, "_MAPPED_KEPT", 4)
    conn = await connect([nats_server.url], name="test-hb-route")
    try:
        feed = _Feed(conn)
        for n in range(10):
            agent_id = f"route-{n}"
            feed._on_partition(_msg(subjects.heartbeat_partition(partition_of(agent_id), agent_id)))
            assert len(feed._mapped) <= 4
        assert len(feed.handled) == 10
        assert feed.forwards == []
    finally:
        await conn.close()
