"""A full disk under the fabric's JetStream store: named, and recovered by itself.

End to end (``long``): `reach up` runs with its store on a small disk of its own (a
tmpfs: a real filesystem that really fills); an agent serves and a client calls it,
every call leaving an audit event. A file then fills the disk. Calls go on; the client's
audit writer, a KV write, `reach doctor`, `reach up`'s output and the alert `store_full`
name the full store, while the audit writer holds what it cannot write (in memory, then
in its spool). Once the file is deleted the fabric recovers by itself within 10 s: `reach
up` starts its nats-server again (only a start reopens a store that met a write error),
the writers send what they held, and every call has exactly one audit event, by call id.

The parts on their own: what a server's health says of its store, how an unanswered
write becomes a ``StoreFull`` (the registrars say why), the supervisor's guard of a
store, doctor's verdict, and the audit stream's size cap fitted to a server's storage
limit (a store too small for it is named with the space it needs).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import nats
import pytest

from bench.faults.fabric import NoSmallDisk, fill, mount_small_disk, unmount
from reach.audit import WriterConfig, read_events
from reach.audit.alerts import AlertEngine
from reach.audit.streams import StreamSettings, ensure_streams
from reach.caller.client import ReachClient
from reach.clock import ManualClock
from reach.errors import NoResponders, ReachError, StoreFull
from reach.fabric.doctor import Evidence, conclude
from reach.fabric.embedded import free_port
from reach.fabric.storewatch import Checkup, DiskRoom, HealthPoll, StoreGuard
from reach.fabric.supervisor import RestartPolicy, Supervisor
from reach.registry import Registrar
from reach.security.membership import connect_as
from reach.testing import NatsServer
from reach.transport import Connection, connect
from reach.transport.serverhealth import ServerHealth, parse_health, store_problem
from reach.transport.storestate import problem_in_ping_answer
from reach.wire import codec, envelope, subjects
from reach.wire.models import RegistrarRecord

from .calls_helpers import capability, make_agent
from .cli_helpers import CLEAN_ENV, REACH, reach_cli
from .poll_helpers import until
from .up_helpers import EXIT_TIMEOUT, READY_TIMEOUT

#: once the disk has room again, the fabric takes writes again within this
RECOVERY_SEC = 10.0
#: how long the full store may take to be named (a write's timeout, a health round)
NAMED_WITHIN = 30.0


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs of its own (``bench.faults.fabric.DISK_MB``), unmounted at the end; the
    test is skipped where mounting one is not allowed (it needs root)."""
    where = tmp_path / "disk"
    try:
        mount_small_disk(where)
    except NoSmallDisk as exc:
        pytest.skip(str(exc))
    try:
        yield where
    finally:
        unmount(where)


@dataclass
class Load:
    """Calls made one after another, as a steady trickle: their ids and failures."""

    made: int = 0
    ok: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)


async def _call_steadily(client: ReachClient, load: Load, stop: asyncio.Event) -> None:
    while not stop.is_set():
        load.made += 1
        try:
            result = await client.call("echo", {"n": load.made}, timeout=10.0)
        except ReachError as exc:
            load.failed.append(f"{type(exc).__name__}: {exc}")
        else:
            load.ok.append(result.call_id)
        # a trickle, not a flood: the test is about the disk, not about load
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.05)


@pytest.fixture
async def reach_up_on(small_disk: Path, tmp_path: Path) -> AsyncIterator[tuple[str, Path, Path]]:
    """`reach up` with its store on ``small_disk``: its URL, store and stderr's file."""
    port = free_port()
    store = small_disk / "store"
    log = tmp_path / "reach-up.err"
    with log.open("wb") as err:
        proc = subprocess.Popen(  # noqa: ASYNC220 - fork+exec, returns at once
            [REACH, "up", "--port", str(port), "--store", str(store)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=err,
            env={**CLEAN_ENV, "PYTHONUNBUFFERED": "1"},
        )
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), READY_TIMEOUT)
        assert line.startswith(b"Agent-Reach up"), (line, log.read_text())
        yield f"nats://127.0.0.1:{port}", store, log
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=EXIT_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


async def _doctor(url: str, creds: Path) -> dict[str, object]:
    code, out, err = await reach_cli(
        "doctor", "echo", "--json", "--servers", url, "--creds", str(creds)
    )
    assert code == 0, err
    result: dict[str, object] = json.loads(out)
    return result


async def _alerts(url: str, creds: Path) -> list[dict[str, object]]:
    code, out, err = await reach_cli(
        "alerts", "--rule", "store_full", "--json", "--servers", url, "--creds", str(creds)
    )
    assert code == 0, err
    return [json.loads(line) for line in out.splitlines() if line.strip()]


