"""The fabrics the fault scenarios run on, as an operator runs them: real processes.

- ``single``: ``reach up`` (one nats-server, the registrar, the issuer and the login gate);
- ``cluster``: ``reach up --cluster 3`` (three nats-servers as one JetStream cluster);
- ``operator``: a nats-server started on its own with the login gate's config (what
  ``reach nats-auth`` writes) and ``reach up --servers URL --auth-callout`` beside it, so
  that the login gate and the server can fail apart;
- ``small-disk``: ``reach up`` with its store on a disk of its own, a small tmpfs that
  really fills (mounting one needs root: :class:`NoSmallDisk` says so elsewhere).

Every process runs in a temporary directory with its own store and a free loopback port;
``REACH_URL`` and ``REACH_CREDS`` are removed from the environment and the audit spool
(``REACH_AUDIT_SPOOL``) of every process lives in the directory too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from bench.procs import descendants, proc_stat

if TYPE_CHECKING:
    from reach.fabric import Fabric as ReachFabric

__all__ = [
    "DISK_MB",
    "FABRICS",
    "Fabric",
    "FabricError",
    "FabricKind",
    "NoSmallDisk",
    "fill",
    "mount_small_disk",
    "start_fabric",
    "unmount",
]

FabricKind = Literal["single", "cluster", "operator", "small-disk"]
FABRICS: tuple[FabricKind, ...] = ("single", "cluster", "operator", "small-disk")

#: the small disk's size: room for the audit stream's smallest size cap (64 MiB, with as
#: much again free within the server's limit of 75 % of the free space)
DISK_MB = 256

REACH = Path(sys.executable).parent / "reach"
#: three servers, a leader election and R3 buckets on a busy machine
_READY_TIMEOUT = 90.0
_STOP_TIMEOUT = 15.0
_READY_WORDS = "Agent-Reach up: "


class FabricError(RuntimeError):
    """A fabric process did not start, or a fault cannot be injected into it."""


class NoSmallDisk(FabricError):
    """A small disk of its own could not be mounted here (it needs root and ``mount``)."""


def mount_small_disk(where: Path, megabytes: int = DISK_MB) -> None:
    """A tmpfs of ``megabytes`` at ``where`` (made if missing): a real filesystem that
    really fills. :class:`NoSmallDisk` where mounting one is not allowed."""
    import shutil

    where.mkdir(parents=True, exist_ok=True)
    if shutil.which("mount") is None:
        raise NoSmallDisk("a real full disk needs `mount` to make a small tmpfs; there is none")
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={megabytes}m,mode=0700", "tmpfs", str(where)],
        capture_output=True,
        check=False,
    )
    if made.returncode != 0:
        why = made.stderr.decode(errors="replace").strip() or f"exit {made.returncode}"
        raise NoSmallDisk(
            f"a real full disk needs a small tmpfs, and mounting one was refused: {why}"
        )


def unmount(where: Path) -> None:
    """Unmount the disk at ``where`` (lazily: a process still holding a file lets go later)."""
    subprocess.run(["umount", "-l", str(where)], capture_output=True, check=False)


def fill(disk: Path) -> Path:
    """A file that takes every free byte of ``disk``; deleting it frees them."""
    path = disk / "filler"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for size in (1 << 20, 1 << 12, 1):  # the last bytes too
            chunk = b"\0" * size
            try:
                while os.write(fd, chunk):
                    pass
            except OSError:  # ENOSPC: no room for another chunk of this size
                continue
    finally:
        os.close(fd)
    return path


def base_env(workdir: Path, name: str) -> dict[str, str]:
    """The environment of one process of the run: no fabric of the user's, the audit
    spool in the run's directory."""
    env = {k: v for k, v in os.environ.items() if k not in ("REACH_URL", "REACH_CREDS")}
    env["REACH_AUDIT_SPOOL"] = str(workdir / "spool" / name)
    return env


@dataclass
class Fabric:
    kind: FabricKind
    workdir: Path
    store: Path
    urls: list[str]
    #: ``reach up``; replaced when the operator starts it again
    up: subprocess.Popen[bytes]
    #: operator fabric only: the nats-server it runs itself
    server: Any = None
    ups: list[subprocess.Popen[bytes]] = field(default_factory=list)
    #: operator fabric only: the ``reach.fabric.Fabric`` that started ``server`` (servers alone)
    servers_only: ReachFabric | None = None
    #: small-disk fabric only: where its disk is mounted (the store is in it)
    disk: Path | None = None

    @property
    def creds(self) -> Path:
        return self.store / "dev.creds"

    @property
    def admin_creds(self) -> Path:
        return self.store / "admin.creds"

    def up_log(self) -> str:
        try:
            text = (self.workdir / "up.err").read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-30:])

    def nats_pids(self) -> dict[int, int]:
        """client port -> pid of every running nats-server of this fabric."""
        if self.server is not None:
            pid = self.server.pid
            return {self.server.port: pid} if self.server.running and pid else {}
        nodes: dict[int, int] = {}
        for pid in descendants(self.up.pid, "nats-server"):
            with contextlib.suppress(OSError, ValueError, IndexError):
                args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                nodes[int(args[args.index(b"-p") + 1])] = pid
        return nodes

    def registrar_pid(self) -> int | None:
        """The registrar part's process, from ``<store>/registrar.pid``, if it runs."""
        try:
            pid = int((self.store / "registrar.pid").read_text().strip())
        except (OSError, ValueError):
            return None
        stat = proc_stat(pid)
        return pid if stat is not None and stat[1] not in ("Z", "X") else None

    def up_alive(self) -> bool:
        return self.up.poll() is None

    async def restart_up(self) -> None:
        """Start ``reach up --servers URL --auth-callout`` again (operator fabric)."""
        self.up = await _spawn_up(self.workdir, _operator_args(self.urls[0], self.store), self.ups)

    async def stop(self) -> None:
        """SIGTERM every ``reach up`` (its servers stop with it), SIGKILL what is left;
        unmount the small disk."""
        try:
            await _stop(self.ups, self.servers_only)
        finally:
            if self.disk is not None:
                unmount(self.disk)


