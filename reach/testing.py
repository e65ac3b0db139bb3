"""Test helpers for Agent-Reach users and for our own tests.

``NatsServer`` starts a real nats-server with JetStream on a free loopback port and a
temporary store; use it as a (sync or async) context manager. Installed as a pytest
plugin, this module also provides the ``nats_server`` fixture::

    async def test_my_agent(nats_server):
        async with ReachClient(servers=nats_server.url) as client: ...
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from reach.fabric.embedded import EmbeddedServer

__all__ = ["NatsServer", "nats_server"]


class NatsServer(EmbeddedServer):
    """A throwaway nats-server: free port, temporary store removed on exit."""

    def __init__(self, *, store_dir: str | Path | None = None, **kwargs: Any) -> None:
        self._own_store = store_dir is None
        store = Path(store_dir) if store_dir else Path(tempfile.mkdtemp(prefix="reach-nats-"))
        super().__init__(store_dir=store, **kwargs)

    def restart(self, timeout: float = 15.0) -> None:
        """Stop and start again on the same port and store (JetStream state survives)."""
        self.stop_now()
        self.start_now(timeout)

    def cleanup(self) -> None:
        self.stop_now()
        if self._own_store:
            shutil.rmtree(self.store_dir, ignore_errors=True)

    def __exit__(self, *exc: object) -> None:
        self.cleanup()

    async def __aexit__(self, *exc: object) -> None:
        self.cleanup()


try:
    import pytest
except ImportError:  # pragma: no cover - the fixture exists only under pytest
    pass
else:

    @pytest.fixture
    def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
        """A nats-server with JetStream on its own free port and temp store, per test."""
        server = NatsServer(store_dir=tmp_path / "nats")
        server.start_now()
        try:
            yield server
        finally:
            server.cleanup()