# `reach up` started, a fill, a recovery and an audit read: `make test-long`
@pytest.mark.long
async def test_a_full_disk_is_named_and_the_fabric_recovers_once_space_is_freed(
    reach_up_on: tuple[str, Path, Path], small_disk: Path
) -> None:
    url, store, log = reach_up_on
    creds = store / "dev.creds"
    agent, _ = make_agent(url, "disk-1", capability("echo", idempotent=True))
    agent.credentials = creds
    # little memory: what the stream does not take goes to the spool soon
    client = ReachClient(
        servers=[url],
        credentials=creds,
        audit_config=WriterConfig(max_buffer=64, flush_interval=0.05, retry_max=0.25),
    )
    admin: Connection | None = None
    load, stop = Load(), asyncio.Event()
    caller: asyncio.Task[None] | None = None
    filler: Path | None = None
    try:
        await agent.start()
        await client.connect()
        await client.routes.wait_for(lambda c: bool(c.find("echo")), timeout=30)
        admin, _ = await connect_as([url], name="test-disk-admin", credentials=creds)
        bucket = await admin.key_value("DISK_TEST")
        await bucket.put("before", b"x")
        caller = asyncio.create_task(_call_steadily(client, load, stop))
        await until(lambda: len(load.ok) >= 20, "calls before the disk fills", timeout=30)
        writer = client.audit
        assert writer is not None

        filler = await asyncio.to_thread(fill, small_disk)

        # the audit writer names the full store, and keeps what it cannot write
        error = await until(
            lambda: writer.last_error if isinstance(writer.last_error, StoreFull) else None,
            "the audit writer's error names the full store",
            timeout=NAMED_WITHIN,
        )
        assert "no space left on device" in str(error)
        assert "REACH_AUDIT" in str(error)
        await until(
            lambda: writer.spool is not None and writer.spool.events > 0,
            "the audit writer spools what the stream does not take",
            timeout=NAMED_WITHIN,
        )
        # a write to a bucket says so too, instead of a bare timeout
        with pytest.raises(StoreFull, match="no space left on device"):
            await bucket.put("during", os.urandom(256 * 1024))
        # reach doctor names it first, and reach up says it
        diagnosis = await _doctor(url, creds)
        assert diagnosis["layer"] == "fabric", diagnosis
        assert "no space left on device" in str(diagnosis["conclusion"])
        said = await until(
            lambda: "its JetStream store takes no writes" in log.read_text() and log.read_text(),
            "reach up says the store takes no writes",
            interval=0.1,
        )
        assert "no space left on device" in said, said
        # calls went on meanwhile
        served_while_full = len(load.ok)
        await until(lambda: len(load.ok) > served_while_full + 10, "calls while the disk is full")

        await asyncio.to_thread(filler.unlink)
        freed_at = time.monotonic()
        filler = None
        await until(
            lambda: writer.pending == 0 and writer.last_error is None,
            "every held audit event written once space is freed",
            timeout=RECOVERY_SEC,
        )
        await until(
            lambda: "takes writes again" in log.read_text(),
            "reach up says the store takes writes again",
            timeout=max(0.0, freed_at + RECOVERY_SEC - time.monotonic()),
            interval=0.1,
        )
        assert time.monotonic() - freed_at < RECOVERY_SEC
        assert "has room again" in log.read_text()
        await bucket.put("after", b"x")
        assert (await _doctor(url, creds))["layer"] != "fabric"
        # the alert, stored once the store took writes again
        (alert,) = await until(
            lambda: _alerts(url, creds), "the store_full alert stored", interval=0.5
        )
        assert alert["severity"] == "critical"
        assert "no space left on device" in str(alert["summary"])

        stop.set()
        await caller
        caller = None
        await asyncio.wait_for(writer.flush(), 30)
        assert writer.dropped == 0
    finally:
        stop.set()
        if caller is not None:
            caller.cancel()
            with contextlib.suppress(BaseException):
                await caller
        if filler is not None:
            filler.unlink(missing_ok=True)
        await client.close()
        await agent.stop()
    assert admin is not None
    try:
        ids = [e.call_id async for e in read_events(admin) if e.side == "caller"]
    finally:
        await admin.close()
    # one event per call, by call id: none lost, none twice (a failed call has its own,
    # without an id if it failed before it was sent)
    assert len(ids) == load.made, (len(ids), load.made, load.failed[:3])
    sent = [i for i in ids if i]
    assert len(set(sent)) == len(sent)
    assert set(load.ok) <= set(sent)


# -- the parts on their own ---------------------------------------------------------------


def _answer(*errors: str, status: str = "error", name: str = "reach") -> bytes:
    data: dict[str, object] = {"status": status if errors else "ok"}
    if errors:
        data["errors"] = [{"type": 4, "error": e} for e in errors]
    return json.dumps({"server": {"name": name, "id": "NID"}, "data": data}).encode()


