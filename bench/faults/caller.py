"""The caller of a fault scenario, in its own OS process: one ``ReachClient``, open loop.

Child side (run by the scenario engine, not by hand)::

    python -m bench.faults.caller SETTINGS_JSON OUT_JSON

connects, waits until its route cache shows every instance healthy and prints ``READY
URL`` (the server it is connected to);
a line ``start`` on standard input starts the load, a line ``stop`` (or the end of the
input) ends it. Call ``i`` starts at ``t0 + i / rate`` whether or not earlier calls have
returned, so a stall shows as latency and failures, not as a lower rate. Once every call
has ended the audit writer is flushed (for a bounded time), the client closed and the
record written to OUT_JSON; then it prints ``DONE``.

The record holds, per call: its call id, start and end (``time.monotonic()``, which is
system-wide on Linux, so the engine's fault times compare), the outcome, the error and
every attempt (the instance it was sent to, when, and how it ended), and the breaker
states and outlier ejections of every instance as sampled while the load ran.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["CallerSettings", "main"]

#: the subject prefix of calls to a capability (``reach.v1.cap.<capability>[.<instance>]``)
_PREFIX = "reach.v1.cap."
_SAMPLE_SEC = 0.02
_READY_TIMEOUT = 60.0


@dataclass(frozen=True)
class CallerSettings:
    servers: list[str]
    credentials: str
    capability: str
    instances: int
    rate: float
    call_timeout_sec: float
    flush_timeout_sec: float = 10.0


@dataclass
class _Record:
    """What the caller saw, written as JSON for the engine."""

    calls: list[list[Any]] = field(default_factory=list)
    #: [time, instance, state]: breaker state changes, and the caller's outlier
    #: ejections (state "ejected", then "admitted"), as sampled
    breakers: list[list[Any]] = field(default_factory=list)
    late_starts: int = 0
    audit: dict[str, Any] = field(default_factory=dict)
    harness_errors: list[str] = field(default_factory=list)


class _Call:
    """One call: ``attempts`` holds [instance, sent, ended, outcome] per request."""

    __slots__ = ("attempts", "call_id", "end", "error", "served_by", "start")

    def __init__(self, call_id: str, start: float) -> None:
        #: empty if the call failed before it took an id (and was sent)
        self.call_id = call_id
        self.start = start
        self.end = 0.0
        self.error: str | None = None
        self.served_by = ""
        self.attempts: list[list[Any]] = []

    def row(self) -> list[Any]:
        return [self.call_id, self.start, self.end, self.error, self.served_by, self.attempts]


class _Tap:
    """Sees every request the client sends: the instance of each attempt, from the
    subject, credited to the call of the task that sends it (a call's attempts all run
    in its own task). ``ReachClient`` has no public per-attempt hook."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.by_task: dict[asyncio.Task[Any], _Call] = {}
        self.original: Any = None
        self.tapped = self._tapped  # one bound method, compared by identity

    def install(self) -> None:
        """(Again) wrap the client's request function, if it was replaced."""
        attempts = self.client._attempts  # the client's AttemptRunner
        current = attempts.request
        if current is self.tapped:
            return
        self.original = current
        attempts.request = self.tapped

    async def _tapped(self, subject: str, data: bytes, timeout: float, batch: bool) -> Any:
        task = asyncio.current_task()
        call = self.by_task.get(task) if task is not None else None
        attempt: list[Any] | None = None
        if call is not None and subject.startswith(_PREFIX):
            parts = subject[len(_PREFIX) :].split(".", 1)
            attempt = [parts[1] if len(parts) == 2 else "", time.monotonic(), 0.0, "ok"]
            call.attempts.append(attempt)
        try:
            return await self.original(subject, data, timeout, batch)
        except BaseException as exc:
            if attempt is not None:
                attempt[3] = type(exc).__name__
            raise
        finally:
            if attempt is not None:
                attempt[2] = time.monotonic()


class _Peek:
    """Awaits ``coro`` and calls ``hook`` right after its first step, before anything else
    runs on the loop: a call takes its id (a per-client prefix and a counter) in that
    synchronous first step, or none if it fails before it is sent."""

    def __init__(self, coro: Any, hook: Any) -> None:
        self.coro = coro
        self.hook = hook

    def __await__(self) -> Any:
        steps = self.coro.__await__()
        value: Any = None
        error: BaseException | None = None
        first = True
        while True:
            try:
                step = steps.throw(error) if error is not None else steps.send(value)
            except StopIteration as stop:
                if first:
                    self.hook()
                return stop.value
            except BaseException:
                if first:
                    self.hook()
                raise
            if first:
                self.hook()
                first = False
            value, error = None, None
            try:
                value = yield step
            except BaseException as exc:
                error = exc


