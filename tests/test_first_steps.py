"""What a newcomer meets first: Ctrl-C on an agent or a long-running command ends it
cleanly, a fabric nobody started is named as the likely cause of "cannot connect", and a
mistyped capability is answered with the names close to it."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest

from reach.audit.stats import LATENCY
from reach.caller.client import ReachClient
from reach.errors import AuthenticationFailed, Disconnected, NotFound, ReachError
from reach.fabric.embedded import free_port
from reach.testing import NatsServer

from .calls_helpers import capability, make_agent, wait_routable
from .cli_helpers import REACH, reach_cli
from .up_helpers import Secured

AGENT_SCRIPT = """\
import asyncio
import sys

from reach import Agent

agent = Agent(
    {"agent_name": "hello", "version": "1.0.0",
     "capabilities": [{"name": "say_hello", "security_level": 1}]},
    servers=sys.argv[1],
)


@agent.capability("say_hello")
async def hello(req: dict) -> dict:
    return {"hello": req.get("name", "world")}


second = Agent(
    {"agent_name": "hello-too", "version": "1.0.0",
     "capabilities": [{"name": "say_hello_too", "security_level": 1}]},
    servers=sys.argv[1],
)


@second.capability("say_hello_too")
async def hello_too(req: dict) -> dict:
    return {"hello": "too"}


if sys.argv[2] == "run":
    agent.run()
elif sys.argv[2] == "serve_forever":
    async def main() -> None:
        async with agent:
            # said once serve_forever waits (and has taken the signals)
            asyncio.get_running_loop().call_soon(lambda: print("SERVING", flush=True))
            await agent.serve_forever()

    asyncio.run(main())
else:  # two agents in one program
    async def both() -> None:
        async with agent, second:
            serving = [asyncio.ensure_future(a.serve_forever()) for a in (agent, second)]
            await asyncio.sleep(0)  # each ran to its wait, and has taken the signals
            print("SERVING", flush=True)
            await asyncio.gather(*serving)

    asyncio.run(both())
