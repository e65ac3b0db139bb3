"""Fixtures of the fault scenarios: ``reach up`` as a process, single node or ``--cluster 3``.

Each runs in its own temporary directory (store, logs, audit spools) on a free loopback
port, with an environment without ``REACH_URL`` and ``REACH_CREDS``, and is stopped with
everything it started at teardown.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from bench.faults.fabric import Fabric, FabricKind, NoSmallDisk, start_fabric


async def _running(kind: FabricKind, tmp_path: Path) -> AsyncIterator[Fabric]:
    fabric = await start_fabric(kind, tmp_path)
    try:
        yield fabric
    finally:
        await fabric.stop()


@pytest.fixture
async def single_node(tmp_path: Path) -> AsyncIterator[Fabric]:
    """``reach up`` with its own nats-server."""
    async for fabric in _running("single", tmp_path):
        yield fabric


@pytest.fixture
async def cluster3(tmp_path: Path) -> AsyncIterator[Fabric]:
    """``reach up --cluster 3``: three nats-servers as one JetStream cluster."""
    async for fabric in _running("cluster", tmp_path):
        yield fabric


@pytest.fixture
async def operator_fabric(tmp_path: Path) -> AsyncIterator[Fabric]:
    """A nats-server with the login gate's config, and ``reach up --servers URL
    --auth-callout`` beside it as a process of its own."""
    async for fabric in _running("operator", tmp_path):
        yield fabric


@pytest.fixture
async def small_disk_fabric(tmp_path: Path) -> AsyncIterator[Fabric]:
    """``reach up`` with its store on a small tmpfs of its own (skipped where mounting one
    is not allowed: it needs root)."""
    try:
        fabric = await start_fabric("small-disk", tmp_path)
    except NoSmallDisk as exc:
        pytest.skip(str(exc))
    try:
        yield fabric
    finally:
        await fabric.stop()
