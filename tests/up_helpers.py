"""`reach up` as a real process, for its own tests and those that need a fabric it
started: reading its first line, finding the nats-servers it runs, reaping what it left,
and the ``secured`` fixture (a fabric `reach up` started, with a caller's and an agent's
credentials made by its admin; registered in tests/conftest.py)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import selectors
import signal
import subprocess
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from reach.agent.agent import Agent
from reach.fabric.embedded import free_port
from reach.security.credentials import CredentialsFile, CredentialStore
from reach.security.membership import connect_as

from .calls_helpers import capability, make_agent
from .cli_helpers import CLEAN_ENV, REACH

#: how long `reach up` may take to say it is up, and to exit once told to
READY_TIMEOUT = 30.0
EXIT_TIMEOUT = 20.0


def proc_stat(pid: int) -> tuple[str, str, int] | None:
    """(comm, state, ppid) of a process, None if it does not exist."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses
    head, _, rest = raw.rpartition(")")
    state, ppid = rest.split()[:2]
    return head.split("(", 1)[1], state, int(ppid)


def nats_children(pid: int) -> list[int]:
    children = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        stat = proc_stat(int(entry.name))
        if stat is not None and stat[0] == "nats-server" and stat[2] == pid and stat[1] != "Z":
            children.append(int(entry.name))
    return children


def gone(pid: int) -> bool:
    stat = proc_stat(pid)
    return stat is None or stat[1] in ("Z", "X")  # a zombie waits for init to reap it


def read_line(proc: subprocess.Popen[bytes], timeout: float = READY_TIMEOUT) -> str:
    """The first line ``reach up`` prints, waiting at most ``timeout``."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    buf = b""
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0:
                pytest.fail(f"reach up printed no line within {timeout}s (got {buf!r})")
            if sel.select(left):
                chunk = os.read(fd, 4096)
                if not chunk:
                    proc.wait(EXIT_TIMEOUT)
                    assert proc.stderr is not None
                    err = proc.stderr.read().decode(errors="replace")
                    pytest.fail(f"reach up exited with {proc.returncode} before ready: {err}")
                buf += chunk
    return buf.decode().splitlines()[0]


def reap(proc: subprocess.Popen[bytes]) -> None:
    """Kill ``reach up`` if it still runs, and any nats-server it left behind."""
    children = nats_children(proc.pid)
    if proc.poll() is None:
        proc.kill()
    proc.communicate(timeout=EXIT_TIMEOUT)
    for child in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)


@dataclass
class Secured:
    """A fabric `reach up` started (auth callout), with a caller's and an agent's
    credentials made by its admin."""

    url: str
    admin: Path
    watcher: Path
    agent: Path


@pytest.fixture
async def secured(tmp_path: Path) -> AsyncIterator[Secured]:
    port = free_port()
    store = tmp_path / "store"
    proc = subprocess.Popen(  # noqa: ASYNC220 - fork+exec, returns at once
        [REACH, "up", "--port", str(port), "--store", str(store)],
        stdout=subprocess.PIPE,
        env={**CLEAN_ENV, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 60)
        assert line.startswith(b"Agent-Reach up"), line
        url = f"nats://127.0.0.1:{port}"
        admin = store / "dev.creds"
        made = {name: tmp_path / f"{name}.creds" for name in ("watcher", "agent-a")}
        # Made through the credential store as `reach creds add` makes them (the command
        # has its own tests), without starting a reach process for each.
        conn, _ = await connect_as([url], name="secured-fixture", credentials=admin)
        try:
            creds = await CredentialStore.open(conn)
            # a caller: what an operator might wrongly use for a command
            watcher, secret = await creds.add("watcher", 2)
            CredentialsFile(url, watcher.client_id, secret).write(made["watcher"])
            agent, secret = await creds.add("agent-a", 2, agent_id="a-1", capabilities=("echo",))
            CredentialsFile(url, agent.client_id, secret).write(made["agent-a"])
        finally:
            await conn.close()
        yield Secured(url, admin, made["watcher"], made["agent-a"])
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)


def secured_agent(fabric: Secured) -> Agent:
    agent, _ = make_agent(fabric.url, "a-1", capability("echo", level=2))
    agent.credentials = fabric.agent
    return agent