print("STOPPED", flush=True)
"""


@pytest.mark.parametrize(
    ("how", "sig"),
    [
        ("run", signal.SIGINT),
        ("serve_forever", signal.SIGINT),
        ("two_agents", signal.SIGINT),
        ("two_agents", signal.SIGTERM),
    ],
)
async def test_ctrl_c_stops_an_agent_cleanly_and_it_leaves_the_registry(
    nats_server: NatsServer, client: ReachClient, tmp_path: Path, how: str, sig: int
) -> None:
    script = tmp_path / "agent.py"
    script.write_text(AGENT_SCRIPT)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(script),
        nats_server.url,
        how,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stdout is not None
    try:
        await wait_routable(client, "say_hello", 1)
        if how != "run":  # Ctrl-C while it joins is the program's own to take
            assert await asyncio.wait_for(proc.stdout.readline(), 10) == b"SERVING\n"
        proc.send_signal(sig)
        out, err = await asyncio.wait_for(proc.communicate(), 15)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, err.decode()
    assert "Traceback" not in err.decode(), err.decode()
    assert out.decode().endswith("STOPPED\n")
    if how == "run":  # a program that is one agent says what it serves, where
        assert f"serving say_hello at {nats_server.url}" in err.decode(), err.decode()
    # it said goodbye: gone from the registry at once, not after missed heartbeats
    await client.routes.wait_for(lambda c: not c.find("say_hello"), timeout=2)
    if how == "two_agents":  # both did
        await client.routes.wait_for(lambda c: not c.find("say_hello_too"), timeout=2)


#: runs argv[1:] with SIGINT at its default disposition (kept across exec)
_DEFAULT_SIGINT_EXEC = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL);"
    " os.execv(sys.argv[1], sys.argv[1:])"
)


async def test_ctrl_c_ends_a_following_command_without_a_traceback(
    nats_server: NatsServer, client: ReachClient
) -> None:
    agent, _ = make_agent(nats_server.url, "worker-1", capability("work"))
    async with agent:
        await wait_routable(client, "work", 1)
        await client.call("work", {})
    assert client.audit is not None
    await client.audit.flush()
    # as from a terminal: SIGINT at its default, whatever this process inherited (a
    # shell's background job, and all it starts, ignores SIGINT; so would the command)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _DEFAULT_SIGINT_EXEC,
        REACH,
        "audit",
        "tail",
        "--follow",
        "--servers",
        nats_server.url,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        # a process still there after the SIGINT is told to dump its stack (SIGABRT)
        env={**os.environ, "PYTHONFAULTHANDLER": "1"},
    )
    assert proc.stdout is not None
    try:
        # the call's event printed: it follows the stream now
        line = await asyncio.wait_for(proc.stdout.readline(), 20)
        assert b"worker-1" in line, line
        proc.send_signal(signal.SIGINT)
        try:
            _, err = await asyncio.wait_for(proc.communicate(), 10)
        except TimeoutError:
            proc.send_signal(signal.SIGABRT)
            _, err = await asyncio.wait_for(proc.communicate(), 10)
            raise AssertionError(f"still running 10 s after SIGINT:\n{err.decode()}") from None
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 130, err.decode()
    assert "Traceback" not in err.decode(), err.decode()
    assert err.decode().startswith(LATENCY)  # what its figures measure, said first


async def test_nothing_at_the_url_is_answered_with_how_to_start_a_fabric() -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    with pytest.raises(Disconnected, match=r"`reach up` starts one; --servers or REACH_URL"):
        async with ReachClient(servers=url):
            pass
    code, _, err = await reach_cli("agents", "--servers", url, env=dict(os.environ))
    assert code == 1
    assert "Traceback" not in err
    assert err.startswith(f"error: Disconnected: cannot connect to NATS at {url}")
    assert "`reach up` starts one" in err


async def test_a_mistyped_capability_is_answered_with_the_close_ones(
    nats_server: NatsServer, client: ReachClient
) -> None:
    agent, _ = make_agent(
        nats_server.url, "orders-1", capability("query_orders"), capability("query_order_lines")
    )
    async with agent:
        await wait_routable(client, "query_orders", 1)
        await wait_routable(client, "query_order_lines", 1)
        with pytest.raises(NotFound, match=r"did you mean query_orders\b"):
            await client.call("query_ordrs", {})
        with pytest.raises(NotFound) as caught:
            await client.call("refund", {})
        assert "did you mean" not in str(caught.value)
        code, out, err = await reach_cli(
            "call", "query_ordr", "{}", "--servers", nats_server.url, env=dict(os.environ)
        )
        assert code == 1
        assert "did you mean query_orders" in out + err
        code, out, _ = await reach_cli(
            "doctor", "query_ordrs", "--servers", nats_server.url, env=dict(os.environ)
        )
        assert "did you mean query_orders" in out


async def test_a_login_refused_without_credentials_says_where_credentials_come_from(
    secured: Secured,
) -> None:
    """From a directory without .reach/, no credentials were given at all: the refusal
    says where they would come from, not to check a file that does not exist."""
    with pytest.raises(AuthenticationFailed) as refused:
        async with ReachClient(servers=secured.url):
            pass
    text = str(refused.value)
    assert "an anonymous client" in text
    assert "REACH_CREDS" in text
    assert "--creds" in text
    assert ".reach/dev.creds" in text
    assert "check the credentials file" not in text


async def test_an_agent_started_with_a_callers_credentials_is_told_how_to_make_its_own(
    secured: Secured,
) -> None:
    agent = make_agent(secured.url, "mine-1", capability("echo"))[0]
    agent.credentials = secured.watcher  # a caller's: it may call, not serve
    with pytest.raises(ReachError) as refused:
        await agent.start()
    await agent.stop()
    assert "reach creds add" in str(refused.value), refused.value
    assert "--agent-id" in str(refused.value)
