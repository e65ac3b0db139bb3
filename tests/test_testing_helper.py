"""reach.testing: throwaway nats-servers with JetStream, and the ``nats_server`` fixture."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from reach.errors import Disconnected
from reach.testing import NatsServer
from reach.transport import connect

BUCKET = "TEST_HELPER"


async def _put(url: str, key: str, value: bytes) -> None:
    conn = await connect([url], name="test-helper")
    try:
        bucket = await conn.key_value(BUCKET)
        await bucket.put(key, value)
    finally:
        await conn.close()


async def _get(url: str, key: str) -> bytes | None:
    conn = await connect([url], name="test-helper")
    try:
        bucket = await conn.key_value(BUCKET, create=False)
        entry = await bucket.get(key)
    finally:
        await conn.close()
    return entry.value if entry else None


async def test_server_starts_on_a_free_port_with_jetstream() -> None:
    with NatsServer() as server:
        assert server.running
        assert server.url == f"nats://127.0.0.1:{server.port}"
        await _put(server.url, "k", b"v")
        assert await _get(server.url, "k") == b"v"


def test_two_servers_at_once_get_different_ports_and_stores() -> None:
    with NatsServer() as one, NatsServer() as two:
        assert one.running
        assert two.running
        assert one.port != two.port
        assert one.store_dir != two.store_dir


async def test_restart_keeps_the_port_and_the_jetstream_store() -> None:
    with NatsServer() as server:
        port = server.port
        await _put(server.url, "survivor", b"still here")
        server.restart()
        assert server.running
        assert server.port == port
        assert await _get(server.url, "survivor") == b"still here"


def test_cleanup_stops_the_server_and_removes_its_temporary_store() -> None:
    server = NatsServer()
    server.start_now()
    store = server.store_dir
    assert store.is_dir()
    server.cleanup()
    assert not server.running
    assert not store.exists()


def test_cleanup_keeps_a_store_directory_it_was_given(tmp_path: Path) -> None:
    store = tmp_path / "kept"
    with NatsServer(store_dir=store) as server:
        assert server.running
    assert store.is_dir()


async def test_async_context_manager_starts_and_cleans_up() -> None:
    async with NatsServer() as server:
        assert server.running
        await _put(server.url, "k", b"v")
        store = server.store_dir
    assert not server.running
    assert not store.exists()


async def test_server_started_from_async_code_outlives_the_worker_threads() -> None:
    # PR_SET_PDEATHSIG fires when the forking *thread* exits: start() must not fork from a
    # to_thread worker, or the server dies when the loop's executor shuts its threads down.
    async with NatsServer() as server:
        await asyncio.get_running_loop().shutdown_default_executor()
        # the signal would arrive within milliseconds; watch for a while that none does
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            assert server.running
            await asyncio.sleep(0.05)
        assert "Trapped" not in server.log_file.read_text()
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(server.host, server.port), timeout=5
        )
        try:
            info = await asyncio.wait_for(reader.readline(), timeout=5)
        finally:
            writer.close()
            await writer.wait_closed()
        assert info.startswith(b"INFO ")


def test_server_on_a_port_another_server_holds_fails_instead_of_using_that_one(
    nats_server: NatsServer,
) -> None:
    other = NatsServer(port=nats_server.port)
    try:
        with pytest.raises(Disconnected, match="exited"):
            other.start_now(timeout=10)
        assert not other.running
    finally:
        other.cleanup()
    assert nats_server.running


def test_nats_server_fixture_gives_a_running_server_in_the_test_directory(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    assert nats_server.running
    assert nats_server.store_dir.is_relative_to(tmp_path)
    asyncio.run(_put(nats_server.url, "k", b"v"))
    assert asyncio.run(_get(nats_server.url, "k")) == b"v"
