"""A fabric's JetStream store that takes no writes: noticed, said, and recovered.

What nats-server does when the disk under its store fills (``no space left on
device``): a single server keeps JetStream on, but the stream whose write failed keeps
that error and refuses every later write, without answering the publisher, until the
stream is opened again, which happens only when the server starts; a server of a cluster
disables JetStream altogether ("JetStream out of resources, will be DISABLED"), and only
a restart (or a config reload that turns JetStream off and on) enables it again. Freeing
space alone therefore mends nothing: the server must be started again. Both report the
problem in their health (``reach.transport.serverhealth``), read here through the system
account's user of a fabric with logins.

* ``HealthPoll`` asks the servers' health every second on a connection of its own.
* The registrar part polls it and tells its registrar (``Registrar.store_changed``):
  clients' writes that go unanswered then raise ``StoreFull`` (they ask the registrar),
  ``reach doctor`` says so, and the alert ``store_full`` is raised.
* ``StoreGuard`` is ``reach up``'s supervisor's look at one server it started: it says
  when the store fails and when it takes writes again (``reach up``'s output), and has
  the server started again once the disk of its store has room (``room_needed``); the
  writers then send what they held (the audit writers' memory and spools).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from reach.errors import ReachError
from reach.tasks import cancel_and_wait
from reach.transport import Connection, connect
from reach.transport.serverhealth import ServerHealth, server_health, store_problem

__all__ = [
    "CHECK_EVERY_SEC",
    "Checkup",
    "DiskRoom",
    "HealthPoll",
    "StoreGuard",
    "disk_room",
    "fabric_store_problem",
    "room_needed",
]

log = logging.getLogger("reach.fabric")

#: how often the servers' health is asked
CHECK_EVERY_SEC = 1.0
#: a server that answers nothing within this is left out of that round
ANSWER_TIMEOUT = 1.0
#: after a failed connect, the poll tries again this much later
CONNECT_AGAIN_SEC = 5.0


def room_needed(size: int) -> int:
    """Free bytes the disk of a store needs before its server is started again: 5 % of
    the disk, at least 1 MiB and at most 64 MiB (a restart with less would fill it at
    once)."""
    return max(1 << 20, min(64 << 20, size // 20))


@dataclass(frozen=True, slots=True)
class DiskRoom:
    """The space of the filesystem a directory is on."""

    free: int
    size: int

    @property
    def enough(self) -> bool:
        return self.free >= room_needed(self.size)


def disk_room(path: Path) -> DiskRoom | None:
    """The room on the filesystem of ``path`` (of its nearest existing parent); None if
    it cannot be read."""
    for where in (path, *path.parents):
        try:
            stat = os.statvfs(where)
        except FileNotFoundError:
            continue
        except OSError:
            return None
        return DiskRoom(free=stat.f_bavail * stat.f_frsize, size=stat.f_blocks * stat.f_frsize)
    return None


def fabric_store_problem(answers: Sequence[ServerHealth]) -> str:
    """What the servers' answers say of their stores, one line ("" for nothing)."""
    return "; ".join(p for p in (store_problem(h) for h in answers) if p)