FULL = (
    "JetStream stream 'REACH > REACH_AUDIT' write error: write"
    " /store/nats/jetstream/REACH/streams/REACH_AUDIT/msgs/1.blk: no space left on device"
)


def test_a_servers_health_names_a_full_store_and_jetstream_disabled() -> None:
    full = parse_health(_answer(FULL))
    assert full is not None
    assert full.name == "reach"
    assert not full.ok
    assert store_problem(full) == f"reach: out of disk space ({FULL})"
    off = parse_health(
        json.dumps(
            {"server": {"name": "reach-2", "id": "N2"}, "data": {"error": "JetStream not enabled"}}
        ).encode()
    )
    assert off is not None
    assert (store_problem(off) or "").startswith("reach-2: JetStream disabled by the server")
    fine = parse_health(_answer())
    assert fine is not None
    assert fine.ok
    assert store_problem(fine) is None
    behind = parse_health(_answer("JetStream stream 'REACH > KV_X' is not current"))
    assert behind is not None
    assert store_problem(behind) is None
    assert parse_health(b"not json") is None
    assert parse_health(b'{"server": 1}') is None


class _Room:
    """The disk a guard measures: full until told otherwise."""

    def __init__(self) -> None:
        self.free = 0

    def __call__(self, path: Path) -> DiskRoom:
        return DiskRoom(free=self.free, size=256 << 20)


def _told(poll: HealthPoll, *errors: str, at: float | None = None) -> None:
    poll.latest = {"reach": ServerHealth("reach", "NID", tuple(errors))}
    poll.answered_at = time.monotonic() if at is None else at


async def _no_connection() -> Connection:
    raise AssertionError("the guard reads the poll's answers; it never connects")


def test_the_guard_names_a_full_store_and_restarts_its_server_once_the_disk_has_room() -> None:
    poll = HealthPoll(_no_connection)
    room = _Room()
    guard = StoreGuard(poll, Path("/store/nats"), room=room)
    assert guard.check() == Checkup()  # no answer since the server started
    _told(poll)
    assert guard.check() == Checkup()
    _told(poll, FULL)
    full = guard.check()
    assert "takes no writes" in full.said
    assert "no space left on device" in full.said
    assert "0 KiB of 256 MiB free; 13 MiB needed" in full.said
    assert full.restart == ""  # no room: a restart would find the disk full again
    assert guard.check() == Checkup()  # said once
    room.free = 12 << 20
    assert guard.check() == Checkup()  # less than 5 % of the disk
    room.free = 200 << 20
    back = guard.check()
    assert back.said == ""
    assert "has room again (200 MiB free" in back.restart
    guard.started()
    _told(poll, FULL, at=time.monotonic() - 1)  # an answer from before the restart
    assert guard.check() == Checkup()
    _told(poll)
    assert guard.check() == Checkup(said="its JetStream store takes writes again")
    assert guard.problem == ""


class _Child:
    """A supervised child whose checks the test scripts."""

    label = "thing"

    def __init__(self, checks: list[Checkup]) -> None:
        self.running = True
        self.checks = checks
        self.starts = self.stops = 0

    def exit_note(self) -> str:
        return "it never exits"

    def check(self) -> Checkup:
        return self.checks.pop(0) if self.checks else Checkup()

    async def start(self) -> None:
        self.starts += 1
        self.running = True

    async def stop(self) -> None:
        self.stops += 1
        self.running = False


async def test_the_supervisor_says_what_a_check_finds_and_restarts_the_child_it_asks_for() -> None:
    said: list[str] = []
    child = _Child([Checkup(said="store full"), Checkup(), Checkup(restart="room again")])
    supervisor = Supervisor([child], report=said.append, policy=RestartPolicy(delay=0.01))
    stop = asyncio.Event()
    running = asyncio.create_task(supervisor.run(stop))
    try:
        await until(lambda: child.starts, "the child started again")
    finally:
        stop.set()
        assert await running is None
    assert said == ["thing: store full", "thing: room again"]
    assert (child.stops, child.starts) == (1, 1)
    assert supervisor.restarts == {"thing": 1}


