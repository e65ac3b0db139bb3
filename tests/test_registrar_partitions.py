"""Heartbeat partitions and liveness apart from the record, against real nats-servers.

- nats-server's subject mapping puts a heartbeat in the partition the registrar computes;
- a heartbeat that changes nothing routing reads writes nothing a caller sees, and a
  change that matters does, within an interval;
- each partition's heartbeats reach its owner only, with the mapping and without it;
- a registrar joining takes its partitions within one interval.

The handover under load (a registrar killed among three) is in
``test_registrar_handover.py``.
"""

from __future__ import annotations

import asyncio
import random
import string
import time
from collections import Counter
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.msg import Msg

from reach.agent.agent import Agent
from reach.fabric import Fabric as ReachFabric
from reach.registry import Registrar, RegistrarConfig
from reach.registry.partitions import partition_of, partition_token
from reach.security.credentials import CredentialsFile
from reach.testing import NatsServer
from reach.transport import Connection, connect
from reach.transport.kvfollow import republish_prefix
from reach.wire import subjects

from .conftest import manifest
from .poll_helpers import until

INTERVAL = 0.5


class _Registrars:
    def __init__(self, url: str) -> None:
        self.url = url
        self.running: list[tuple[Registrar, Connection]] = []

    async def start(self, name: str, interval: float = INTERVAL) -> Registrar:
        conn = await connect([self.url], name=name)
        config = RegistrarConfig(registrar_id=name, liveness_interval_sec=interval, alerts=None)
        reg = Registrar(conn, config)
        await reg.start()
        self.running.append((reg, conn))
        return reg

    async def stop(self) -> None:
        for reg, conn in reversed(self.running):
            await reg.stop()
            await conn.close()


def _random_id(rng: random.Random) -> str:
    alphabet = string.ascii_letters + string.digits + "-_"
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))


async def test_the_partition_of_an_agent_id_is_the_one_nats_server_maps_it_to(
    mapped_server: NatsServer,
) -> None:
    rng = random.Random(28)
    ids = list(
        dict.fromkeys([f"agent-{n}" for n in range(500)] + [_random_id(rng) for _ in range(2500)])
    )
    seen: dict[str, int] = {}
    nc = await nats.connect(mapped_server.url)
    try:

        async def on(msg: Msg) -> None:
            partition = partition_token(msg.subject)
            assert partition is not None, msg.subject
            seen[subjects.last_token(msg.subject)] = partition

        await nc.subscribe(f"{subjects.HEARTBEAT_PARTITION_PREFIX}.>", cb=on)
        await nc.flush()
        for agent_id in ids:
            await nc.publish(subjects.heartbeat(agent_id), b"")
        await nc.flush()
        await until(lambda: len(seen) == len(ids), "every heartbeat mapped")
    finally:
        await nc.close()
    assert {agent_id: partition_of(agent_id) for agent_id in ids} == seen
    assert len(set(seen.values())) == subjects.HEARTBEAT_PARTITIONS  # all of them used


class _Changes:
    """The registry's changes of one agent as a caller hears them (republished): its
    record's and its route keys' (each record write is followed by its route keys')."""

    def __init__(self, agent_id: str) -> None:
        self.agent_id = agent_id
        self.count = 0
        #: republished changes heard per key kind ("agent", "cap"), and the newest
        #: stream sequence (the record's revision) of the record heard
        self.kinds: Counter[str] = Counter()
        self.record_seq = 0

    async def on(self, msg: Msg) -> None:
        if self.agent_id in msg.subject:
            self.count += 1
            key = msg.subject.removeprefix(republish_prefix(subjects.REGISTRY_BUCKET) + ".")
            kind = key.split(".", 1)[0]
            self.kinds[kind] += 1
            if kind == "agent" and msg.headers and "Nats-Sequence" in msg.headers:
                self.record_seq = max(self.record_seq, int(msg.headers["Nats-Sequence"]))

    def settled(self, revision: int) -> bool:
        """The record written at ``revision`` and the route keys written after it heard."""
        return self.record_seq >= revision and self.kinds["cap"] == self.kinds["agent"]


