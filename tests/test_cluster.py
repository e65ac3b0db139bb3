"""``reach up --cluster 3``: three nats-servers as one JetStream cluster with the registrar,
issuer and login gates on top. A node SIGKILLed while calls flow loses no registration and
no audit event, the calls go on, and the node is started again and rejoins."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from bench.faults.fabric import stream_info
from reach.agent.agent import Agent
from reach.audit import WriterConfig, read_events
from reach.caller.client import ReachClient
from reach.errors import ReachError
from reach.fabric.embedded import free_port, wait_stopped
from reach.registry.store import RegistryStore
from reach.security.membership import connect_as
from reach.tasks import cancel_and_wait
from reach.transport import Connection
from reach.wire import subjects

from .cli_helpers import REACH
from .conftest import manifest
from .poll_helpers import until
from .up_helpers import EXIT_TIMEOUT, gone, nats_children, read_line, reap

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

READY_TIMEOUT = 60.0  # three servers, a leader election and R3 buckets on a busy machine
STEP_TIMEOUT = 30.0
#: how often a check that asks the servers or reads /proc runs: three nodes share the cores
ASK_EVERY = 0.1
CALLS_PER_PHASE = 40
IN_FLIGHT = 4
AGENTS = ("cl-1", "cl-2")
REPLICATED = (subjects.AUDIT_STREAM, subjects.ALERTS_STREAM, f"KV_{subjects.REGISTRY_BUCKET}")


@dataclass
class Cluster:
    proc: subprocess.Popen[bytes]
    urls: list[str]
    store: Path

    def node_pids(self) -> dict[int, int]:
        """client port -> pid of each running nats-server child of ``reach up``."""
        nodes = {}
        for pid in nats_children(self.proc.pid):
            with contextlib.suppress(OSError):
                args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                nodes[int(args[args.index(b"-p") + 1])] = pid
        return nodes


def _spawn(tmp_path: Path, *args: str) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if k not in ("REACH_URL", "REACH_CREDS")}
    return subprocess.Popen(
        [str(REACH), "up", *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=tmp_path,
        env=env,
    )


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    port = free_port()
    proc = _spawn(tmp_path, "--cluster", "3", "--port", str(port), "--store", "store")
    try:
        line = read_line(proc, READY_TIMEOUT)
        urls = line.split()[2].split(",")
        assert line.startswith(f"Agent-Reach up: nats://127.0.0.1:{port},")
        assert "(cluster reach of 3, store store, registrar reg-" in line
        yield Cluster(proc, urls, tmp_path / "store")
    finally:
        reap(proc)


async def _replicated_on_all(conn: Connection) -> bool:
    """Every replicated stream has 3 replicas: a leader and two current followers."""
    for stream in REPLICATED:
        info = await stream_info(conn, stream)
        group = info.get("cluster", {})
        followers = group.get("replicas", [])
        if info.get("config", {}).get("num_replicas") != 3 or not group.get("leader"):
            return False
        if len(followers) != 2 or not all(f.get("current") for f in followers):
            return False
    return True


@dataclass
class Traffic:
    """Calls made in a loop by a few workers, counted."""

    client: ReachClient
    completed: int = 0
    ok: int = 0
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    #: call ids of the calls that succeeded
    ok_ids: list[str] = field(default_factory=list)
    #: (monotonic start, error) of each call that failed
    failed: list[tuple[float, ReachError]] = field(default_factory=list)
    #: monotonic time each call that succeeded returned
    ok_ends: list[float] = field(default_factory=list)

    async def worker(self) -> None:
        loop = asyncio.get_running_loop()
        while not self.stop.is_set():
            started = loop.time()
            try:
                result = await self.client.call("work", {"n": self.completed})
                self.ok += 1
                self.ok_ids.append(result.call_id)
                self.ok_ends.append(loop.time())
            except ReachError as exc:
                self.failed.append((started, exc))  # counted: it has its audit event too
            self.completed += 1
            await asyncio.sleep(0.01)  # pacing only: a steady flow, not a load test

    def reached(self, ok: int) -> bool:
        return self.ok >= ok


@dataclass
class RegistryWatch:
    """The registry read all along: every read must find every agent."""

    conn: Connection
    reads: int = 0
    missing: list[set[str]] = field(default_factory=list)

    async def run(self) -> None:
        store: RegistryStore | None = None
        while True:
            try:
                if store is None:
                    bucket = await self.conn.key_value(subjects.REGISTRY_BUCKET, create=False)
                    store = RegistryStore(bucket)
                # a get is answered by the stream leader: what the registry holds now
                listed = {a for a in AGENTS if await store.get(a) is not None}
            except (ReachError, TimeoutError):
                await asyncio.sleep(0.1)  # no JetStream leader for a moment: ask again
                continue
            if listed != set(AGENTS):
                self.missing.append(set(AGENTS) - listed)
            self.reads += 1
            await asyncio.sleep(0.1)  # pacing


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


async def _credentials_leader_port(admin: Connection, cluster: Cluster) -> int:
    """Client port of the node leading REACH_CREDENTIALS (node reach-N has the Nth URL)."""
    info = await stream_info(admin, f"KV_{subjects.CREDENTIALS_BUCKET}")
    leader: str = info["cluster"]["leader"]
    return _port(cluster.urls[int(leader.rsplit("-", 1)[1]) - 1])


async def _caller_events(admin: Connection, side: str = "caller") -> list[str]:
    """Call ids of the caller (or callee) events in REACH_AUDIT; retried while JetStream
    has no meta leader (reading makes a consumer, and only the meta leader makes
    consumers)."""
    deadline = asyncio.get_running_loop().time() + STEP_TIMEOUT
    while True:
        try:
            return [e.call_id async for e in read_events(admin) if e.side == side]
        except ReachError:
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.1)


async def _kill_and_rejoin(
    cluster: Cluster, admin: Connection, victim_port: int, traffic: Traffic
) -> None:
    """SIGKILL the node on ``victim_port`` while ``traffic`` flows: calls go on after the
    kill, the node is started again and current, calls go on after it rejoined; then the
    traffic stops."""
    victim = cluster.node_pids()[victim_port]
    os.kill(victim, signal.SIGKILL)
    at_kill = traffic.ok
    await until(
        lambda: traffic.reached(at_kill + CALLS_PER_PHASE),
        "calls after the kill",
        timeout=STEP_TIMEOUT,
    )

    async def restarted() -> bool:
        pids = cluster.node_pids()
        return len(pids) == 3 and pids.get(victim_port) not in (None, victim)

    await until(
        restarted, "the killed node started again", timeout=STEP_TIMEOUT, interval=ASK_EVERY
    )
    await until(
        lambda: _replicated_on_all(admin),
        "3 current replicas again",
        timeout=STEP_TIMEOUT,
        interval=ASK_EVERY,
    )
    at_rejoin = traffic.ok
    await until(
        lambda: traffic.reached(at_rejoin + CALLS_PER_PHASE),
        "calls after rejoin",
        timeout=STEP_TIMEOUT,
    )
    traffic.stop.set()


def _agent(cluster: Cluster, agent_id: str, *, idempotent: bool = False) -> Agent:
    described = manifest(agent_id, "work", interval=1.0, timeout=0.5)
    described["capabilities"][0]["idempotent"] = idempotent
    agent = Agent(described, servers=cluster.urls, credentials=cluster.store / "dev.creds")

    @agent.capability("work")
    async def work(request: Any) -> Any:
        return {"echo": request, "by": agent_id}

    return agent


async def test_a_killed_node_loses_no_registration_nor_audit_event_and_rejoins(
    cluster: Cluster,
) -> None:
    creds = cluster.store / "dev.creds"
    for n in (1, 2, 3):
        conf = (cluster.store / f"nats-{n}.conf").read_text()
        assert f'server_name: "reach-{n}"' in conf
        assert 'sync_interval: "always"' in conf
        assert 'name: "reach"' in conf
    # a client may log in on every node (auth callout answered on each)
    for url in cluster.urls:
        conn, _ = await connect_as([url], name="test-login", credentials=creds)
        assert conn.connected_url == url
        await conn.close()

    admin, _ = await connect_as(
        cluster.urls, name="test-admin", credentials=cluster.store / "admin.creds"
    )
    agents = [_agent(cluster, agent_id) for agent_id in AGENTS]
    client = ReachClient(
        servers=cluster.urls,
        credentials=creds,
        audit_config=WriterConfig(flush_interval=0.05, retry_max=0.25),
    )
    watch = RegistryWatch(admin)
    watcher: asyncio.Task[None] | None = None
    workers: list[asyncio.Task[None]] = []
    try:
        await until(
            lambda: _replicated_on_all(admin),
            "R3 streams",
            timeout=STEP_TIMEOUT,
            interval=ASK_EVERY,
        )
        for agent in agents:
            await agent.start()
        await client.connect()
        await client.routes.wait_for(lambda c: len(c.find("work")) == len(AGENTS), timeout=10)
        watcher = asyncio.create_task(watch.run())
        traffic = Traffic(client)
        workers = [asyncio.create_task(traffic.worker()) for _ in range(IN_FLIGHT)]
        await until(lambda: traffic.reached(CALLS_PER_PHASE), "first calls", timeout=STEP_TIMEOUT)

        # SIGKILL the node the caller is connected to (whichever streams it leads: the
        # clients on it log in again on another node, answered from the gates' memory
        # while the credentials elect a leader if it led them)
        victim_port = _port(client.connection.connected_url)
        await _kill_and_rejoin(cluster, admin, victim_port, traffic)
        await asyncio.wait_for(asyncio.gather(*workers), STEP_TIMEOUT)

        # 0 lost registrations: every read of the registry all along found both agents
        reads = watch.reads
        await until(lambda: watch.reads > reads, "a last registry read", timeout=STEP_TIMEOUT)
        assert watch.missing == []
        # 0 lost audit events: one caller event per completed call
        assert client.audit is not None
        await asyncio.wait_for(client.audit.flush(), STEP_TIMEOUT)
        assert client.audit.dropped == 0
        call_ids = await _caller_events(admin)
        missing = set(traffic.ok_ids) - set(call_ids)
        twice = len(call_ids) - len(set(call_ids))
        counts = (
            f"{len(call_ids)} caller events for {traffic.completed} calls ({traffic.ok} ok):"
            f" {len(missing)} successful calls without an event, {twice} events stored twice"
        )
        assert not missing, counts
        assert not twice, counts
        assert len(call_ids) == traffic.completed, counts
    finally:
        await cancel_and_wait([*workers, *([watcher] if watcher else [])])
        await client.close()
        for agent in agents:
            await agent.stop()
        await admin.close()

    nodes = list(cluster.node_pids().values())
    cluster.proc.send_signal(signal.SIGTERM)
    _, err = cluster.proc.communicate(timeout=EXIT_TIMEOUT)
    assert cluster.proc.returncode == 0, err.decode()
    assert b"nats-server reach-" in err  # the restart was reported
    assert all(gone(pid) for pid in nodes)


async def test_a_killed_node_loses_no_event_agents_record_for_a_caller_that_does_not(
    cluster: Cluster,
) -> None:
    """A caller that records nothing (another language's, say) leaves the audit to the
    agents: SIGKILL the node an agent is connected to while calls flow, and every call
    that succeeded still has the event of the agent that served it, none unknown."""
    creds = cluster.store / "dev.creds"
    admin, _ = await connect_as(
        cluster.urls, name="test-admin", credentials=cluster.store / "admin.creds"
    )
    agents = [_agent(cluster, agent_id) for agent_id in AGENTS]
    client = ReachClient(servers=cluster.urls, credentials=creds, audit=False)
    workers: list[asyncio.Task[None]] = []
    try:
        await until(
            lambda: _replicated_on_all(admin),
            "R3 streams",
            timeout=STEP_TIMEOUT,
            interval=ASK_EVERY,
        )
        for agent in agents:
            await agent.start()
        await client.connect()
        await client.routes.wait_for(lambda c: len(c.find("work")) == len(AGENTS), timeout=10)
        traffic = Traffic(client)
        workers = [asyncio.create_task(traffic.worker()) for _ in range(IN_FLIGHT)]
        await until(lambda: traffic.reached(CALLS_PER_PHASE), "first calls", timeout=STEP_TIMEOUT)

        victim_port = _port(agents[0].connection.connected_url)
        await _kill_and_rejoin(cluster, admin, victim_port, traffic)
        await asyncio.wait_for(asyncio.gather(*workers), STEP_TIMEOUT)

        for agent in agents:
            assert agent.audit is not None
            await asyncio.wait_for(agent.audit.flush(), STEP_TIMEOUT)
            assert agent.audit.dropped == 0
        # the caller recorded nothing; the agents recorded every call they served (a call
        # served twice, its answer lost with the node, has two: one call, merged by id)
        assert await _caller_events(admin) == []
        served = set(await _caller_events(admin, side="callee"))
        lost = set(traffic.ok_ids) - served
        assert not lost, f"{len(lost)} of {len(traffic.ok_ids)} served calls have no event"
        assert len(traffic.ok_ids) == len(set(traffic.ok_ids))
        assert len(served) <= traffic.completed
    finally:
        await cancel_and_wait(workers)
        await client.close()
        for agent in agents:
            await agent.stop()
        await admin.close()


#: a stalled node is given up within this (the connections' pings) and the calls it
#: held are retried on another node
STALL_RECOVERY = 3.0
#: how long the node stays stopped: long after the recovery, and long past any timeout
STALL = 8.0


# SIGSTOP loads nothing but has a deadline: alone, the seconds measured are the fabric's
@pytest.mark.serial
async def test_a_stalled_node_under_the_caller_costs_its_calls_seconds_not_the_stall(
    cluster: Cluster,
) -> None:
    """SIGSTOP the node the caller is connected to while idempotent calls flow: the
    stopped server keeps its sockets open, so only the connections' pings notice it.
    Calls succeed again within STALL_RECOVERY seconds of the stall's start, and none
    started after that fails, for as long as the node stays stopped."""
    creds = cluster.store / "dev.creds"
    admin, _ = await connect_as(
        cluster.urls, name="test-admin", credentials=cluster.store / "admin.creds"
    )
    agents = [_agent(cluster, agent_id, idempotent=True) for agent_id in AGENTS]
    client = ReachClient(servers=cluster.urls, credentials=creds)
    workers: list[asyncio.Task[None]] = []
    stopped: int | None = None
    loop = asyncio.get_running_loop()
    try:
        await until(
            lambda: _replicated_on_all(admin),
            "R3 streams",
            timeout=STEP_TIMEOUT,
            interval=ASK_EVERY,
        )
        for agent in agents:
            await agent.start()
        await client.connect()
        await client.routes.wait_for(lambda c: len(c.find("work")) == len(AGENTS), timeout=10)
        traffic = Traffic(client)
        workers = [asyncio.create_task(traffic.worker()) for _ in range(IN_FLIGHT)]
        await until(lambda: traffic.reached(CALLS_PER_PHASE), "first calls", timeout=STEP_TIMEOUT)

        victim_port = _port(client.connection.connected_url)
        stopped = cluster.node_pids()[victim_port]
        os.kill(stopped, signal.SIGSTOP)
        wait_stopped(stopped)
        stalled_at = loop.time()
        await asyncio.sleep(STALL)  # the calls flow meanwhile
        traffic.stop.set()
        await asyncio.wait_for(asyncio.gather(*workers), STEP_TIMEOUT)
        moved_to = client.connection.connected_url
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)
        await cancel_and_wait(workers)
        await client.close()
        for agent in agents:
            await agent.stop()
        await admin.close()

    assert moved_to != f"nats://127.0.0.1:{victim_port}"
    recovered = [t for t in traffic.ok_ends if t >= stalled_at]
    assert recovered, f"no call succeeded in {STALL} s of a stalled node"
    assert recovered[0] - stalled_at <= STALL_RECOVERY, (
        f"the first call succeeded {recovered[0] - stalled_at:.2f} s into the stall"
    )
    late = [
        f"{t - stalled_at:.2f} s: {type(exc).__name__}: {exc}"
        for t, exc in traffic.failed
        if t >= stalled_at + STALL_RECOVERY
    ]
    assert not late, f"calls started after the recovery that failed: {late}"
    assert len(recovered) >= CALLS_PER_PHASE  # the calls went on, not a trickle


async def test_every_node_dies_with_a_killed_reach_up(cluster: Cluster) -> None:
    nodes = list(cluster.node_pids().values())
    assert len(nodes) == 3
    cluster.proc.kill()
    cluster.proc.wait(EXIT_TIMEOUT)
    for pid in nodes:
        what = f"nats-server {pid} gone after reach up was killed"
        await until(functools.partial(gone, pid), what, timeout=EXIT_TIMEOUT)


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        (("--cluster", "2"), "at least 3 nodes"),
        (("--cluster", "3", "--servers", "nats://127.0.0.1:4222"), "drop --servers"),
        (("--cluster", "3", "--replicas", "5"), "needs at least 5 nodes"),
    ],
)
def test_cluster_options_are_checked_before_anything_starts(
    tmp_path: Path, args: tuple[str, ...], reason: str
) -> None:
    proc = _spawn(tmp_path, "--port", str(free_port()), *args)
    out, err = proc.communicate(timeout=EXIT_TIMEOUT)
    assert proc.returncode == 2
    assert out == b""
    lines = err.decode().strip().splitlines()
    assert len(lines) == 1, lines
    assert reason in lines[0]
    assert not (tmp_path / ".reach").exists()


#: a login answered within this while the credentials' stream elects a leader: well under
#: the server's auth timeout (5 s), past which the client is refused
LOGIN_BOUND = 1.5
#: logins are tried on the surviving nodes for this long after the kill (an election)
ELECTION_WINDOW = 8.0


async def test_logins_are_answered_while_the_credentials_elect_a_leader(
    cluster: Cluster,
) -> None:
    """SIGKILL the node leading KV_REACH_CREDENTIALS: while that stream elects a new
    leader, every new login on the surviving nodes is answered from the gates' memory,
    quickly, and none is refused. A server hands each login to any gate of the queue
    group, one behind a route too; one handed to the killed node's gate before the
    route's loss was noticed goes unanswered and is sent again by the client."""
    creds = cluster.store / "dev.creds"
    admin, _ = await connect_as(
        cluster.urls, name="test-admin", credentials=cluster.store / "admin.creds"
    )
    try:
        await until(
            lambda: _replicated_on_all(admin),
            "R3 streams",
            timeout=STEP_TIMEOUT,
            interval=ASK_EVERY,
        )
        leader = await _credentials_leader_port(admin, cluster)
    finally:
        await admin.close()
    survivors = [url for url in cluster.urls if _port(url) != leader]
    os.kill(cluster.node_pids()[leader], signal.SIGKILL)

    # (url, started after the kill, took in all, the gate's answer took, error)
    logins: list[tuple[str, float, float, float, str]] = []
    loop = asyncio.get_running_loop()
    killed = loop.time()
    while loop.time() < killed + ELECTION_WINDOW:
        for url in survivors:
            started = loop.time()
            try:
                conn, _ = await connect_as([url], name="test-login", credentials=creds)
            except ReachError as exc:
                logins.append((url, started - killed, loop.time() - started, 0.0, str(exc)))
                continue
            answer = conn.login_took
            assert answer is not None
            logins.append((url, started - killed, loop.time() - started, answer, ""))
            await conn.close()
    assert len(logins) >= 2 * len(survivors)
    assert [login for login in logins if login[4]] == []  # none refused
    assert [login for login in logins if login[3] > LOGIN_BOUND] == []  # the gate is quick
    # a login whose request the server gave to the killed node's gate in the instant
    # before it learnt that node was gone is lost, and sent again: only right after it
    resent = [login for login in logins if login[2] > LOGIN_BOUND]
    assert all(login[1] < 1.0 for login in resent), resent
