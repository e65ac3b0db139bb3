"""NATS-level isolation on a fabric started by `reach up`: every client logs in with its
credentials, and an agent cannot listen to another agent's traffic."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from reach.agent.jobs import JobStore
from reach.caller.client import ReachClient
from reach.errors import PermissionDenied
from reach.fabric.embedded import free_port
from reach.security.membership import connect_as
from reach.wire import subjects

from .calls_helpers import capability, make_agent, wait_routable
from .cli_helpers import REACH, run_reach


@pytest.fixture
async def fabric(tmp_path: Path) -> AsyncIterator[tuple[str, Path]]:
    port = free_port()
    proc = subprocess.Popen(  # noqa: ASYNC220 - fork+exec, returns at once
        [REACH, "up", "--port", str(port), "--store", str(tmp_path / "store")],
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdout is not None
    line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 60)
    assert line.startswith(b"Agent-Reach up"), line
    try:
        yield f"nats://127.0.0.1:{port}", tmp_path / "store"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)


async def test_agents_log_in_and_cannot_read_each_others_calls(
    fabric: tuple[str, Path], tmp_path: Path
) -> None:
    url, store = fabric
    dev = store / "dev.creds"
    for name in ("a", "b"):
        code, out, err = await run_reach(
            "creds", "add", f"agent-{name}", "--level", "2", "--agent-id", f"{name}-1",
            "--cap", "echo", "--out", str(tmp_path / f"{name}.creds"),
            "--servers", url, "--creds", str(dev),
        )  # fmt: skip
        assert code == 0, out + err
    agent_b, b = make_agent(url, "b-1", capability("echo", level=2))
    agent_b.credentials = tmp_path / "b.creds"
    async with agent_b, ReachClient(servers=url, credentials=dev) as caller:
        await wait_routable(caller, "echo", 1)
        # agent A logs in with its own credentials and tries to listen in
        spy, _ = await connect_as([url], name="spy", credentials=tmp_path / "a.creds")
        received: list[bytes] = []

        async def grab(msg: object) -> None:
            received.append(b"x")

        try:
            for subject in (
                subjects.capability_instance("echo", "b-1"),
                "_INBOX.>",
                "$JS.API.>",
            ):
                await spy.subscribe(subject, grab)
            await spy.flush()
            for i in range(5):
                assert (await caller.call("echo", {"i": i})).agent_id == "b-1"
        finally:
            await spy.close()
    assert received == []
    assert b.calls == 5
    # and nobody gets in without credentials
    with pytest.raises(Exception, match="refused an anonymous client"):
        await connect_as([url], name="anonymous", credentials=None)


async def test_replies_to_a_batch_of_calls_pass_the_servers_response_permissions(
    fabric: tuple[str, Path], tmp_path: Path
) -> None:
    """Calls made together reach an agent as one message; their replies go back in as many
    messages as finish apart, and the server lets each through (``resp`` max)."""
    url, store = fabric
    dev = store / "dev.creds"
    code, out, err = await run_reach(
        "creds", "add", "agent-c", "--level", "2", "--agent-id", "c-1", "--cap", "slow",
        "--out", str(tmp_path / "c.creds"), "--servers", url, "--creds", str(dev),
    )  # fmt: skip
    assert code == 0, out + err

    async def staggered(req: dict[str, int]) -> dict[str, int]:
        await asyncio.sleep(0.002 * (req["i"] % 8))  # one batch, replies spread over 14 ms
        return req

    agent, _ = make_agent(url, "c-1", capability("slow", level=2), handler=staggered)
    agent.credentials = tmp_path / "c.creds"
    async with agent, ReachClient(servers=url, credentials=dev) as caller:
        await wait_routable(caller, "slow", 1)
        await caller.call("slow", {"i": 0})
        results = await asyncio.gather(*(caller.call("slow", {"i": i}) for i in range(64)))
    assert [r.value for r in results] == [{"i": i} for i in range(64)]


async def test_only_clients_given_the_jobs_role_reach_the_jobs_bucket(
    fabric: tuple[str, Path], tmp_path: Path
) -> None:
    """REACH_JOBS is for clients given the jobs role (and each of them reaches only its
    own jobs: tests/attacks/test_jobs.py)."""
    url, store = fabric
    dev = store / "dev.creds"
    for name, extra in (("plain", ()), ("jobber", ("--role", "jobs"))):
        code, out, err = await run_reach(
            "creds", "add", name, "--level", "1", *extra, "--out", str(tmp_path / f"{name}.creds"),
            "--servers", url, "--creds", str(dev),
        )  # fmt: skip
        assert code == 0, out + err
    for name, allowed in (("plain", False), ("jobber", True)):
        conn, _ = await connect_as([url], name=name, credentials=tmp_path / f"{name}.creds")
        try:
            if allowed:
                await JobStore.open(conn, create=False)
            else:
                with pytest.raises(PermissionDenied):
                    await JobStore.open(conn, create=False)
        finally:
            await conn.close()