async def test_a_heartbeat_without_a_material_change_writes_nothing_a_caller_sees(
    mapped_server: NatsServer,
) -> None:
    regs = _Registrars(mapped_server.url)
    await regs.start("reg-a")
    changes = _Changes("steady-1")
    nc = await nats.connect(mapped_server.url)
    await nc.subscribe(f"{republish_prefix(subjects.REGISTRY_BUCKET)}.>", cb=changes.on)
    await nc.flush()
    agent = Agent(manifest("steady-1", interval=INTERVAL, timeout=0.4), servers=mapped_server.url)

    @agent.capability("echo")
    async def echo(req: Any) -> Any:
        return req

    reg = regs.running[0][0]
    try:
        async with agent:
            # announced, then its first probe latency written: the writes of a new instance
            await until(
                lambda: (
                    (rec := reg._view.get("steady-1")) is not None
                    and rec[0].last_probe_ms is not None
                ),
                "announced and probed",
            )
            # what a caller hears of those writes, the route key after the record, heard
            record = reg._view.get("steady-1")
            assert record is not None
            await until(lambda: changes.settled(record[1]), "the writes heard")
            before, heard = changes.count, reg._policy.heard_at("steady-1")
            # ten heartbeats, none of which changes what routing reads
            await until(
                lambda: (reg._policy.heard_at("steady-1") or 0) > (heard or 0) + 9 * INTERVAL,
                "ten more heartbeats heard",
                timeout=20 * INTERVAL + 5,
            )
            assert changes.count == before, "a heartbeat without a change was written"
            assert reg._heartbeats.forwarded == 0  # the server put them in their partition
            # saturated: the next heartbeat is written, a caller hears it within an interval
            agent._server.in_flight = agent.manifest.max_concurrency
            started = time.monotonic()
            await until(lambda: changes.count > before, "the change heard", timeout=5)
            assert time.monotonic() - started < 2 * INTERVAL
            agent._server.in_flight = 0
    finally:
        await nc.close()
        await regs.stop()


@pytest.mark.parametrize("mapped", [True, False], ids=["mapped", "not-mapped"])
async def test_the_heartbeats_of_a_partition_reach_its_owner_only(
    mapped: bool, mapped_server: NatsServer, nats_server: NatsServer
) -> None:
    """With the mapping the server delivers each heartbeat to its partition's owner;
    without it (a NATS configured by hand) the registrar that gets one in the queue
    group forwards it there. Either way only the owner hears it and judges it."""
    server = mapped_server if mapped else nats_server
    regs = _Registrars(server.url)
    a = await regs.start("reg-a")
    b = await regs.start("reg-b")
    agents = [
        Agent(manifest(f"split-{n}", interval=0.3, timeout=0.25), servers=server.url)
        for n in range(12)
    ]
    try:
        await until(
            lambda: len(a.partitions) + len(b.partitions) == subjects.HEARTBEAT_PARTITIONS, "split"
        )
        assert not a.partitions & b.partitions
        assert a.partitions
        assert b.partitions
        for agent in agents:
            agent.capability("echo")(_echo)
        await asyncio.gather(*(agent.start() for agent in agents))
        ids = [agent.manifest.agent_id for agent in agents]
        heard = {id(a): a._policy.heard_at, id(b): b._policy.heard_at}

        def everyone_heard() -> bool:
            return all((heard[id(a)](i) or heard[id(b)](i)) for i in ids)

        await until(everyone_heard, "every agent heard")
        await asyncio.sleep(1.0)  # a few more heartbeats each
        for agent_id in ids:
            owner, other = (a, b) if partition_of(agent_id) in a.partitions else (b, a)
            assert owner._policy.heard_at(agent_id) is not None
            assert other._policy.heard_at(agent_id) is None, f"{agent_id} heard by a non-owner"
        forwarded = a._heartbeats.forwarded + b._heartbeats.forwarded
        assert (forwarded == 0) if mapped else (forwarded > 0)
    finally:
        for agent in agents:
            await agent.stop()
        await regs.stop()


