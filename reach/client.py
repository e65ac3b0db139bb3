"""The caller: a live route cache, discovery, and calls to capabilities."""

from __future__ import annotations

import os
from collections.abc import Iterable

from reach.errors import ConfigurationError, DiscoveryError
from reach.models import Instance
from reach.registry.routecache import RouteCache
from reach.registry.store import RegistryStore
from reach.settings import resolve_credentials, resolve_servers
from reach.transport import Connection, connect

__all__ = ["ReachClient"]


class ReachClient:
    """Connects to the fabric; ``async with ReachClient() as client: ...``."""

    def __init__(
        self,
        *,
        servers: str | list[str] | None = None,
        credentials: str | os.PathLike[str] | None = None,
        name: str = "reach-client",
        sync_timeout: float = 10.0,
    ) -> None:
        self.servers = resolve_servers(servers)
        self.credentials = resolve_credentials(credentials)
        self.name = name
        self._sync_timeout = sync_timeout
        self._conn: Connection | None = None
        self._routes: RouteCache | None = None

    async def __aenter__(self) -> ReachClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def connect(self) -> None:
        self._conn = await connect(self.servers, name=self.name)
        try:
            try:
                store = await RegistryStore.open(self._conn, create=False)
            except ConfigurationError:
                raise DiscoveryError(
                    f"no registry at {', '.join(self.servers)}: is `reach up` running?"
                ) from None
            self._routes = RouteCache(store)
            await self._routes.start(self._sync_timeout)
        except BaseException:
            await self._conn.close()
            self._conn = None
            raise

    async def close(self) -> None:
        if self._routes is not None:
            await self._routes.stop()
            self._routes = None
        if self._conn is not None:
            await self._conn.close()
            self._conn = None

    @property
    def routes(self) -> RouteCache:
        """The live route cache (fails loudly before ``connect``)."""
        if self._routes is None:
            raise RuntimeError("connect the client first: `async with ReachClient() as client:`")
        return self._routes

    @property
    def connection(self) -> Connection:
        if self._conn is None:
            raise RuntimeError("connect the client first: `async with ReachClient() as client:`")
        return self._conn

    async def discover(
        self,
        capability: str | None = None,
        tags: Iterable[str] = (),
        version: str | None = None,
        include_unhealthy: bool = False,
    ) -> list[Instance]:
        """Instances from the local route cache; no network round trip."""
        return self.routes.find(capability, tags, version, include_unhealthy)
