"""`reach mcp` over stdio reads and writes its pipes with the event loop
(``reach.gateways.mcpstdio``), and leaves a stdout that is a regular file to the SDK's
own writer: either way, each JSON-RPC request line is answered by one line, calls in
flight together are all answered, and the gateway ends when its stdin does. On an open
fabric, with JSON-RPC written by hand (the SDK's client is `tests/test_mcp_gateway.py`'s)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mcp", reason="the MCP SDK is the gateways extra: pip install '.[gateways]'")

from reach.registry import Registrar
from reach.testing import NatsServer

from .calls_helpers import capability, make_agent
from .cli_helpers import CLEAN_ENV, REACH

CALLS = 20


def _requests() -> list[dict[str, Any]]:
    hello = {
        "protocolVersion": "2025-11-25",
        "capabilities": {},
        "clientInfo": {"name": "test", "version": "1"},
    }
    calls = [
        {
            "jsonrpc": "2.0",
            "id": 10 + n,
            "method": "tools/call",
            "params": {"name": "echo", "arguments": {"n": n}},
        }
        for n in range(CALLS)
    ]
    return [
        {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": hello},
        {"jsonrpc": "2.0", "method": "notifications/initialized"},
        *calls,
    ]


async def _answers(lines: Any, want: int) -> dict[int, Any]:
    got: dict[int, Any] = {}
    async with asyncio.timeout(30):
        while len(got) < want:
            message = json.loads(await anext(lines))
            if "id" in message:
                got[message["id"]] = message
    return got


#: an end-to-end run of whole programs: `make test-long` (CI runs it after `make test`)
@pytest.mark.long
@pytest.mark.parametrize("stdout", ["pipe", "file"])
async def test_every_request_is_answered_and_the_gateway_ends_with_its_stdin(
    nats_server: NatsServer, registrar: Registrar, tmp_path: Path, stdout: str
) -> None:
    agent, _ = make_agent(nats_server.url, "a-1", capability("echo"))
    await agent.start()
    out_file = tmp_path / "out.jsonl"
    with out_file.open("wb") as sink:
        proc = await asyncio.create_subprocess_exec(
            REACH, "mcp", "--servers", nats_server.url,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE if stdout == "pipe" else sink,
            stderr=asyncio.subprocess.PIPE, env=CLEAN_ENV,
        )  # fmt: skip

    async def from_file() -> Any:
        seen = 0
        while True:
            lines = out_file.read_bytes().splitlines(keepends=True)
            complete = [line for line in lines if line.endswith(b"\n")]
            for line in complete[seen:]:
                yield line
            seen = len(complete)
            await asyncio.sleep(0.05)

    async def from_pipe() -> Any:
        assert proc.stdout is not None
        while line := await proc.stdout.readline():
            yield line

    try:
        assert proc.stdin is not None
        first, *rest = [(json.dumps(r) + "\n").encode() for r in _requests()]
        lines = from_pipe() if stdout == "pipe" else from_file()
        proc.stdin.write(first)
        assert (await _answers(lines, 1))[1]["result"]["serverInfo"]["name"] == "agent-reach"
        proc.stdin.write(b"".join(rest))  # every call at once: all in flight together
        answers = await _answers(lines, CALLS)
        for n in range(CALLS):
            result = answers[10 + n]["result"]
            assert result["structuredContent"] == {"by": "a-1", "echo": {"n": n}}, result
        proc.stdin.close()
        assert await asyncio.wait_for(proc.wait(), 20) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await agent.stop()


def test_stray_output_of_the_process_does_not_reach_the_protocol_stream(tmp_path: Path) -> None:
    """What the gateway's process writes to descriptor 1 while serving goes to stderr."""
    script = tmp_path / "stray.py"
    script.write_text(
        "import asyncio, os\n"
        "from reach.gateways.mcpstdio import pipes\n"
        "async def main():\n"
        "    async with pipes() as wire:\n"
        "        assert wire is not None\n"
        "        stdin, stdout = wire\n"
        "        os.write(1, b'stray\\n')\n"
        "        async for line in stdin:\n"
        "            await stdout.write(line.upper())\n"
        "            await stdout.flush()\n"
        "    os.write(1, b'after\\n')\n"
        "asyncio.run(main())\n"
    )
    done = subprocess.run(
        [sys.executable, str(script)],
        input=b"one\ntwo\n",
        capture_output=True,
        env=CLEAN_ENV,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == b"ONE\nTWO\nafter\n"
    assert done.stderr == b"stray\n"
