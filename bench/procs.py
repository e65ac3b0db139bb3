"""Processes of the benchmark other than the caller: responders and the registrar.

Child side (run by the bench, not by hand)::

    python -m bench.procs responder STACK URL RUN_ID [--profile FILE]
    python -m bench.procs registrar URL WORKDIR [--settled]

A child prints ``READY`` once it serves and runs until its standard input closes (the
bench closed it, or died) or it gets SIGTERM. With ``--profile FILE``, SIGUSR1 starts
a profiler and SIGUSR2 stops it, writes FILE and prints ``PROFILED``.

Parent side: :class:`Child` starts one, waits for ``READY``, reads its CPU time, stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import tempfile
from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import BinaryIO

from bench.profiling import Profile

__all__ = ["Child", "cpu_seconds", "descendants", "main", "proc_stat"]

_ROOT = Path(__file__).resolve().parent.parent
_START_TIMEOUT = 60.0
_STOP_TIMEOUT = 10.0


# -- parent side -----------------------------------------------------------------------


def cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU time of a process so far (Linux /proc), or None if unknown."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat") as stat:
            # the command name (2nd field) may hold spaces: split after its closing ')'
            fields = stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    # fields[0] is the state (3rd field of the line): utime and stime are the 14th and 15th
    return (int(fields[11]) + int(fields[12])) / ticks


def proc_stat(pid: int) -> tuple[str, str, int] | None:
    """(command name, state, parent pid) of a process (Linux /proc), None if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # "pid (comm) state ppid ...": the name may hold spaces and parentheses
    head, _, rest = raw.rpartition(")")
    fields = rest.split()
    if len(fields) < 2 or "(" not in head:
        return None
    return head.split("(", 1)[1], fields[0], int(fields[1])


def descendants(pid: int, name: str | None = None) -> list[int]:
    """Live (not zombie) processes below ``pid``, at any depth; only those whose command
    name is ``name`` if given."""
    parents: dict[int, list[int]] = {}
    names: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        stat = proc_stat(int(entry.name))
        if stat is None or stat[1] in ("Z", "X"):
            continue
        names[int(entry.name)] = stat[0]
        parents.setdefault(stat[2], []).append(int(entry.name))
    found: list[int] = []
    todo = list(parents.get(pid, []))
    while todo:
        child = todo.pop()
        found.append(child)
        todo.extend(parents.get(child, []))
    return [p for p in found if name is None or names.get(p) == name]


class Child:
    """One child process of the benchmark, speaking the READY protocol."""

    def __init__(self, name: str, proc: asyncio.subprocess.Process, log: Path) -> None:
        self.name = name
        self.proc = proc
        self.log = log
        self.said = ""

    @property
    def pid(self) -> int:
        return self.proc.pid

    def cpu_seconds(self) -> float | None:
        return cpu_seconds(self.proc.pid)

    @classmethod
    async def start(cls, name: str, args: Sequence[str], log_dir: Path) -> Child:
        """A child of this module (``bench.procs ARGS``), once it said READY."""
        return await cls.launch(name, "bench.procs", args, log_dir)

    @classmethod
    async def launch(
        cls,
        name: str,
        module: str,
        args: Sequence[str],
        log_dir: Path,
        timeout: float = _START_TIMEOUT,
        line_limit: int = 2**16,
        env: dict[str, str] | None = None,
    ) -> Child:
        """``python -m MODULE ARGS`` with this checkout importable, once it said READY;
        its standard error goes to ``log_dir/NAME.log``. ``line_limit`` bounds one line of
        its standard output (asyncio's stream limit); ``env`` replaces this process's
        environment (PYTHONPATH is still set)."""
        log = log_dir / f"{name}.log"
        base = os.environ if env is None else env
        env = {**base, "PYTHONPATH": os.pathsep.join(_pythonpath())}
        with _open_log(log) as err:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                module,
                *args,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=err,
                env=env,
                limit=line_limit,
            )
        child = cls(name, proc, log)
        try:
            await child.expect("READY", timeout)
        except BaseException:
            await child.stop()
            raise
        return child

    async def expect(self, word: str, timeout: float) -> None:
        """Wait for a line starting with ``word``; RuntimeError with the child's log if not."""
        assert self.proc.stdout is not None
        try:
            line = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
        except TimeoutError:
            line = b""
        text = line.decode(errors="replace")
        if not text.startswith(word):
            raise RuntimeError(
                f"{self.name} did not say {word} (said {line!r}); its log:\n{self.tail()}"
            )
        #: the rest of the line that said ``word``
        self.said = text[len(word) :].strip()

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    async def profile(self, start: bool) -> None:
        """Start (SIGUSR1) or stop and write (SIGUSR2) the child's profiler."""
        self.proc.send_signal(signal.SIGUSR1 if start else signal.SIGUSR2)
        if not start:
            await self.expect("PROFILED", 120.0)

    async def stop(self) -> None:
        """Close its stdin (it stops by itself), then SIGTERM, then SIGKILL."""
        if self.proc.returncode is not None:
            return
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        for action in (None, self.proc.terminate, self.proc.kill):
            if action is not None:
                with contextlib.suppress(ProcessLookupError):
                    action()
            try:
                await asyncio.wait_for(self.proc.wait(), _STOP_TIMEOUT)
                return
            except TimeoutError:
                continue


