"""`reach console` under attack and under failure, from the outside: a foreign client
writing malformed and hostile audit batches with plain nats-py and msgpack, and the
nats-server under the console killed and started again."""

from __future__ import annotations

import asyncio
import math
import struct
import time

import httpx
import msgpack
import nats
import pytest

from reach.caller.client import ReachClient
from reach.registry.registrar import Registrar
from reach.testing import NatsServer

from .calls_helpers import capability, make_agent
from .console_helpers import serve_console
from .poll_helpers import until

pytestmark = pytest.mark.timeout(120)

HOSTILE = "<script>document.title='owned'</script>"


def batch(fields: list[str], rows: list[list[object]]) -> bytes:
    """A batch as the documented format has it (schemas/, docs/operations.md): field names,
    then one row per event; nothing of Agent-Reach's own code makes it."""
    return msgpack.packb(
        {
            "v": 4,
            "fields": fields,
            "attempt_fields": ["agent_id", "score", "outcome", "latency_ms"],
            "events": rows,
        }
    )


async def test_malformed_and_hostile_audit_batches_neither_crash_nor_inject(
    nats_server: NatsServer, registrar: Registrar
) -> None:
    now = time.time()
    fields = ["ts", "capability", "outcome", "error", "description", "call_id", "attempts",
              "skipped", "latency_ms"]  # fmt: skip
    good = [now, "evil", "error", "business", HOSTILE, "evil-1", [["x-1", 0.5, "business", 2.0]],
            [], 2.0]  # fmt: skip
    bad_rows = [
        [math.nan, "evil", "ok", None, "", "bad-1", [], [], 1.0],  # a time that is no time
        ["soon", "evil", "ok", None, "", "bad-2", [], [], 1.0],
        [now, ["evil"], "ok", None, "", "bad-3", [], [], 1.0],  # a name that is a list
        [now, "evil", "ok", None, "", "bad-4", "not a list", [], 1.0],
        [now, "evil", "ok", None, "", "bad-5", [], 7, 1.0],
        [now, "evil", "ok", None, "", "bad-6", [], [], math.inf],
        [now, "evil", "ok", None, "", "bad-7", [[1, 2, 3, 4]], [], 1.0],
        [now, "evil", {"a": 1}, None, "", "bad-8", [], [], 1.0],
    ]
    async with serve_console(nats_server.url, None) as (base, console):
        outsider = await nats.connect(nats_server.url)
        js = outsider.jetstream()
        subject = "reach.v1.audit.evil.anonymous"
        await js.publish(subject, b"\xc1 not msgpack")
        await js.publish(subject, msgpack.packb(["not", "a", "batch"]))
        other_version = msgpack.unpackb(batch(fields, [good]))
        other_version["v"] = 3  # refused whole: its good row is not counted
        await js.publish(subject, msgpack.packb(other_version))
        await js.publish(subject, batch(fields, [*bad_rows, good]))
        rollup = console.view.rollup
        await until(lambda: rollup.capability("evil", time.time()).calls == 1, "the good call")
        # the follower is still reading: a later call is counted too
        await js.publish(subject, batch(fields, [[time.time(), *good[1:5], "evil-2", *good[6:]]]))
        await until(lambda: rollup.capability("evil", time.time()).calls == 2, "the next call")
        await outsider.close()
        assert console.view.bad_events >= len(bad_rows) + 3
        async with httpx.AsyncClient(base_url=base, timeout=10) as http:
            cap = await http.get("/capability/evil")
            assert cap.status_code == 200
            assert "business 2" in cap.text
            found = await http.get("/calls", params={"call_id": "evil-1", "since": "5m"})
            assert found.status_code == 200
            assert "&lt;script&gt;document.title=" in found.text
            assert HOSTILE not in found.text
            assert (await http.get("/agents")).status_code == 200


async def test_the_nats_server_killed_under_the_console(
    nats_server: NatsServer, registrar: Registrar
) -> None:
    """Pages answer while the server is down (what was last known, and why the rest is
    missing); once it is back, the calls made after are counted, none of those before lost."""
    agent, _ = make_agent(nats_server.url, "w-1", capability("work"))
    async with (
        agent,
        ReachClient(servers=nats_server.url) as client,
        serve_console(nats_server.url, None) as (base, console),
        httpx.AsyncClient(base_url=base, timeout=30) as http,
    ):
        rollup = console.view.rollup

        def counted() -> int:
            # the calls that succeeded: one that failed while the server came back is
            # audited too, as a failed call
            return rollup.capability("work", time.time(), seconds=300).ok

        for _ in range(20):
            await client.call("work", {})
        await until(lambda: counted() == 20, "the calls before")
        nats_server.kill()
        started = time.monotonic()
        page = await http.get("/agents")
        assert page.status_code == 200
        assert 'data-agent="w-1"' in page.text  # what it last knew
        assert time.monotonic() - started < 2
        search = await http.get("/calls", params={"call_id": "x"})
        assert search.status_code == 503  # said, not hung
        # the live feed says the figures are frozen, not "live" over them
        assert await _fabric_state(http) == "down"
        await asyncio.to_thread(nats_server.restart)
        made = 0
        deadline = time.monotonic() + 30
        while made < 20 and time.monotonic() < deadline:
            try:
                await client.call("work", {}, timeout=2)
                made += 1
            except Exception:
                await asyncio.sleep(0.2)
        assert made == 20
        await until(lambda: counted() >= 40, "the calls after", timeout=20)
        assert await _fabric_state(http) == "up"
        await asyncio.sleep(1)  # (none counted twice either: the follower goes on by sequence)
        assert counted() == 40
        assert (await http.get("/agents")).status_code == 200


