"""Logins under flood, the parts: the credential cache following REACH_CREDENTIALS (real
nats-server), the store answering from it, and the refusal log's summaries (manual clock)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import pytest

from reach.clock import ManualClock
from reach.errors import ReachError
from reach.security import (
    ClientRecord,
    CredentialCache,
    CredentialsRejected,
    CredentialStore,
    RefusalLog,
)
from reach.testing import NatsServer
from reach.transport import Connection, KVEntry
from reach.wire.modelcodec import encode_model

# -- the cache (real nats-server) --------------------------------------------------------


@pytest.fixture
async def store(conn: Connection) -> CredentialStore:
    return await CredentialStore.open(conn)


@pytest.fixture
async def cache(store: CredentialStore) -> AsyncIterator[CredentialCache]:
    cache = CredentialCache(store.bucket)
    yield cache
    await cache.stop()


async def until(
    cache: CredentialCache, condition: Callable[[], bool], timeout: float = 5.0
) -> None:
    """Wait for the watch to deliver what makes ``condition`` true, change by change."""
    changed = asyncio.Event()
    stop = cache.on_change(lambda cid, rec: changed.set())
    try:
        async with asyncio.timeout(timeout):
            while not condition():
                changed.clear()
                await changed.wait()
    finally:
        stop()


async def test_the_cache_loads_the_bucket_then_follows_every_change(
    store: CredentialStore, cache: CredentialCache
) -> None:
    before, _ = await store.add("early", 1)
    changes: list[tuple[str, ClientRecord | None]] = []
    cache.on_change(lambda cid, rec: changes.append((cid, rec)))
    await cache.start()
    assert cache.ready
    assert cache.get("early") == before
    assert changes == [("early", before)]

    added, _ = await store.add("late", 2)
    await until(cache, lambda: cache.get("late") is not None)
    assert cache.get("late") == added

    revoked = await store.revoke("late")
    await until(cache, lambda: (r := cache.get("late")) is not None and r.revoked)
    assert changes[-1] == ("late", revoked)

    await store.bucket.delete("client.early")
    await until(cache, lambda: cache.get("early") is None)
    assert changes[-1] == ("early", None)
    assert len(cache) == 1


async def test_a_callback_that_fails_or_is_removed_does_not_stop_the_others(
    store: CredentialStore, cache: CredentialCache
) -> None:
    seen: list[str] = []

    def broken(client_id: str, record: ClientRecord | None) -> None:
        raise RuntimeError("boom")

    cache.on_change(broken)
    remove = cache.on_change(lambda cid, rec: seen.append(cid))
    await cache.start()
    await store.add("one", 1)
    await until(cache, lambda: seen == ["one"])
    remove()
    remove()  # twice is fine
    await store.add("two", 1)
    await until(cache, lambda: cache.get("two") is not None)
    assert seen == ["one"]


async def test_logins_are_answered_from_the_cache(
    store: CredentialStore, cache: CredentialCache
) -> None:
    _, secret = await store.add("owner", 2)
    await cache.start()
    store.cache = cache
    assert (await store.authenticate("owner", secret)).client_id == "owner"
    await store.revoke("owner")
    await until(cache, lambda: (r := cache.get("owner")) is not None and r.revoked)
    with pytest.raises(CredentialsRejected, match="revoked"):
        await store.authenticate("owner", secret)


async def test_a_miss_reads_the_bucket_only_within_a_budget(store: CredentialStore) -> None:
    clock = ManualClock()
    cache = CredentialCache(store.bucket, miss_reads_per_sec=2, clock=clock)
    try:
        await cache.start()
        store.cache = cache
        # added behind the cache's back, as if the watch had not delivered it yet
        record, secret = await store.add("fresh", 1)
        cache._records.pop("fresh", None)
        assert await store.authenticate("fresh", secret) == record  # read from the bucket
        cache._records.pop("fresh", None)
        assert cache.may_read_miss()  # the second read of the budget
        with pytest.raises(CredentialsRejected):  # budget spent: a miss is a miss
            await store.authenticate("fresh", secret)
        clock.advance(0.5)  # one read's worth comes back
        cache._records.pop("fresh", None)
        assert await store.authenticate("fresh", secret) == record
    finally:
        await cache.stop()


async def test_before_the_watch_catches_up_the_store_reads_the_bucket(
    store: CredentialStore,
) -> None:
    _, secret = await store.add("early-bird", 1)
    store.cache = CredentialCache(store.bucket)  # not started: not ready
    assert (await store.authenticate("early-bird", secret)).client_id == "early-bird"


async def test_with_the_server_down_logins_are_answered_from_memory_and_misses_refused(
    nats_server: NatsServer, store: CredentialStore, cache: CredentialCache
) -> None:
    """A failover or a server restart: the records in memory keep answering logins, an
    id the cache does not hold is refused within the bound instead of waiting on the
    bucket, and once the server is back the cache follows the bucket again."""
    _, secret = await store.add("steady", 2)
    await cache.start()
    store.cache = cache
    nats_server.stop_now()
    loop = asyncio.get_running_loop()
    started = loop.time()
    for _ in range(3):
        record = await store.authenticate("steady", secret, read_timeout=0.3)
        assert record.client_id == "steady"
    with pytest.raises(CredentialsRejected) as refused:
        await store.authenticate("stranger", secret, read_timeout=0.3)
    assert refused.value.reason == "unconfirmed"
    assert loop.time() - started < 2.0
    assert cache.ready

    nats_server.start_now()
    # the connection comes back by itself; then the cache learns of a new client soon
    # (its watch starts again on the reconnect, not when nats-py misses its heartbeats)
    added, later = await _add_when_back(store, "after-restart")
    await until(cache, lambda: cache.get("after-restart") is not None, timeout=3.0)
    assert await store.authenticate("after-restart", later, read_timeout=0.3) == added
    assert (await store.authenticate("steady", secret)).client_id == "steady"


async def _add_when_back(store: CredentialStore, client_id: str) -> tuple[ClientRecord, str]:
    """Add a client once the bucket takes writes again (the connection reconnecting)."""
    async with asyncio.timeout(20.0):
        while True:
            try:
                return await store.add(client_id, 1)
            except ReachError:
                await asyncio.sleep(0.1)  # reconnecting: no event to wait for here


# -- the refusal log (manual clock) -----------------------------------------------------


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "test.refusals"]


def test_a_few_refusals_get_a_line_each_and_no_summary(
    clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    refusals = RefusalLog(logging.getLogger("test.refusals"), first=3, clock=clock)
    with caplog.at_level(logging.WARNING, logger="test.refusals"):
        refusals.refused("dev", "bad_secret")
        refusals.refused("dev", "bad_secret")
        clock.advance(11)
        refusals.roll()
    assert _lines(caplog) == ["logins refused for 'dev': bad_secret"] * 2


def test_a_flood_gets_a_few_lines_then_one_summary_per_interval(
    clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    refusals = RefusalLog(
        logging.getLogger("test.refusals"), first=2, top=2, max_ids=100, clock=clock
    )
    with caplog.at_level(logging.WARNING, logger="test.refusals"):
        for i in range(10_000):
            refusals.refused("admin" if i % 2 else f"x{i}", "unknown_client")
        clock.advance(10)
        refusals.roll()
        refusals.roll()  # nothing new: no second summary
    lines = _lines(caplog)
    assert len(lines) == 3
    assert lines[2] == (
        "refused 10000 logins for 100+ client ids in the last 10 s"
        " (top: 'admin' x5000, 'x0' x1; unknown_client x10000)"
    )
    assert refusals.total == 10_000
    assert len(refusals._ids) == 0  # the interval's counters are gone


def test_every_interval_of_a_long_flood_gets_its_own_summary(
    clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    refusals = RefusalLog(logging.getLogger("test.refusals"), first=1, clock=clock)
    with caplog.at_level(logging.WARNING, logger="test.refusals"):
        for _ in range(6):  # a minute of flood
            for _ in range(500):
                refusals.refused("dev", "bad_secret")
            clock.advance(10)
    lines = _lines(caplog)
    assert len(lines) == 5 * 2 + 1  # the last interval's summary is still to come
    assert sum("refused 500 logins for 1 client ids" in line for line in lines) == 5


def test_long_ids_are_cut_and_nonsense_settings_refused(
    clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    refusals = RefusalLog(logging.getLogger("test.refusals"), clock=clock)
    with caplog.at_level(logging.WARNING, logger="test.refusals"):
        refusals.refused("a" * 10_000, "unknown_client")
    assert len(_lines(caplog)[0]) < 120
    with pytest.raises(ValueError, match="interval_sec"):
        RefusalLog(logging.getLogger("x"), interval_sec=0)


# -- a watch that calls itself caught up too early (a failover) -------------------------


class _EarlyCaughtUp:
    """The part of a KV bucket the cache reads: each watch says "caught up" before any
    record came (as one set up on a replica still catching up can), and ``get`` answers
    from what the bucket really holds."""

    def __init__(self, held: dict[str, bytes]) -> None:
        self.held = held
        self.watches = 0

    async def watch(self, keys: str) -> AsyncIterator[KVEntry | None]:
        self.watches += 1
        if self.watches == 1:  # the first watch sees everything
            for n, (key, value) in enumerate(self.held.items(), start=1):
                yield KVEntry(key, value, n)
        yield None
        if self.watches == 1:
            raise ReachError("the connection came back; watch again")
        await asyncio.Event().wait()  # nothing more comes

    async def get(self, key: str) -> KVEntry | None:
        value = self.held.get(key)
        return None if value is None else KVEntry(key, value, 1)


async def test_a_record_a_new_watch_missed_is_kept_unless_the_bucket_lost_it() -> None:
    records = {
        cid: ClientRecord(client_id=cid, secret_hash="hs256$x$y", level=1, created_at=1.0)
        for cid in ("kept", "deleted")
    }
    bucket = _EarlyCaughtUp({f"client.{c}": encode_model(r) for c, r in records.items()})
    cache = CredentialCache(bucket)  # type: ignore[arg-type]
    await cache.start()
    assert cache.get("kept") is not None
    assert cache.get("deleted") is not None
    del bucket.held["client.deleted"]  # deleted while the watch was away
    try:
        await until(cache, lambda: bucket.watches >= 2 and cache.get("deleted") is None)
        assert cache.get("kept") is not None  # still in the bucket: still answers logins
        assert cache.ready
    finally:
        await cache.stop()
