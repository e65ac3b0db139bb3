"""A flood from one agent credential must not take the registry or the issuer with it.

The rogue holds an agent credential of its own and runs a registered instance; from a
process of its own (plain nats-py, :mod:`tests.attacks.heartbeat_flooder`) it publishes
as fast as one connection goes: heartbeats and announces that each change what callers
route on, forged and malformed ones, heartbeats for other agents, and token requests.
Meanwhile honest agents heartbeat and answer probes as usual and a caller calls them.

The honest agents stay healthy and callable throughout, the rogue's record is rewritten
no more often than its budget allows (callers are not flooded through the registry),
`reach up` stays connected (no slow-consumer cut-off) and its log does not grow with
the flood. A token request that claims, in a header of its own, to come from another
client is charged to its real sender, whom the server names.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import msgpack
import nats.errors
import pytest
from nats.js.kv import KeyValue

from reach.caller.client import ReachClient
from reach.registry.controlbudget import BURST, PER_INTERVAL
from reach.security.accounts import REQUEST_INFO_HEADER
from reach.security.issuer import TOKEN_BURST
from reach.tasks import cancel_and_wait
from reach.wire import subjects

from ..calls_helpers import wait_routable
from .conftest import UpFabric, attacker, fabric_token, request_bytes

#: seconds the flood lasts
FLOOD_SEC = 6.0
#: honest agents (each with the test agents' health interval, INTERVAL seconds)
HONEST = ("steady-1", "steady-2", "steady-3")
INTERVAL = 0.5
#: lines `reach up` may log about the flood: a few refusals, a summary per interval
LOG_LINES = 30


@contextlib.asynccontextmanager
async def _flooder(fabric: UpFabric, creds: Path, agent_id: str, instance_id: str) -> Any:
    """The flood, in its own process, for FLOOD_SEC; yields the process."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.attacks.heartbeat_flooder",
        fabric.url,
        str(creds),
        agent_id,
        instance_id,
        "flood",
        str(FLOOD_SEC),
        stdout=asyncio.subprocess.PIPE,
        cwd=str(Path(__file__).parents[2]),
        env={**os.environ},
    )
    try:
        yield proc
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def _rewrites(kv: KeyValue, key: str, into: list[int]) -> None:
    """Count every write of ``key`` (its revisions) until cancelled."""
    watch = await kv.watch(key, include_history=False)
    try:
        async for entry in watch:
            if entry is not None:
                into.append(entry.revision or 0)
    finally:
        with contextlib.suppress(nats.errors.Error):
            await watch.stop()


def _slow_consumers(fabric: UpFabric) -> list[str]:
    log = fabric.store / "nats" / "nats-server.log"
    return [line for line in log.read_text().splitlines() if "Slow Consumer" in line]


