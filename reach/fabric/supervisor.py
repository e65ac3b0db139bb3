"""Keeps the processes a fabric runs alive: a child that dies is started again.

A ``reach.fabric.Fabric`` (``reach up``'s) hands what it runs to a ``Supervisor``: its
nats-servers (``ServerChild``) and its registrar part (token issuer, login gates,
registrar), a child process (``ServiceProcess``) or in the fabric's own process. A child
that exits unexpectedly is reported once and started again after a short pause; one
that keeps dying soon after each start waits longer each time (doubling, capped), so a
crash loop does not spin; one that cannot be started again after several tries in a row
ends the supervision with the reason. A child that runs but cannot recover by itself is
started again too, when its ``check`` says so: a nats-server whose JetStream store failed
(a full disk) once the disk has room again (``reach.fabric.storewatch``); what a check
finds is reported as it changes. Every child dies with its parent (Linux
``PR_SET_PDEATHSIG``, see ``reach.fabric.embedded``), so a killed supervisor leaves none behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import selectors
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from reach.clock import Clock, system_clock
from reach.errors import Disconnected, ReachError
from reach.fabric.embedded import EmbeddedServer, die_with_parent
from reach.fabric.storewatch import Checkup, StoreGuard
from reach.tasks import cancel_and_wait

__all__ = [
    "Checkup",
    "Child",
    "RestartPolicy",
    "ServerChild",
    "ServiceProcess",
    "Supervisor",
    "server_failure",
]

#: how often a child is checked for an unexpected exit, seconds
_WATCH_INTERVAL = 0.25


class Child(Protocol):
    """A process the supervisor keeps running."""

    @property
    def label(self) -> str:
        """What it is, for messages (``nats-server reach-1``, ``registrar``)."""
        ...

    @property
    def running(self) -> bool: ...

    def exit_note(self) -> str:
        """Where to look for why it exited (its log, its exit code)."""
        ...

    async def start(self) -> None:
        """Start it and return once it serves; ReachError if it cannot."""
        ...

    async def stop(self) -> None:
        """Stop it (to start it again)."""
        ...

    def check(self) -> Checkup:
        """What changed since the last check, and whether it must be started again
        although it runs (called every quarter second while it runs: no waiting)."""
        ...


@dataclass(frozen=True)
class RestartPolicy:
    #: pause before a dead child is started again
    delay: float = 0.5
    #: a child that dies within ``stable_sec`` of its start waits twice as long next
    #: time, up to this (crash-loop protection)
    max_delay: float = 30.0
    stable_sec: float = 30.0
    #: consecutive failed starts after which supervision ends with the reason
    max_failed_starts: int = 5


class Supervisor:
    """Watches ``children`` until ``run``'s stop event is set, starting dead ones again.

    ``report(line)`` tells of each restart once (and of each start that failed).
    """

    def __init__(
        self,
        children: Sequence[Child],
        *,
        report: Callable[[str], None],
        policy: RestartPolicy | None = None,
        clock: Clock = system_clock,
    ) -> None:
        self._children = list(children)
        self._report = report
        self._policy = policy or RestartPolicy()
        self._clock = clock
        #: restarts done, per label (for tests and ``reach doctor``-like views)
        self.restarts: dict[str, int] = {}

    async def run(self, stop: asyncio.Event) -> str | None:
        """Until ``stop`` is set (None), or a child cannot be started again (the reason)."""
        stopped = asyncio.create_task(stop.wait())
        keepers = [asyncio.create_task(self._keep(child, stopped)) for child in self._children]
        try:
            done, _ = await asyncio.wait({stopped, *keepers}, return_when=asyncio.FIRST_COMPLETED)
            for keeper in keepers:
                if keeper in done:
                    return keeper.result()
            return None
        finally:
            await cancel_and_wait([stopped, *keepers])

    async def _keep(self, child: Child, stopped: asyncio.Task[bool]) -> str | None:
        policy = self._policy
        started_at = self._clock.monotonic()
        quick_deaths = 0
        failed_starts = 0
        while True:
            restart = ""
            while child.running and not restart:
                await asyncio.wait({stopped}, timeout=_WATCH_INTERVAL)
                if stopped.done():
                    return None
                restart = self._check(child)
            if failed_starts == 0:
                if self._clock.monotonic() - started_at < policy.stable_sec:
                    quick_deaths += 1
                else:
                    quick_deaths = 0
                if restart:
                    self._report(f"{child.label}: {restart}")
                    await child.stop()
                else:
                    self._report(
                        f"{child.label} exited unexpectedly; starting it again"
                        f" ({child.exit_note()})"
                    )
            pause = min(policy.max_delay, policy.delay * 2 ** max(0, quick_deaths - 1))
            await asyncio.wait({stopped}, timeout=pause)
            if stopped.done():
                return None
            try:
                await child.start()
            except ReachError as exc:
                failed_starts += 1
                reason = f"{child.label} did not start again: {exc}"
                if failed_starts >= policy.max_failed_starts:
                    return reason
                self._report(f"{reason}; trying again")
                quick_deaths += 1
                continue
            failed_starts = 0
            started_at = self._clock.monotonic()
            self.restarts[child.label] = self.restarts.get(child.label, 0) + 1

    def _check(self, child: Child) -> str:
        """The child's check: what changed is reported; why it must be started again."""
        checkup = child.check()
        if checkup.said:
            self._report(f"{child.label}: {checkup.said}")
        return checkup.restart


