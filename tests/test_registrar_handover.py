"""Kill one of three registrars (SIGKILL, its own process) under 5,000 simulated
instances heartbeating through the server's partition mapping: its partitions are taken
over within the time its record takes to expire, and no instance is marked unhealthy or
evicted for the handover (silence is counted from the takeover, never from before).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from reach.registry.ownership import LIVE_INTERVALS
from reach.registry.store import RegistryStore
from reach.testing import NatsServer
from reach.transport import connect
from reach.wire import subjects

from .hbsim import Simulator, ids_per_partition
from .registrar_helpers import RegistrarProcess

# a three-registrar fault scenario of 30 s and more: `make test-long`
pytestmark = [pytest.mark.slow, pytest.mark.faults_long, pytest.mark.timeout(400)]

INSTANCES = 5_000
#: the instances' heartbeat interval, and their probe timeout
HB_INTERVAL = 5.0
HB_TIMEOUT = 4.0
#: how often each registrar refreshes its record
REG_INTERVAL = 1.0
#: a registrar's sweep runs at least this often (``reach.registry.sweep.MAX_TICK_SEC``)
SWEEP_TICK = 1.0


@pytest.fixture
def registrar_processes(
    mapped_server: NatsServer, tmp_path: Path
) -> Iterator[list[RegistrarProcess]]:
    logs = [(tmp_path / f"reg-{n}.log").open("w") for n in range(3)]
    procs = [
        RegistrarProcess(mapped_server.url, f"reg-{n}", REG_INTERVAL, logs[n]) for n in range(3)
    ]
    try:
        for proc in procs:
            assert proc.ready.wait(30), f"{proc.registrar_id} did not start: {proc.lines}"
        yield procs
    finally:
        for proc in procs:
            proc.stop()
        for log in logs:
            log.close()


async def _owners(sim: Simulator, probe_ids: list[str]) -> dict[int, str]:
    return await sim.sonar(probe_ids, timeout=2.0)


async def test_killing_one_of_three_registrars_hands_its_share_over_and_flaps_nobody(
    mapped_server: NatsServer, registrar_processes: list[RegistrarProcess]
) -> None:
    sim = Simulator(mapped_server.url, "sim", INSTANCES, HB_INTERVAL, HB_TIMEOUT)
    await sim.start()
    probe_ids = ids_per_partition("sonar")
    try:
        ids = {p.registrar_id for p in registrar_processes}
        owners: dict[int, str] = {}
        deadline = time.monotonic() + 30
        # the three have seen each other's records and split the partitions
        while time.monotonic() < deadline:
            owners = await _owners(sim, probe_ids)
            if len(owners) == subjects.HEARTBEAT_PARTITIONS and set(owners.values()) == ids:
                break
            await asyncio.sleep(0.2)
        assert len(owners) == subjects.HEARTBEAT_PARTITIONS
        assert set(owners.values()) == ids
        sim.beat()
        started = time.monotonic()
        assert await sim.announce_all() == INSTANCES
        print(f"{INSTANCES} announced in {time.monotonic() - started:.1f}s")
        # every instance heard at least once by its owner
        await asyncio.sleep(HB_INTERVAL * 1.2)
        victim = registrar_processes[0]
        share = sorted(p for p, by in owners.items() if by == victim.registrar_id)
        killed = time.monotonic()
        victim.kill()
        # its record expires LIVE_INTERVALS of its intervals after its last refresh; the
        # survivors see it at their next sweep
        bound = LIVE_INTERVALS * REG_INTERVAL + SWEEP_TICK + 1.0
        taken: dict[int, str] = {}
        while time.monotonic() - killed < bound + 5:
            taken = await _owners(sim, [probe_ids[p] for p in range(len(probe_ids))])
            if len(taken) == len(probe_ids) and victim.registrar_id not in taken.values():
                break
            await asyncio.sleep(0.1)
        handed_over = time.monotonic() - killed
        print(f"{len(share)} partitions handed over {handed_over:.2f}s after the kill")
        assert len(taken) == subjects.HEARTBEAT_PARTITIONS
        assert victim.registrar_id not in taken.values()
        assert handed_over < bound, f"handed over after {handed_over:.2f}s"
        # only its share moved
        moved = {p: (by, taken[p]) for p, by in owners.items() if p not in share and taken[p] != by}
        assert moved == {}, [line for proc in registrar_processes for line in proc.lines]
        # the new owners hear the instances of their new partitions from the takeover on:
        # past the time two missed heartbeats would mark them (and then some)
        await asyncio.sleep(2.5 * HB_INTERVAL)
        marks = [line for proc in registrar_processes for line in proc.marks]
        assert marks == [], marks[:5]
        conn = await connect([mapped_server.url], name="check")
        try:
            instances, _ = await (await RegistryStore.open(conn, create=False)).snapshot()
        finally:
            await conn.close()
        assert len(instances) == INSTANCES
        assert [i.agent_id for i in instances if i.status != "healthy"] == []
        assert sum(sim.replies_by.values()) > 0
        assert sim.not_ok == {}  # no heartbeat was told to announce again
    finally:
        await sim.close()