def _open_log(path: Path) -> BinaryIO:
    return open(path, "wb")


def _pythonpath() -> list[str]:
    existing = os.environ.get("PYTHONPATH", "")
    return [str(_ROOT), *(p for p in existing.split(os.pathsep) if p)]


def log_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="reach-bench-"))


# -- child side ------------------------------------------------------------------------


@asynccontextmanager
async def _registrar(url: str, workdir: Path, *, settled: bool) -> AsyncIterator[None]:
    """The registrar part of a fabric on ``url`` (``reach.fabric.Fabric``: token issuer and
    registrar, as ``reach up --servers URL`` runs them, its store in ``workdir``); the
    credentials the benchmark's agents and callers use are written to
    ``workdir/bench.creds``. NATS itself takes anonymous clients: raw nats-py runs on it.
    ``settled``: every instance is taken as past its first day (probed once per health
    interval instead of twice)."""
    from reach.fabric import Fabric
    from reach.registry import RegistrarConfig
    from reach.runtime import tune_gc
    from reach.security import ROLE_ADMIN

    tune_gc()  # as reach up does
    config = RegistrarConfig(new_agent_window_sec=0.0) if settled else None
    async with Fabric(workdir, servers=[url], supervise=False, registrar=config) as fabric:
        issuer = fabric.services.issuer if fabric.services is not None else None
        assert issuer is not None
        assert issuer.credentials is not None
        # the first registrar on a server makes it; another one's workdir has none
        if await issuer.credentials.get("bench") is None:
            await fabric.add_client("bench", 4, roles=[ROLE_ADMIN], path=workdir / "bench.creds")
        yield


async def _serve(service: AbstractAsyncContextManager[None], profile: Profile | None) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if profile is not None:
        loop.add_signal_handler(signal.SIGUSR1, profile.start)

        def write_profile() -> None:
            profile.stop()
            print("PROFILED", flush=True)

        loop.add_signal_handler(signal.SIGUSR2, write_profile)
    # standard input closes when the bench closes it or dies: never outlive the bench
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)

    async def until_eof() -> None:
        await reader.read()
        stop.set()

    watcher = asyncio.create_task(until_eof())
    try:
        async with service:
            print("READY", flush=True)
            await stop.wait()
    finally:
        watcher.cancel()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.procs")
    roles = parser.add_subparsers(dest="role", required=True)
    responder = roles.add_parser("responder")
    responder.add_argument("stack")
    responder.add_argument("url")
    responder.add_argument("run_id")
    responder.add_argument("--profile", type=Path, default=None)
    registrar = roles.add_parser("registrar")
    registrar.add_argument("url")
    registrar.add_argument("workdir", type=Path)
    registrar.add_argument("--settled", action="store_true", help="instances past their first day")
    args = parser.parse_args(argv)

    service: AbstractAsyncContextManager[None]
    profile: Profile | None = None
    if args.role == "registrar":
        service = _registrar(args.url, args.workdir, settled=args.settled)
    else:
        from bench.stacks import STACKS, Context

        stack = STACKS[args.stack]
        service = stack.responder(Context(args.url, args.run_id, stack.name))
        if args.profile is not None:
            profile = Profile(args.profile)
    asyncio.run(_serve(service, profile))
    return 0


if __name__ == "__main__":
    sys.exit(main())