async def _stop(ups: list[subprocess.Popen[bytes]], servers_only: ReachFabric | None) -> None:
    left = [p for up in ups for p in descendants(up.pid)]
    for up in ups:
        if up.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                up.terminate()
    for up in ups:
        try:
            await asyncio.to_thread(up.wait, _STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            up.kill()
            await asyncio.to_thread(up.wait, _STOP_TIMEOUT)
    for pid in left:  # processes of this fabric only, by id
        stat = proc_stat(pid)
        if stat is not None and stat[1] not in ("Z", "X"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    if servers_only is not None:
        await servers_only.stop()


def _operator_args(url: str, store: Path) -> list[str]:
    return ["--servers", url, "--auth-callout", "--store", str(store)]


def _popen_up(workdir: Path, args: list[str], name: str) -> subprocess.Popen[bytes]:
    with open(workdir / "up.out", "wb") as stdout, open(workdir / "up.err", "ab") as stderr:
        return subprocess.Popen(
            [str(REACH), "up", *args],
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=stderr,
            cwd=workdir,
            env=base_env(workdir, name),
        )


async def _spawn_up(
    workdir: Path, args: list[str], ups: list[subprocess.Popen[bytes]]
) -> subprocess.Popen[bytes]:
    """``reach up ARGS``, once it printed its ready line (its output goes to files)."""
    out = workdir / "up.out"
    proc = _popen_up(workdir, args, f"up-{len(ups)}")
    ups.append(proc)
    deadline = time.monotonic() + _READY_TIMEOUT
    while True:
        text = out.read_text(errors="replace")
        if _READY_WORDS in text:
            return proc
        if proc.poll() is not None or time.monotonic() > deadline:
            err = (workdir / "up.err").read_text(errors="replace")[-3000:]
            raise FabricError(f"reach up {' '.join(args)} not ready (rc {proc.poll()}): {err}")
        await asyncio.sleep(0.05)


def _ready_urls(workdir: Path) -> list[str]:
    text = (workdir / "up.out").read_text(errors="replace")
    line = text[text.index(_READY_WORDS) :].splitlines()[0]
    return line.split()[2].split(",")


async def start_fabric(kind: FabricKind, workdir: Path) -> Fabric:
    """Start a fabric of ``kind`` in ``workdir`` (stopped with :meth:`Fabric.stop`)."""
    from reach.fabric import Fabric as ReachFabric
    from reach.fabric.embedded import free_port

    store = workdir / "store"
    ups: list[subprocess.Popen[bytes]] = []
    port = free_port()
    if kind == "operator":
        # what an operator does: the accounts and the login gate's callout in the
        # server's config (reach.fabric.Fabric with logins on and no registrar part: the
        # servers alone, not supervised, so that a scenario restarts it itself), and
        # reach up beside it
        servers = ReachFabric(store, port=port, registrar_part="none", supervise=False)
        await servers.start()
        (server,) = servers.nodes
        try:
            up = await _spawn_up(workdir, _operator_args(server.url, store), ups)
        except BaseException:
            await _stop(ups, servers)
            raise
        return Fabric(kind, workdir, store, [server.url], up, server, ups, servers)
    disk: Path | None = None
    if kind == "small-disk":
        disk = workdir / "disk"
        mount_small_disk(disk)
        store = disk / "store"
    args = ["--port", str(port), "--store", str(store)]
    if kind == "cluster":
        args += ["--cluster", "3"]
    try:
        up = await _spawn_up(workdir, args, ups)
    except BaseException:
        await _stop(ups, None)
        if disk is not None:
            unmount(disk)
        raise
    return Fabric(kind, workdir, store, _ready_urls(workdir), up, None, ups, disk=disk)


async def stream_info(conn: Any, stream: str) -> dict[str, Any]:
    """``$JS.API.STREAM.INFO`` of ``stream`` ({} if JetStream does not answer now)."""
    from reach.errors import ReachError

    try:
        reply: dict[str, Any] = json.loads(
            await conn.request(f"$JS.API.STREAM.INFO.{stream}", b"", timeout=2.0)
        )
    except ReachError:
        return {}
    return reply


async def leader_port(conn: Any, fabric: Fabric, stream: str) -> int | None:
    """Client port of the cluster node leading ``stream`` (node reach-N has the Nth URL)."""
    info = await stream_info(conn, stream)
    leader = info.get("cluster", {}).get("leader")
    if not isinstance(leader, str) or "-" not in leader:
        return None
    url = fabric.urls[int(leader.rsplit("-", 1)[1]) - 1]
    return int(url.rsplit(":", 1)[1])