class HealthPoll:
    """The servers' health, asked every ``CHECK_EVERY_SEC`` on a connection made by
    ``connect`` (a system account user's), until cancelled. ``latest`` holds the last
    answers by server name, ``answered_at`` when (monotonic); ``on_answers`` is called
    with each round's."""

    def __init__(
        self,
        connect: Callable[[], Awaitable[Connection]],
        *,
        expect: int = 1,
        on_answers: Callable[[list[ServerHealth]], None] | None = None,
    ) -> None:
        self._connect = connect
        self._expect = expect
        self._on_answers = on_answers
        self._conn: Connection | None = None
        #: the connection being made: a stop while it is closes it once it is made
        self._connecting: asyncio.Future[Connection] | None = None
        self._task: asyncio.Task[None] | None = None
        self.latest: dict[str, ServerHealth] = {}
        self.answered_at = float("-inf")

    @classmethod
    def as_user(
        cls,
        servers: Sequence[str],
        user: str,
        password: str,
        *,
        on_answers: Callable[[list[ServerHealth]], None] | None = None,
    ) -> HealthPoll:
        """A poll of every server of ``servers``, asking as ``user`` (the system
        account's: only it may ask the servers of their health)."""

        async def system_connection() -> Connection:
            return await connect(
                servers,
                name="reach-up-store-health",
                user=user,
                password=password,
                connect_timeout=2.0,
            )

        return cls(system_connection, expect=len(servers), on_answers=on_answers)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="reach-store-health")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task])
            self._task = None
        connecting, self._connecting = self._connecting, None
        if connecting is not None:
            # stopped while it connected: the connection is closed once made, not left to
            # the garbage collector, nor to a loop that may be gone by then
            with contextlib.suppress(Exception):
                await (await connecting).close()
        if self._conn is not None:
            await self._conn.close()
            self._conn = None

    async def _run(self) -> None:
        warned = False
        while True:
            if self._conn is None:
                connecting = self._connecting = asyncio.ensure_future(self._connect())
                try:
                    # shielded: a cancel leaves it to stop(), which closes what it makes
                    self._conn = await asyncio.shield(connecting)
                    self._connecting = None
                except ReachError as exc:
                    self._connecting = None
                    if not warned:
                        warned = True
                        log.warning("cannot read the servers' health (store checks): %s", exc)
                    await asyncio.sleep(CONNECT_AGAIN_SEC)
                    continue
            try:
                answers = await server_health(
                    self._conn, expect=self._expect, timeout=ANSWER_TIMEOUT
                )
            except ReachError:
                answers = []  # the connection is away: asked again next round
            if answers:
                self.latest = {h.name: h for h in answers}
                self.answered_at = time.monotonic()
                if self._on_answers is not None:
                    self._on_answers(answers)
            await asyncio.sleep(CHECK_EVERY_SEC)


@dataclass(frozen=True, slots=True)
class Checkup:
    """What a supervised child's check found: a line to say (a change), and a reason
    to start it again although it runs ("" for none)."""

    said: str = ""
    restart: str = ""


class StoreGuard:
    """One server's JetStream store, as ``reach up``'s supervisor looks at it.

    ``name``: the server's name in its health (None: the only server that answers);
    ``store_dir``: where it keeps its store, whose disk is measured. ``room``: the
    measure (``disk_room``; tests give their own)."""

    def __init__(
        self,
        poll: HealthPoll,
        store_dir: Path,
        *,
        name: str | None = None,
        room: Callable[[Path], DiskRoom | None] = disk_room,
    ) -> None:
        self._poll = poll
        self._store_dir = store_dir
        self._name = name
        self._room = room
        self._problem = ""
        #: started again for its store: its first healthy answer is worth a line
        self._recovering = False
        self._since = time.monotonic()

    @property
    def problem(self) -> str:
        """What the server's health says of its store now ("" for nothing)."""
        return self._problem

    def started(self) -> None:
        """The server was started (again): its health is read afresh."""
        self._recovering = self._recovering or bool(self._problem)
        self._problem = ""
        self._since = time.monotonic()

    def check(self) -> Checkup:
        """The change since the last check, and whether the server must be started
        again: its store failed and its disk has room now."""
        health = self._health()
        if health is None:
            return Checkup()
        problem = store_problem(health) or ""
        said = ""
        if problem and not self._problem:
            said = (
                f"its JetStream store takes no writes: {problem}. Writes to streams and"
                " buckets fail (audit events wait in their writers' memory and spools)"
                f" until space is freed {self._where()}; it is started again once there"
                " is room"
            )
        elif (self._problem or self._recovering) and not problem:
            said = "its JetStream store takes writes again"
            self._recovering = False
        self._problem = problem
        if not problem:
            return Checkup(said)
        room = self._room(self._store_dir)
        if room is None or not room.enough:
            return Checkup(said)
        restart = (
            f"its JetStream store has room again ({_mib(room.free)} free on the disk of"
            f" {self._store_dir}): started again, which reopens the store"
        )
        return Checkup(said, restart)

    def _health(self) -> ServerHealth | None:
        """This server's latest answer, if given since it started."""
        if self._poll.answered_at < self._since:
            return None
        latest = self._poll.latest
        if self._name is not None:
            return latest.get(self._name)
        return next(iter(latest.values())) if len(latest) == 1 else None

    def _where(self) -> str:
        room = self._room(self._store_dir)
        if room is None:
            return f"on the disk of {self._store_dir}"
        return (
            f"on the disk of {self._store_dir} ({_mib(room.free)} of {_mib(room.size)}"
            f" free; {_mib(room_needed(room.size))} needed)"
        )


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.0f} MiB" if n >= 1 << 20 else f"{n / 1024:.0f} KiB"
