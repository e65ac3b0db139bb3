"""The sweep looks only at the records something may be due about: those whose time came,
those the view changed since, and all of them when the partitions heard change.

The sweeper runs on a ManualClock over a record view filled by hand; its probes are not
started (a dispatcher not started sends nothing), so no instance answers or fails one.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from reach.clock import ManualClock
from reach.errors import ReachError
from reach.registry.health import HealthPolicy
from reach.registry.instances import RecordView
from reach.registry.sweep import MAX_TICK_SEC, Sweeper
from reach.testing import NatsServer
from reach.transport import Connection, connect
from reach.wire.codec import Limits
from reach.wire.models import Instance, Manifest

from .conftest import manifest


class _Rig:
    def __init__(self, conn: Connection) -> None:
        self.clock = ManualClock()
        # no "young instance" rule: one probe per interval
        self.policy = HealthPolicy(self.clock, new_agent_window_sec=0.0)
        self.policy.start()
        self.view = RecordView()
        self.version = 0
        #: agent id → when its partition was taken (absent: not this registrar's)
        self.owned: dict[str, float] = {}
        self.sweeper = Sweeper(
            conn,
            view=self.view,
            policy=self.policy,
            limits=Limits(),
            max_concurrent_probes=100,
            backlog=lambda: 0,
            judged_since=self.owned.get,
            ownership_version=lambda: self.version,
        )
        self.looked_at: list[str] = []
        review = self.sweeper._review

        def counted(agent_id: str, inst: Instance, now: float) -> float | None:
            self.looked_at.append(agent_id)
            return review(agent_id, inst, now)

        self.sweeper._review = counted  # type: ignore[method-assign]
        self._revision = 0

    def put(self, agent_id: str, interval: float = 10.0) -> Instance:
        now = self.clock.time()
        inst = Instance(
            manifest=Manifest.model_validate(manifest(agent_id, interval=interval, timeout=1.0)),
            instance_id=f"{agent_id}-i",
            registered_at=now,
            last_heartbeat_at=now,
        )
        self._revision += 1
        self.view.remember(inst, self._revision)
        self.owned.setdefault(agent_id, 0.0)
        return inst

    async def sweep(self) -> tuple[list[str], float]:
        self.looked_at.clear()
        tick = await self.sweeper.sweep()
        return sorted(self.looked_at), tick


@pytest.fixture
async def rig(nats_server: NatsServer) -> AsyncIterator[_Rig]:
    conn = await connect([nats_server.url], name="test-sweep")
    yield _Rig(conn)
    await conn.close()


async def test_a_record_is_looked_at_when_its_time_comes_and_not_before(rig: _Rig) -> None:
    for agent_id in ("a-1", "b-1", "c-1"):
        rig.put(agent_id)
    assert (await rig.sweep())[0] == ["a-1", "b-1", "c-1"]  # the first sweep: all
    rig.clock.advance(1.0)
    assert (await rig.sweep())[0] == []
    rig.clock.advance(5.0)
    assert (await rig.sweep())[0] == []
    # a probe is due one interval after registration
    rig.clock.advance(4.0)
    assert (await rig.sweep())[0] == ["a-1", "b-1", "c-1"]


async def test_a_record_the_view_changed_is_looked_at_in_the_next_sweep(rig: _Rig) -> None:
    for agent_id in ("a-1", "b-1", "c-1"):
        rig.put(agent_id)
    await rig.sweep()
    rig.clock.advance(1.0)
    rig.put("b-1")  # a new revision of b-1
    rig.put("d-1")  # a new record
    assert (await rig.sweep())[0] == ["b-1", "d-1"]
    rig.clock.advance(1.0)
    assert (await rig.sweep())[0] == []
    # a revision the view does not take (older than its own) changes nothing
    stale = rig.view.by_agent["a-1"]
    rig.view.remember(stale[0], stale[1] - 1)
    assert (await rig.sweep())[0] == []


async def test_every_record_is_looked_at_when_the_partitions_heard_change(rig: _Rig) -> None:
    for agent_id in ("a-1", "b-1"):
        rig.put(agent_id)
    await rig.sweep()
    rig.clock.advance(1.0)
    assert (await rig.sweep())[0] == []
    # b-1's partition given away: nothing is due about it until the partitions change
    del rig.owned["b-1"]
    rig.version += 1
    assert (await rig.sweep())[0] == ["a-1", "b-1"]
    rig.clock.advance(10.0)
    assert (await rig.sweep())[0] == ["a-1"]  # a-1 due a probe; b-1 not judged here
    # taken back: looked at again at once
    rig.owned["b-1"] = rig.clock.time()
    rig.version += 1
    assert (await rig.sweep())[0] == ["a-1", "b-1"]


async def test_the_pause_follows_the_shortest_interval_of_the_records_held(rig: _Rig) -> None:
    rig.put("slow-1", interval=10.0)
    assert (await rig.sweep())[1] == MAX_TICK_SEC
    rig.put("fast-1", interval=2.0)
    assert (await rig.sweep())[1] == pytest.approx(0.5)
    rig.clock.advance(0.1)
    assert (await rig.sweep())[1] == pytest.approx(0.5)  # fast-1 not looked at, still held
    _, revision = rig.view.by_agent["fast-1"]
    rig.view.forget("fast-1", revision + 1)
    assert (await rig.sweep())[1] == MAX_TICK_SEC


async def test_a_record_with_a_probe_in_flight_is_looked_at_every_sweep(rig: _Rig) -> None:
    rig.put("a-1")
    rig.put("b-1")
    await rig.sweep()
    rig.clock.advance(10.0)
    await rig.sweep()  # both due a probe: started (never answered here)
    for _ in range(2):
        rig.clock.advance(5.0)
        for agent_id in ("a-1", "b-1"):  # heartbeats heard: no silence
            rig.policy.heard(agent_id, rig.clock.time())
    # due a probe again, the last still out: looked at until it ends
    assert (await rig.sweep())[0] == ["a-1", "b-1"]
    rig.clock.advance(0.5)
    assert (await rig.sweep())[0] == ["a-1", "b-1"]
    rig.sweeper._probing.discard("b-1")  # b-1's probe ended: the next one starts
    rig.clock.advance(0.5)
    assert (await rig.sweep())[0] == ["a-1", "b-1"]
    rig.clock.advance(0.5)
    assert (await rig.sweep())[0] == ["a-1"]


async def test_the_records_a_failed_sweep_did_not_get_to_are_looked_at_in_the_next(
    rig: _Rig,
) -> None:
    for agent_id in ("a-1", "b-1", "c-1"):
        rig.put(agent_id)
    await rig.sweep()
    rig.clock.advance(40.0)  # silent past eviction: each needs a write
    tried: list[str] = []

    async def away(agent_id: str, inst: Instance, now: float) -> None:
        tried.append(agent_id)
        raise ReachError("NATS away")

    rig.sweeper._act = away  # type: ignore[method-assign]
    with pytest.raises(ReachError):
        await rig.sweep()
    assert len(tried) == 1  # the sweep ended at its first write

    async def written(agent_id: str, inst: Instance, now: float) -> None:
        tried.append(agent_id)

    rig.sweeper._act = written  # type: ignore[method-assign]
    tried.clear()
    assert (await rig.sweep())[0] == ["a-1", "b-1", "c-1"]
    assert sorted(tried) == ["a-1", "b-1", "c-1"]
