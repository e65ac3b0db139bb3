"""The agents under the conformance kit's checks, each started for a test and stopped
after it: the library's own (``reach.Agent``), the raw nats-py one (raw_agent.py) and
the Node.js example (examples/node/agent.js), each serving a capability that adds two
numbers with its own credential; and the Node.js example caller."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from ..attacks.conftest import UpFabric
from ..calls_helpers import make_agent
from .conftest import add, adder
from .raw_agent import RawAgent
from .wire import Creds

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "node"
NODE, NPM = shutil.which("node"), shutil.which("npm")
#: why the Node.js examples cannot run here (None: they can)
NO_NODE = (
    "node and npm are not on PATH: the Node.js examples cannot run"
    if NODE is None or NPM is None
    else None
)


def node_modules() -> None:
    """The examples' packages, installed from package-lock.json when missing."""
    if not (EXAMPLES / "node_modules" / ".package-lock.json").exists():
        assert NPM is not None
        subprocess.run(
            [NPM, "ci", "--no-audit", "--no-fund"], cwd=EXAMPLES, check=True, timeout=300
        )


async def node_call(creds: Path, capability: str, payload: Any) -> dict[str, Any]:
    """What ``node caller.js`` printed for one call."""
    assert NODE is not None
    proc = await asyncio.create_subprocess_exec(
        NODE, "caller.js", str(creds), capability, json.dumps(payload),
        cwd=EXAMPLES, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert out, err.decode()
    printed: dict[str, Any] = json.loads(out.decode().splitlines()[-1])
    assert proc.returncode == (0 if printed["ok"] else 1), err.decode()
    return printed


@contextlib.asynccontextmanager
async def node_agent(
    up: UpFabric, agent_id: str, capability: str, level: int = 1
) -> AsyncIterator[str]:
    """``node agent.js`` serving ``capability`` as ``agent_id``, until the block ends."""
    assert NODE is not None
    _, creds = await up.add_client(level=level, agent_id=agent_id, caps=(capability,))
    proc = await asyncio.create_subprocess_exec(
        NODE, "agent.js", str(creds), agent_id, capability, str(level),
        cwd=EXAMPLES, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 30)
        assert line.decode().strip() == f"ready {agent_id}", await _stderr(proc)
        yield agent_id
    finally:
        if proc.returncode is None:
            proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 10)
        except TimeoutError:
            proc.kill()
            await proc.wait()


async def _stderr(proc: asyncio.subprocess.Process) -> str:
    proc.kill()
    assert proc.stderr is not None
    return (await proc.stderr.read()).decode()


@contextlib.asynccontextmanager
async def reach_agent(
    up: UpFabric, agent_id: str, capability: str, level: int = 1
) -> AsyncIterator[str]:
    """A ``reach.Agent`` serving ``capability`` as ``agent_id``."""
    _, creds = await up.add_client(level=level, agent_id=agent_id, caps=(capability,))
    agent, _ = make_agent(up.url, agent_id, adder(capability, level), handler=add)
    agent.credentials = creds
    async with agent:
        yield agent_id


@contextlib.asynccontextmanager
async def raw_agent(
    up: UpFabric, agent_id: str, capability: str, level: int = 1
) -> AsyncIterator[str]:
    """raw_agent.py's agent serving ``capability`` as ``agent_id``."""
    _, creds = await up.add_client(level=level, agent_id=agent_id, caps=(capability,))
    agent = RawAgent(Creds.load(creds), agent_id, adder(capability, level), add)
    await agent.start()
    try:
        yield agent_id
    finally:
        await agent.stop()
