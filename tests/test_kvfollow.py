"""Following a public KV bucket without a JetStream consumer (reach.transport.kvfollow): a scan by
batched direct gets, then the changes the server republishes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator

import pytest

from reach.testing import NatsServer
from reach.transport import Connection, KVBucket, connect, kvfollow
from reach.transport.kvfollow import KVEntry


@pytest.fixture
async def public(nats_server: NatsServer) -> AsyncIterator[tuple[Connection, KVBucket]]:
    """A connection and a public bucket ``PUB`` (republished changes, direct gets)."""
    conn = await connect([nats_server.url], name="t")
    try:
        yield conn, await conn.key_value("PUB", public=True)
    finally:
        await conn.close()


async def _next(changes: AsyncGenerator[KVEntry | None, None]) -> KVEntry | None:
    return await asyncio.wait_for(anext(changes), 5)


async def test_a_scan_reads_every_key_across_batches_newest_value_and_deletions_included(
    public: tuple[Connection, KVBucket],
) -> None:
    conn, bucket = public
    await asyncio.gather(*(bucket.put(f"k.{i}", b"%d" % i) for i in range(1300)))
    await bucket.put("k.5", b"new")
    await bucket.delete("k.7")
    found = await kvfollow.scan(conn._nc, "PUB", "k.>")
    assert len(found) == 1300
    assert found["k.5"].value == b"new"
    assert found["k.7"].deleted
    assert not found["k.8"].deleted
    assert await kvfollow.scan(conn._nc, "PUB", "none.>") == {}


async def test_a_follower_sees_current_values_then_changes_and_no_consumer_is_made(
    public: tuple[Connection, KVBucket],
) -> None:
    conn, bucket = public
    await bucket.put("a", b"1")
    await bucket.put("gone", b"x")
    await bucket.delete("gone")
    changes = bucket.watch(">")
    assert isinstance(changes, AsyncGenerator)
    first = await _next(changes)
    assert first is not None
    assert (first.key, first.value) == ("a", b"1")
    assert await _next(changes) is None  # caught up: the deleted key is not yielded
    await bucket.put("b", b"2")
    await bucket.delete("a")
    b = await _next(changes)
    a = await _next(changes)
    assert b is not None
    assert (b.key, b.value, b.deleted) == ("b", b"2", False)
    assert a is not None
    assert (a.key, a.deleted) == ("a", True)
    info = await conn._js.stream_info("KV_PUB")
    assert info.state.consumer_count == 0
    await changes.aclose()


async def test_a_follower_scans_again_after_a_reconnect_and_yields_only_what_changed(
    nats_server: NatsServer, public: tuple[Connection, KVBucket]
) -> None:
    conn, bucket = public
    await bucket.put("a", b"1")
    await bucket.put("b", b"1")
    changes = bucket.watch(">")
    assert isinstance(changes, AsyncGenerator)
    assert {(await _next(changes)).key for _ in range(2)} == {"a", "b"}  # type: ignore[union-attr]
    assert await _next(changes) is None
    back = asyncio.Event()
    conn.on_reconnect(back.set)
    nats_server.restart()
    await asyncio.wait_for(back.wait(), 20)
    # what the follower missed while away is found by its new scan; what it held
    # and did not change is not yielded again
    other = await connect([nats_server.url], name="writer")
    writer = await other.key_value("PUB", public=True)
    await writer.delete("a")
    await writer.put("c", b"3")
    seen = {}
    while len(seen) < 2:
        change = await _next(changes)
        assert change is not None
        seen[change.key] = change
    assert seen["a"].deleted
    assert seen["c"].value == b"3"
    assert "b" not in seen
    await other.close()
    await changes.aclose()


def test_differences_turn_what_is_held_into_what_is_now() -> None:
    held = {"a": 3, "b": 4, "c": 5}
    now = {
        "a": KVEntry("a", b"same", 3),
        "b": KVEntry("b", b"newer", 9),
        "c": KVEntry("c", b"", 10, deleted=True),
        "d": KVEntry("d", b"new", 11),
        "e": KVEntry("e", b"", 12, deleted=True),
    }
    out = kvfollow._differences(held, now)
    assert [(e.key, e.deleted) for e in out] == [("b", False), ("d", False), ("c", True)]
    assert held == {"a": 3, "b": 9, "d": 11}
    out = kvfollow._differences(held, {})  # all gone (a bucket purged while away)
    assert sorted(e.key for e in out) == ["a", "b", "d"]
    assert held == {}
