"""Login floods: an outsider hammering the login gate must not lock the owner out, slow
good logins down, grow `reach up`, or fill its log.

The flood is plain nats-py logins with a wrong secret (for the owner's client id) or
with random user names, from several concurrent connectors; meanwhile the owner logs in
(and asks the issuer for tokens) with the right secret, each within a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from reach.security.issuer import TokenReply, TokenRequest
from reach.wire import envelope, subjects
from reach.wire.modelcodec import decode_model, encode_model

from .conftest import UpFabric, attacker

#: seconds each flood lasts, and the connectors sending it at once
FLOOD_SEC = 6.0
CONNECTORS = 6
#: every login (or token) the owner asks for during the flood comes within this
DEADLINE = 2.0


async def _one_login(fabric: UpFabric, user: str, password: str) -> bool:
    """One login in the NATS protocol itself (INFO, CONNECT, PING): cheap for the flooder,
    and nothing left open however the server answers. True if the server let us in."""
    host, port = fabric.url.removeprefix("nats://").rsplit(":", 1)
    try:
        reader, writer = await asyncio.open_connection(host, int(port))
    except OSError:
        return False
    try:
        await reader.readline()  # INFO
        connect = {"user": user, "pass": password, "verbose": False, "pedantic": False}
        writer.write(b"CONNECT " + json.dumps(connect).encode() + b"\r\nPING\r\n")
        await writer.drain()
        answer = await reader.readline()
    except OSError:
        return False
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
    return answer.startswith(b"PONG")


@contextlib.asynccontextmanager
async def flood(fabric: UpFabric, users: Callable[[], str]) -> AsyncIterator[list[int]]:
    """Wrong-secret logins as ``users()`` from CONNECTORS tasks until the block ends;
    yields the list that counts the attempts (one counter per connector)."""
    counts = [0] * CONNECTORS
    stop = asyncio.Event()

    async def connector(i: int) -> None:
        while not stop.is_set():
            ok = await _one_login(fabric, users(), "wrong-" + uuid.uuid4().hex)
            assert not ok, "a wrong secret was let in"
            counts[i] += 1

    tasks = [asyncio.create_task(connector(i)) for i in range(CONNECTORS)]
    try:
        yield counts
    finally:
        stop.set()
        await asyncio.gather(*tasks)


async def _owner_logins(fabric: UpFabric, creds: Path) -> list[float]:
    """The owner logs in again and again for FLOOD_SEC; the time each login took."""
    took: list[float] = []
    end = time.monotonic() + FLOOD_SEC
    while time.monotonic() < end:
        started = time.monotonic()
        async with asyncio.timeout(DEADLINE):
            nc = await attacker(fabric, creds)
        took.append(time.monotonic() - started)
        await nc.close()
    return took


async def _token(fabric: UpFabric, creds: Path) -> TokenReply:
    """A fabric token for ``creds`` from `reach.v1.auth.token`, as a renewal asks for it."""
    client_id, secret = fabric.secret_of(creds)
    nc = await attacker(fabric, creds)
    try:
        data = envelope.pack_request(
            envelope.RequestMeta(call_id=f"token-{uuid.uuid4().hex[:12]}"),
            encode_model(TokenRequest(client_id=client_id, secret=secret)),
        )
        msg = await nc.request(subjects.TOKEN, data, timeout=DEADLINE)
    finally:
        await nc.close()
    reply = envelope.unpack_reply(msg.data)
    assert reply.ok, reply.description
    return decode_model(TokenReply, reply.body)


async def test_a_wrong_secret_flood_never_locks_the_owner_out(up_fabric: UpFabric) -> None:
    client_id, creds = await up_fabric.add_client(level=2)
    async with flood(up_fabric, lambda: client_id) as attempts:
        took = await _owner_logins(up_fabric, creds)
        tokens = [await _token(up_fabric, creds) for _ in range(3)]
    assert sum(attempts) > 50, attempts  # it was a flood
    assert max(took) < DEADLINE, took
    assert all(t.level == 2 for t in tokens)


async def test_the_dev_credential_survives_a_flood_and_a_few_typos(up_fabric: UpFabric) -> None:
    dev = up_fabric.store / "dev.creds"
    client_id, _ = up_fabric.secret_of(dev)
    for _ in range(2):  # a user's typos
        assert not await _one_login(up_fabric, client_id, "typo")
    async with asyncio.timeout(DEADLINE):
        await (await attacker(up_fabric, dev)).close()
    async with flood(up_fabric, lambda: client_id):
        took = await _owner_logins(up_fabric, dev)
        token = await _token(up_fabric, dev)
    assert max(took) < DEADLINE
    assert token.level == 4


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _refusal_lines(fabric: UpFabric) -> int:
    assert fabric.stderr is not None
    return sum("refused" in line for line in fabric.stderr.read_text().splitlines())


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
async def test_a_random_names_flood_keeps_logins_fast_and_the_gate_small(
    up_fabric: UpFabric,
) -> None:
    _, creds = await up_fabric.add_client(level=1)
    # warm up: the first logins load what every later one uses
    for _ in range(3):
        await (await attacker(up_fabric, creds)).close()
    rss_before = _rss_kib(up_fabric.proc.pid)
    lines_before = _refusal_lines(up_fabric)

    def random_name() -> str:
        return f"x{random.getrandbits(64):x}"

    async with flood(up_fabric, random_name) as attempts:
        took = await _owner_logins(up_fabric, creds)
    grown_mib = (_rss_kib(up_fabric.proc.pid) - rss_before) / 1024
    lines = _refusal_lines(up_fabric) - lines_before
    assert sum(attempts) > 50, attempts
    assert max(took) < DEADLINE, max(took)
    # the gate keeps nothing per unknown id beyond capped counters: a few thousand
    # attempts may move the allocator's high-water mark, not add a hash's memory per check
    assert grown_mib < 24, f"reach up grew by {grown_mib:.1f} MiB over {sum(attempts)} logins"
    # a few lines for the first refusals, then summaries, however many attempts
    assert lines <= 20, f"{lines} log lines for {sum(attempts)} refused logins"