# a flood loads the machine on purpose: alone, what it measures is the fabric
@pytest.mark.serial
async def test_one_credentials_flood_leaves_the_registry_and_the_issuer_standing(
    up_fabric: UpFabric,
) -> None:
    assert up_fabric.stderr is not None
    honest = [await up_fabric.add_agent(agent_id, "steady") for agent_id in HONEST]
    rogue, _, rogue_creds = await up_fabric.add_agent("rogue-1", "flood")
    _, caller_creds = await up_fabric.add_client(level=1)
    admin = await attacker(up_fabric, up_fabric.admin)
    rewrites: list[int] = []
    trouble: list[str] = []
    calls = failed = 0
    try:
        kv = await admin.jetstream().key_value(subjects.REGISTRY_BUCKET)
        async with (
            honest[0][0],
            honest[1][0],
            honest[2][0],
            rogue,
            ReachClient(servers=up_fabric.url, credentials=caller_creds) as client,
        ):
            await wait_routable(client, "steady", len(HONEST))
            await client.routes.wait_for(lambda c: bool(c.find("flood")), timeout=5)
            counting = asyncio.create_task(_rewrites(kv, "agent.rogue-1", rewrites))
            log_before = len(up_fabric.stderr.read_text().splitlines())
            async with _flooder(up_fabric, rogue_creds, "rogue-1", rogue.instance_id) as proc:
                started = time.monotonic()
                # bounded: the flooder stops itself after FLOOD_SEC
                while proc.returncode is None and time.monotonic() - started < FLOOD_SEC + 30:
                    seen = {i.agent_id: i for i in client.routes.find("steady")}
                    trouble += [f"{a}: gone" for a in HONEST if a not in seen]
                    trouble += [
                        f"{i.agent_id}: {i.status} ({i.status_reason})"
                        for i in seen.values()
                        if i.status != "healthy"
                    ]
                    calls += 1
                    try:
                        await client.call("steady", {"i": calls})
                    except Exception as exc:
                        failed += 1
                        trouble.append(f"call {calls}: {exc}")
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(proc.wait(), 0.1)
                assert proc.stdout is not None
                sent = json.loads((await proc.stdout.read()).decode().splitlines()[-1])
                took = time.monotonic() - started
            # the honest agents are still healthy one interval after the flood
            await asyncio.sleep(2 * INTERVAL)
            trouble += [
                f"{i.agent_id} after: {i.status}"
                for i in client.routes.find("steady")
                if i.status != "healthy"
            ]
            await cancel_and_wait([counting])
    finally:
        await admin.close()
    assert sum(sent.values()) > 20_000, sent  # it was a flood
    assert sent["refused"] > 0, sent  # and NATS refused what it may not publish
    assert not trouble, trouble
    assert calls > 10
    assert failed == 0
    # every write the rogue's heartbeats and announces caused was within its budget
    allowed = BURST + PER_INTERVAL * (took + 2 * INTERVAL) / INTERVAL
    assert len(rewrites) <= allowed, (len(rewrites), allowed)
    assert up_fabric.proc.poll() is None
    assert not _slow_consumers(up_fabric)
    lines = len(up_fabric.stderr.read_text().splitlines()) - log_before
    assert lines <= LOG_LINES, f"{lines} log lines for a flood of {sum(sent.values())} messages"


async def test_a_token_request_naming_another_client_in_its_header_is_charged_to_its_sender(
    up_fabric: UpFabric,
) -> None:
    victim_id, victim_creds = await up_fabric.add_client(level=1)
    rogue_id, rogue_creds = await up_fabric.add_client(level=1)
    rogue = await attacker(up_fabric, rogue_creds)
    victim = await attacker(up_fabric, victim_creds)
    try:
        token = await fabric_token(rogue, *up_fabric.secret_of(rogue_creds))
        forged = {REQUEST_INFO_HEADER: json.dumps({"acc": "CLIENTS", "user": victim_id})}
        inbox = f"_INBOX.{rogue_id}.r.flood"
        answers: list[bytes] = []
        all_answered = asyncio.Event()

        async def keep(msg: Any) -> None:
            answers.append(msg.data)
            if len(answers) == int(TOKEN_BURST) * 3:
                all_answered.set()

        await rogue.subscribe(inbox + ".*", cb=keep)
        exchange = {"client_id": rogue_id, "token": token, "audience": "steady"}
        # well past one client's burst, each request claiming to be the victim's
        for _ in range(int(TOKEN_BURST) * 3):
            await rogue.publish(
                "reach.v1.auth.token",
                request_bytes(exchange),
                reply=inbox + ".x",
                headers=forged,
            )
        await rogue.flush()
        await asyncio.wait_for(all_answered.wait(), 20)  # every request is answered
        codes = [msgpack.unpackb(a).get("err", {}).get("code", "ok") for a in answers]
        assert codes.count("rate_limited") >= int(TOKEN_BURST), codes.count("rate_limited")
        # the victim's own budget is untouched: it gets its token at once
        assert await fabric_token(victim, *up_fabric.secret_of(victim_creds))
    finally:
        await rogue.close()
        await victim.close()