class ServerChild:
    """An embedded nats-server as a supervised child; with a ``guard``, also started
    again when its JetStream store failed and its disk has room again."""

    def __init__(self, server: EmbeddedServer, guard: StoreGuard | None = None) -> None:
        self.server = server
        self.guard = guard

    @property
    def label(self) -> str:
        return f"nats-server {self.server.name}" if self.server.name else "nats-server"

    @property
    def running(self) -> bool:
        return self.server.running

    def exit_note(self) -> str:
        return f"see {self.server.log_file}"

    async def start(self) -> None:
        try:
            await self.server.start()
        except Disconnected as exc:
            raise Disconnected(server_failure(self.server, exc)) from exc
        if self.guard is not None:
            self.guard.started()

    async def stop(self) -> None:
        await self.server.stop()

    def check(self) -> Checkup:
        return self.guard.check() if self.guard is not None else Checkup()


def server_failure(server: EmbeddedServer, exc: Exception) -> str:
    """The server's own fatal/error line from its log when there is one, else ``exc``."""
    try:
        lines = server.log_file.read_text(errors="replace").splitlines()
    except OSError:
        return str(exc)
    for line in reversed(lines):
        for mark in ("[FTL]", "[ERR]"):
            if mark in line:
                return f"{line.split(mark, 1)[1].strip()} (see {server.log_file})"
    return str(exc)


class ServiceProcess:
    """A child process that prints one line on stdout once it serves (``ready_line``).

    Its stderr is the parent's; its pid is written to ``pid_file`` while it runs (others
    find it there). It gets SIGTERM when the parent dies, and runs in a process group of
    its own, so a Ctrl-C reaches the parent only, which stops it in order.
    """

    def __init__(
        self,
        command: Sequence[str],
        *,
        label: str,
        pid_file: Path | None = None,
        ready_timeout: float = 90.0,
        stop_timeout: float = 20.0,
    ) -> None:
        self.command = list(command)
        self._label = label
        self.pid_file = pid_file
        self.ready_timeout = ready_timeout
        self.stop_timeout = stop_timeout
        self.ready_line = ""
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def label(self) -> str:
        return self._label

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def exit_note(self) -> str:
        code = self._proc.returncode if self._proc is not None else None
        return f"exit code {code}" if code is not None else "not started"

    def check(self) -> Checkup:
        return Checkup()  # a process that runs serves, or exits

    async def start(self) -> None:
        if self.running:
            return
        # forked on the event loop's thread, which lives as long as the loop (see
        # EmbeddedServer.start): the parent-death signal is tied to the forking thread
        proc = self._spawn()
        try:
            self.ready_line = await asyncio.to_thread(self._read_ready, proc)
        except BaseException:
            await self.stop()
            raise

    def _spawn(self) -> subprocess.Popen[bytes]:
        if self._proc is not None and self._proc.stdout is not None:
            self._proc.stdout.close()  # the pipe of the one that died
        proc = self._proc = subprocess.Popen(
            self.command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            preexec_fn=die_with_parent(os.getpid()),
        )
        if self.pid_file is not None:
            tmp = self.pid_file.with_name(f".{self.pid_file.name}.tmp")
            # owner only, as everything in the store
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as out:
                out.write(f"{proc.pid}\n")
            tmp.replace(self.pid_file)
        return proc

    def _read_ready(self, proc: subprocess.Popen[bytes]) -> str:
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        buf = b""
        deadline = time.monotonic() + self.ready_timeout
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while b"\n" not in buf:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ReachError(f"{self._label} not ready after {self.ready_timeout:g}s")
                if not sel.select(min(left, 0.5)):
                    continue
                chunk = os.read(fd, 4096)
                if not chunk:
                    code = proc.wait()
                    raise ReachError(f"{self._label} exited with code {code} before it was ready")
                buf += chunk
        return buf.split(b"\n", 1)[0].decode(errors="replace")

    async def stop(self) -> None:
        """SIGTERM, then SIGKILL after ``stop_timeout``; waits for the exit."""
        await asyncio.to_thread(self._stop_now)

    def _stop_now(self) -> None:
        proc = self._proc
        if proc is not None:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(self.stop_timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        if self.pid_file is not None:
            with contextlib.suppress(FileNotFoundError):
                self.pid_file.unlink()

    def kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