async def _sample_breakers(client: Any, tap: _Tap, record: _Record, stop: asyncio.Event) -> None:
    seen: dict[str, str] = {}
    ejected: dict[str, bool] = {}
    while not stop.is_set():
        tap.install()
        with contextlib.suppress(Exception):  # a changed breaker API must not stop the load
            now = time.monotonic()
            for target, snap in client.breakers.snapshot().items():
                state = str(getattr(snap, "state", snap))
                if seen.get(target) != state:
                    seen[target] = state
                    record.breakers.append([now, target, state])
                out = target in client.peers and client.peers.peer(target).outlier.ejected(now)
                if ejected.get(target, False) != out:
                    ejected[target] = out
                    record.breakers.append([now, target, "ejected" if out else "admitted"])
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), _SAMPLE_SEC)


async def _load(
    client: Any, settings: CallerSettings, tap: _Tap, record: _Record, stop: asyncio.Event
) -> list[_Call]:
    from reach.errors import ReachError

    calls: list[_Call] = []
    tasks: set[asyncio.Task[None]] = set()

    async def one(call: _Call, seq: int) -> None:
        planner = client._planner  # the client's CallPlanner, which numbers its calls
        before = planner.call_seq

        def took_id() -> None:
            if planner.call_seq == before + 1:
                call.call_id = f"{planner.call_prefix}{planner.call_seq:x}"

        try:
            coro = client.call(settings.capability, {"seq": seq}, timeout=settings.call_timeout_sec)
            result = await _Peek(coro, took_id)
        except ReachError as exc:
            call.error = f"{type(exc).__name__}: {exc}"
        else:
            call.served_by = result.agent_id
            if result.call_id != call.call_id:
                record.harness_errors.append(f"call id {result.call_id} != {call.call_id}")
                call.call_id = result.call_id
        finally:
            call.end = time.monotonic()

    t0 = time.monotonic()
    seq = 0
    while not stop.is_set():
        target = t0 + seq / settings.rate
        now = time.monotonic()
        if target > now:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), target - now)
            if stop.is_set():
                break
        elif now - target > 0.010:
            record.late_starts += 1
        call = _Call("", time.monotonic())
        calls.append(call)
        task = asyncio.create_task(one(call, seq))
        tap.by_task[task] = call
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        seq += 1
    if tasks:
        await asyncio.wait(set(tasks))
    return calls


async def _audit_state(client: Any, record: _Record, settings: CallerSettings) -> None:
    audit = client.audit
    if audit is None:
        record.harness_errors.append("the client has no audit writer")
        return
    flushed = True
    try:
        await asyncio.wait_for(audit.flush(), settings.flush_timeout_sec)
    except (TimeoutError, Exception):
        flushed = False
    record.audit = {
        "flushed": flushed,
        "pending": getattr(audit, "pending", None),
        "dropped": getattr(audit, "dropped", None),
    }


async def _run(settings: CallerSettings, out: Path) -> None:
    from reach.caller.client import ReachClient

    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    record = _Record()
    client = ReachClient(
        servers=settings.servers, credentials=settings.credentials, name="faults-caller"
    )
    await client.connect()
    try:
        await client.routes.wait_for(
            lambda c: (
                sum(1 for i in c.find(settings.capability) if i.status == "healthy")
                >= settings.instances
            ),
            timeout=_READY_TIMEOUT,
        )
        tap = _Tap(client)
        tap.install()
        # the server it is connected to: a scenario may move a fault there
        print(f"READY {client.connection.connected_url}", flush=True)
        while (await reader.readline()).strip() not in (b"start", b""):
            pass

        async def until_stop() -> None:
            while (await reader.readline()).strip() not in (b"stop", b""):
                pass
            stop.set()

        watcher = asyncio.create_task(until_stop())
        sampler = asyncio.create_task(_sample_breakers(client, tap, record, stop))
        calls = await _load(client, settings, tap, record, stop)
        await sampler
        watcher.cancel()
        record.calls = [c.row() for c in calls]
        await _audit_state(client, record, settings)
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(client.close(), settings.flush_timeout_sec)
    _write(out, record)
    print("DONE", flush=True)


def _write(out: Path, record: _Record) -> None:
    out.write_text(json.dumps(asdict(record)))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    settings = CallerSettings(**json.loads(argv[0]))
    asyncio.run(_run(settings, Path(argv[1])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