async def _echo(req: Any) -> Any:
    return req


async def test_a_registrar_joining_takes_its_partitions_within_one_interval(
    mapped_server: NatsServer,
) -> None:
    regs = _Registrars(mapped_server.url)
    try:
        a = await regs.start("reg-a")
        assert len(a.partitions) == subjects.HEARTBEAT_PARTITIONS
        started = time.monotonic()
        b = await regs.start("reg-b")
        assert b.partitions  # heard before its record told the others
        await until(
            lambda: (
                not a.partitions & b.partitions
                and len(a.partitions | b.partitions) == subjects.HEARTBEAT_PARTITIONS
            ),
            "the partitions split",
            timeout=INTERVAL,
        )
        assert time.monotonic() - started < 2 * INTERVAL  # its start included
        # a third takes a share from each
        c = await regs.start("reg-c")
        await until(
            lambda: (
                len(a.partitions) + len(b.partitions) + len(c.partitions)
                == subjects.HEARTBEAT_PARTITIONS
            ),
            "three shares",
            timeout=INTERVAL,
        )
        assert all(len(r.partitions) >= 20 for r in (a, b, c))
    finally:
        await regs.stop()


async def test_on_a_secured_fabric_an_agent_s_heartbeats_are_mapped_and_nothing_else_gets_in(
    tmp_path: Path,
) -> None:
    """Agents live in the clients' account and publish ``reach.v1.hb.<own id>`` as ever;
    the mapping, in the registrars' account, puts each in its partition after the service
    import. A client cannot publish on a partition subject itself (nothing there is
    imported): the registrar hears only what the server mapped."""
    async with ReachFabric(tmp_path / "secured", secure=True) as root:
        reg = root.registrar
        assert reg is not None
        creds = await root.add_client("mapped", 1, agent_id="mapped-1", capabilities=["echo"])
        agent = Agent(
            manifest("mapped-1", interval=INTERVAL, timeout=0.4),
            servers=root.url,
            credentials=creds,
        )
        agent.capability("echo")(_echo)
        async with agent:
            await until(lambda: (reg._policy.heard_at("mapped-1") or 0) > 0, "a heartbeat heard")
            assert reg._heartbeats.forwarded == 0  # mapped by the server, not forwarded
            secret = CredentialsFile.read(creds).secret
            errors: list[Exception] = []

            async def on_error(exc: Exception) -> None:
                errors.append(exc)

            nc = await nats.connect(
                root.url,
                user="mapped",
                password=secret,
                error_cb=on_error,
                max_reconnect_attempts=0,
            )
            try:
                forged = subjects.heartbeat_partition(partition_of("mapped-1"), "mapped-1")
                await nc.publish(forged, b"x")
                await nc.flush()
                await until(lambda: bool(errors), "the publish refused")
                assert "permissions violation" in str(errors[0]).lower()
            finally:
                await nc.close()


async def test_an_open_fabric_started_here_maps_heartbeats_too(tmp_path: Path) -> None:
    """``reach up`` without logins writes a config with the mapping alone."""
    async with ReachFabric(tmp_path / "open", secure=False) as root:
        mapped: list[str] = []
        nc = await nats.connect(root.url)

        async def on(msg: Msg) -> None:
            mapped.append(msg.subject)

        await nc.subscribe(f"{subjects.HEARTBEAT_PARTITION_PREFIX}.>", cb=on)
        await nc.flush()
        agent = Agent(manifest("open-1", interval=INTERVAL, timeout=0.4), servers=root.url)
        agent.capability("echo")(_echo)
        try:
            async with agent:
                await until(lambda: bool(mapped), "a heartbeat in its partition")
        finally:
            await nc.close()
        assert mapped[0] == subjects.heartbeat_partition(partition_of("open-1"), "open-1")