async def test_an_unanswered_write_is_named_by_the_store_problem_the_registrars_report(
    nats_server: NatsServer, registrar: Registrar
) -> None:
    problem = f"reach: out of disk space ({FULL})"
    registrar.store_changed(problem)
    conn = await connect([nats_server.url], name="test-store-full")
    try:
        nowhere = await conn.stream("REACH_NOWHERE", check=False)
        with pytest.raises(StoreFull, match="no space left on device") as caught:
            await nowhere.publish("reach.nowhere.x", b"", msg_id="m-1", timeout=1.0)
        assert caught.value.problem == problem
        assert "publish to REACH_NOWHERE: not stored" in str(caught.value)
    finally:
        await conn.close()
    registrar.store_changed("")
    conn = await connect([nats_server.url], name="test-store-fine")
    try:
        nowhere = await conn.stream("REACH_NOWHERE", check=False)
        with pytest.raises(NoResponders):  # what it is: nobody stores that subject
            await nowhere.publish("reach.nowhere.x", b"", msg_id="m-2", timeout=1.0)
    finally:
        await conn.close()


def test_doctor_names_a_store_that_takes_no_writes_before_anything_else() -> None:
    problem = f"reach: out of disk space ({FULL})"
    diagnosis = conclude(
        Evidence(target="echo", now=time.time(), registrar_answered=True, store_problem=problem)
    )
    assert diagnosis.layer == "fabric"
    assert diagnosis.conclusion == f"the JetStream store takes no writes: {problem}"
    fabric = diagnosis.steps[-1]
    assert fabric.verdict == "fail"
    assert any(f.startswith("JetStream store takes NO WRITES: reach:") for f in fabric.findings)


def test_store_full_fires_critical_once_a_minute() -> None:
    clock = ManualClock(1000.0)
    engine = AlertEngine(clock=clock)
    alert = engine.store_full("reach: out of disk space (no space left on device)")
    assert alert is not None
    assert alert.rule == "store_full"
    assert alert.severity == "critical"
    assert "no space left on device" in alert.summary
    assert engine.store_full("reach: out of disk space (again)") is None
    clock.advance(61.0)
    assert engine.store_full("reach: out of disk space (again)") is not None


def test_a_registrar_record_leaves_out_a_store_problem_it_does_not_have() -> None:
    record = RegistrarRecord(registrar_id="reg-1", started_at=1.0, seen_at=2.0, interval_sec=5.0)
    assert set(codec.decode(record.encode())) == {
        "registrar_id",
        "started_at",
        "seen_at",
        "interval_sec",
    }  # a registrar of an earlier release reads it
    said = record.model_copy(update={"store_problem": "reach: out of disk space"})
    assert problem_in_ping_answer(envelope.pack_ok(said.encode(), "reg-1")) == (
        "reach: out of disk space"
    )


@contextlib.contextmanager
def _limited(tmp_path: Path, limit: int) -> Iterator[NatsServer]:
    """A nats-server whose JetStream storage limit is ``limit`` bytes (where it would
    otherwise take 75 % of the disk space free at its start), on ``tmp_path``'s store."""
    conf = tmp_path / "limit.conf"
    conf.write_text(f"jetstream {{ max_file_store: {limit} }}\n")
    with NatsServer(store_dir=tmp_path / "js", config_file=conf) as server:
        yield server


async def _audit_cap(url: str) -> int:
    nc = await nats.connect(url)
    try:
        info = await nc.jetstream().stream_info(subjects.AUDIT_STREAM)
    finally:
        await nc.close()
    return int(info.config.max_bytes or -1)


async def test_the_audit_streams_cap_is_halved_until_as_much_again_stays_free(
    tmp_path: Path,
) -> None:
    with _limited(tmp_path, 200 << 20) as server:
        conn = await connect([server.url], name="test-store-room")
        try:
            await ensure_streams(conn)
        finally:
            await conn.close()
        # 1 GiB … 128 MiB need twice that: more than 200 MiB
        assert await _audit_cap(server.url) == 64 << 20
    # started again with a limit below what the stream reserves (a fuller disk): it
    # opens as it is, with no update the server would refuse
    with _limited(tmp_path, 50 << 20) as server:
        conn = await connect([server.url], name="test-store-room")
        try:
            audit, _ = await ensure_streams(conn)
            assert await audit.publish(subjects.audit("echo", "t"), b"x", msg_id="m", timeout=5)
        finally:
            await conn.close()
        assert await _audit_cap(server.url) == 64 << 20


async def test_a_store_too_small_for_the_audit_stream_is_named_with_the_space_it_needs(
    tmp_path: Path,
) -> None:
    with _limited(tmp_path, 100 << 20) as server:
        conn = await connect([server.url], name="test-store-room")
        try:
            with pytest.raises(StoreFull, match="free at least 171 MiB") as caught:
                await ensure_streams(conn, StreamSettings())
            # a cap asked below the floor is taken as asked where it fits
            await ensure_streams(conn, StreamSettings(audit_max_bytes=32 << 20))
        finally:
            await conn.close()
        assert await _audit_cap(server.url) == 32 << 20
    assert "REACH_AUDIT" in str(caught.value)
    assert "64 MiB" in str(caught.value)