async def _fabric_state(http: httpx.AsyncClient) -> str:
    """What the agents page's live feed says of the fabric as it opens: ``down`` (its
    ``fabric`` event), else ``up`` (it sends the table at once, no event)."""
    async with asyncio.timeout(10), http.stream("GET", "/live/agents") as feed:
        async for line in feed.aiter_lines():
            if line == "event: update":
                return "up"
            if line.startswith("data: "):
                return line.removeprefix("data: ")
    raise AssertionError("the feed ended before its first event")


def columns_batch(
    caller: str, callee: str, n: int, latency: float = 1.0, actor: str | None = None
) -> bytes:
    """A batch of ``n`` plain calls in columns, as the documented format has them
    (schemas/audit-batch.schema.json), written by hand; ``actor``: the gateway that made
    them for ``caller``."""
    now = time.time()
    plain = {
        "n": n,
        "capability": "evil",
        "ts": struct.pack(f"<{n}d", *[now] * n),
        "call_id": [f"col-{i}" for i in range(n)],
        "trace_id": bytes(16 * n),
        "caller": struct.pack(f"<{n}H", *[0] * n),
        "caller_agent": struct.pack(f"<{n}H", *[2] * n),
        "callee": struct.pack(f"<{n}H", *[1] * n),
        "latency_ms": struct.pack(f"<{n}d", *[latency] * n),
        "candidates": struct.pack(f"<{n}H", *[0] * n),
        "score": struct.pack(f"<{n}d", *[math.nan] * n),
        "attempt_latency_ms": struct.pack(f"<{n}d", *[latency] * n),
        "values": [caller, callee, None],
        "candidate_sets": [[[callee], 1]],
    }
    if actor is not None:
        plain["values"] = [caller, callee, None, actor]
        plain["actor"] = struct.pack(f"<{n}H", *[3] * n)
    return msgpack.packb(
        {"v": 4, "fields": ["ts"], "attempt_fields": ["agent_id"], "events": [], "plain": plain},
        use_bin_type=True,
    )


async def test_forged_and_hostile_columns_are_not_counted(
    nats_server: NatsServer, registrar: Registrar
) -> None:
    """Plain calls in columns are counted without a map made of each: a writer whose
    subject does not name the caller they claim is still refused, every call of them;
    columns that do not fit are refused whole, and the follower goes on."""
    async with serve_console(nats_server.url, None) as (base, console):
        outsider = await nats.connect(nats_server.url)
        js = outsider.jetstream()
        rollup = console.view.rollup
        # the subject names the writer "mallory", the columns claim calls by "victim"
        await js.publish("reach.v1.audit.evil.mallory", columns_batch("victim", "x-1", 50))
        await js.publish(
            "reach.v1.audit.evil.mallory", columns_batch("mallory", "x-1", 1, math.inf)
        )
        broken = msgpack.unpackb(columns_batch("mallory", "x-1", 5))
        broken["plain"]["callee"] = struct.pack("<5H", 1, 1, 1, 1, 7)  # past the names
        await js.publish("reach.v1.audit.evil.mallory", msgpack.packb(broken))
        await js.publish("reach.v1.audit.evil.mallory", columns_batch("mallory", "x-1", 3))
        # a gateway's calls for its caller are the gateway's to write, and no one else's
        await js.publish("reach.v1.audit.evil.gw", columns_batch("alice", "x-1", 2, actor="gw"))
        await js.publish(
            "reach.v1.audit.evil.mallory", columns_batch("alice", "x-1", 4, actor="gw")
        )
        await until(lambda: rollup.capability("evil", time.time()).calls == 5, "the genuine")
        await outsider.close()
        assert console.view.bad_events == 50 + 1 + 5 + 4
        assert rollup.instance("x-1", time.time()).calls == 5
        async with httpx.AsyncClient(base_url=base, timeout=10) as http:
            assert (await http.get("/capability/evil")).status_code == 200
