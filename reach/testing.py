"""Test helpers for Agent-Reach users and for our own tests: a pytest plugin.

``NatsServer`` starts a real nats-server with JetStream on a free loopback port and a
temporary store; use it as a (sync or async) context manager. ``wait_routable`` waits
until a client can route calls to a capability.

Installed as a pytest plugin (the ``pytest11`` entry point), this module gives every
project that depends on Agent-Reach these fixtures (docs/testing.md):

- ``nats_server``: a bare nats-server per test;
- ``reach_fabric``: an open fabric (nats-server and registrar, no tokens);
- ``reach_secure_fabric``: a fabric secured as ``reach up`` secures it (logins, token
  issuer, login gate, registrar);
- ``reach_credentials``: ``await reach_credentials("analyst", 2)``, a credentials file of
  the secured fabric;
- ``reach_agent``: ``await reach_agent(manifest, handler)``, an agent started on the
  fabric in use and stopped with the test;
- ``reach_client``: ``await reach_client(level=2)``, a connected ``ReachClient``;
- ``reach_active_fabric``: the fabric ``reach_agent`` and ``reach_client`` use: the
  secured one when the test asks for it (or for ``reach_credentials``), else the open one.

The fabrics, agents and clients are function-scoped and stopped after the test, also
when it fails. The async fixtures need pytest-asyncio (``pip install
'agent-reach[testing]'``) and work in its auto and strict modes.

pytest imports this module in every project that installs Agent-Reach, so it imports
little at load: what a fixture runs is imported when the fixture first runs.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

from reach.errors import ConfigurationError
from reach.fabric.embedded import EmbeddedServer

if TYPE_CHECKING:
    import pytest

    from reach.agent.agent import Agent
    from reach.caller.client import ReachClient
    from reach.fabric.root import Fabric
    from reach.wire.models import Instance, Manifest

__all__ = [
    "AgentFactory",
    "ClientFactory",
    "CredentialsFactory",
    "Handler",
    "NatsServer",
    "nats_server",
    "reach_active_fabric",
    "reach_agent",
    "reach_client",
    "reach_credentials",
    "reach_fabric",
    "reach_secure_fabric",
    "wait_routable",
]

#: a capability's handler: an async function of the request
Handler = Callable[[Any], Awaitable[Any]]

#: the clearance of a client ``reach_client`` makes when no level is given: it may call
#: every capability
DEFAULT_CLIENT_LEVEL = 4

#: what a credential's client id may hold (reach.security.credentials)
_NOT_IN_CLIENT_ID = re.compile(r"[^A-Za-z0-9_-]")
_CLIENT_ID_MAX = 64


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


async def wait_routable(
    client: ReachClient,
    capability: str,
    *,
    count: int = 1,
    tags: Iterable[str] = (),
    timeout: float = 10.0,
) -> list[Instance]:
    """Wait until ``client``'s route cache holds ``count`` instances of ``capability``
    (with all ``tags``) that calls are routed to (not unhealthy); those instances.

    TimeoutError after ``timeout`` seconds names what the client knows of it instead.
    """
    if count < 1:
        raise ConfigurationError(f"wait_routable: count must be 1 or more, not {count}")
    wanted = tuple(tags)
    routes = client.routes
    try:
        await routes.wait_for(lambda cache: len(cache.find(capability, wanted)) >= count, timeout)
    except TimeoutError:
        known = routes.find(capability, wanted, include_unhealthy=True)
        seen = ", ".join(f"{i.agent_id} ({i.status})" for i in known) or "none"
        tagged = f" tagged {', '.join(wanted)}" if wanted else ""
        raise TimeoutError(
            f"{capability}: no {count} routable instance(s){tagged} within {timeout:g} s;"
            f" the client knows {seen}"
        ) from None
    return routes.find(capability, wanted)


class CredentialsFactory:
    """``await reach_credentials(client_id, level, ...)``: a new credential of the secured
    fabric, written to ``<store>/<client_id>.creds``; its path (``credentials=`` of
    ``Agent``, ``ReachClient``, ``reach_agent`` and ``reach_client``, or ``REACH_CREDS``).

    A caller's: ``client_id`` and ``level`` (1..4), and ``roles`` (``"jobs"``: it may read
    the results of async jobs). An agent's: ``agent_id`` and the ``capabilities`` it
    serves, as ``reach creds add --agent-id … --cap …`` makes it.
    """

    def __init__(self, fabric: Fabric) -> None:
        self.fabric = fabric

    async def __call__(
        self,
        client_id: str,
        level: int,
        *,
        agent_id: str | None = None,
        capabilities: Iterable[str] = (),
        roles: Iterable[str] = (),
    ) -> Path:
        served = _names(capabilities)
        if served and agent_id is None:
            raise ConfigurationError(
                f"credentials {client_id!r}: capabilities name what an agent serves:"
                " give agent_id too"
            )
        if agent_id is not None and not served:
            raise ConfigurationError(
                f"credentials {client_id!r}: an agent's credential (agent_id={agent_id!r})"
                " needs the capabilities it serves"
            )
        return await self.fabric.add_client(
            client_id, level, agent_id=agent_id, capabilities=served, roles=_names(roles)
        )


class AgentFactory:
    """``await reach_agent(manifest, handler)``: an agent started on the fabric; it is
    stopped after the test (stopping it earlier is fine).

    ``manifest``: a dict, a ``Manifest``, or the path of a YAML manifest (agent.yaml).
    ``handler``: an async function serving every capability of the manifest, or a dict of
    them by capability name. ``credentials``: on the secured fabric, the agent's
    credential (default: one made for it, bound to its agent id and capabilities, at the
    highest ``security_level`` they declare, with the jobs role if it runs async jobs);
    on the open fabric none is used unless given. Other keyword arguments go to
    ``Agent`` (``readiness=``, ...).
    """

    def __init__(self, fabric: Fabric) -> None:
        self.fabric = fabric
        #: the agents started, in order
        self.started: list[Agent] = []
        self._stack = contextlib.AsyncExitStack()
        self._credentials: dict[str, Path] = {}

    async def __call__(
        self,
        manifest: Manifest | Mapping[str, Any] | str | os.PathLike[str],
        handler: Handler | Mapping[str, Handler],
        *,
        credentials: str | os.PathLike[str] | None = None,
        **options: Any,
    ) -> Agent:
        from reach.agent.agent import Agent, load_manifest

        if isinstance(manifest, str | os.PathLike):
            manifest = load_manifest(manifest)
        agent = Agent(
            manifest if not isinstance(manifest, Mapping) else dict(manifest),
            servers=self.fabric.url,
            **options,
        )
        _register(agent, handler)
        if credentials is None and self.fabric.secure:
            agent.credentials = await self._credential_of(agent)
        else:  # never one of the environment's (REACH_CREDS, .reach/dev.creds)
            agent.credentials = Path(credentials) if credentials is not None else None
        await agent.start()
        self.started.append(agent)
        self._stack.push_async_callback(agent.stop)
        return agent

    async def _credential_of(self, agent: Agent) -> Path:
        """The credential the factory made for ``agent_id`` (made on its first start)."""
        path = self._credentials.get(agent.agent_id)
        if path is None:
            names = [cap.name for cap in agent.manifest.capabilities]
            level = max((cap.security_level for cap in agent.manifest.capabilities), default=1)
            client_id = _NOT_IN_CLIENT_ID.sub("-", agent.agent_id)[:_CLIENT_ID_MAX]
            # an async-mode agent writes its jobs' records to REACH_JOBS: the jobs role
            roles = ("jobs",) if agent.manifest.mode == "async" else ()
            path = await CredentialsFactory(self.fabric)(
                client_id, level, agent_id=agent.agent_id, capabilities=names, roles=roles
            )
            self._credentials[agent.agent_id] = path
        return path

    async def close(self) -> None:
        """Stop every agent started, the last first (each also when another fails)."""
        await self._stack.aclose()


class ClientFactory:
    """``await reach_client()``: a ``ReachClient`` connected to the fabric; it is closed
    after the test (closing it earlier is fine).

    On the secured fabric: ``credentials=`` a credentials file, or a new caller's made
    with ``level`` (default 4: it may call every capability), ``roles`` and ``client_id``
    (default ``client-N``). On the open fabric no credential is used unless given. Other
    keyword arguments go to ``ReachClient`` (``fallback=``, ``max_retries=``, ...).
    """

    def __init__(self, fabric: Fabric) -> None:
        self.fabric = fabric
        #: the clients connected, in order
        self.connected: list[ReachClient] = []
        self._stack = contextlib.AsyncExitStack()
        self._made = 0

    async def __call__(
        self,
        credentials: str | os.PathLike[str] | None = None,
        *,
        level: int | None = None,
        roles: Iterable[str] = (),
        client_id: str | None = None,
        **options: Any,
    ) -> ReachClient:
        from reach.caller.client import ReachClient

        roles = _names(roles)
        made = level is not None or bool(roles) or client_id is not None
        if credentials is not None and made:
            raise ConfigurationError(
                "reach_client: give credentials= or the level=, roles= and client_id= of a"
                " new credential, not both"
            )
        if made and not self.fabric.secure:
            raise ConfigurationError(
                "reach_client: an open fabric has no credentials: level=, roles= and"
                " client_id= need the secured one (reach_secure_fabric)"
            )
        if credentials is None and self.fabric.secure:
            self._made += 1
            credentials = await CredentialsFactory(self.fabric)(
                client_id or f"client-{self._made}",
                DEFAULT_CLIENT_LEVEL if level is None else level,
                roles=roles,
            )
        client = ReachClient(servers=self.fabric.url, **options)
        # never one of the environment's (REACH_CREDS, .reach/dev.creds)
        client.credentials = Path(credentials) if credentials is not None else None
        await client.connect()
        self.connected.append(client)
        self._stack.push_async_callback(client.close)
        return client

    async def close(self) -> None:
        """Close every client connected, the last first (each also when another fails)."""
        await self._stack.aclose()


def _names(names: Iterable[str]) -> tuple[str, ...]:
    """Names given as one string or as several."""
    return (names,) if isinstance(names, str) else tuple(names)


def _register(agent: Agent, handler: Handler | Mapping[str, Handler]) -> None:
    """``handler`` for every capability of ``agent``, or each of a dict for its own."""
    if isinstance(handler, Mapping):
        for name, function in handler.items():
            agent.capability(name)(function)
    elif callable(handler):
        for capability in agent.manifest.capabilities:
            agent.capability(capability.name)(handler)
    else:
        raise ConfigurationError(
            f"the handler of {agent.agent_id} must be an async function or a dict of them"
            f" by capability name, not {type(handler).__name__}"
        )


def _hermetic(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fabric: Fabric) -> None:
    """What runs in the test finds this fabric (REACH_URL), no credential of the user's
    (REACH_CREDS), and spools audit events in the test's directory."""
    monkeypatch.setenv("REACH_URL", fabric.url)
    monkeypatch.delenv("REACH_CREDS", raising=False)
    monkeypatch.setenv("REACH_AUDIT_SPOOL", str(tmp_path / "reach-audit-spool"))


try:
    import pytest
except ImportError:  # pragma: no cover - the fixtures exist only under pytest
    pass
else:
    F = TypeVar("F", bound=Callable[..., Any])

    def _async_fixture(function: F) -> F:
        """An async fixture of pytest-asyncio (auto and strict mode alike); without
        pytest-asyncio, a fixture that fails saying what to install."""
        try:
            import pytest_asyncio
        except ImportError:
            name = function.__name__

            def missing() -> None:
                pytest.fail(
                    f"the fixture {name} is async: it needs pytest-asyncio"
                    " (pip install 'agent-reach[testing]')",
                    pytrace=False,
                )

            missing.__doc__ = function.__doc__
            return cast(F, pytest.fixture(name=name)(missing))
        return cast(F, pytest_asyncio.fixture(function))

    @pytest.fixture
    def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
        """A nats-server with JetStream on its own free port and temp store, per test."""
        server = NatsServer(store_dir=tmp_path / "nats")
        server.start_now()
        try:
            yield server
        finally:
            server.cleanup()

    @_async_fixture
    async def reach_fabric(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> AsyncIterator[Fabric]:
        """An open fabric (a ``reach.fabric.Fabric``): its own nats-server on a free port
        and a registrar; no credentials, calls carry no tokens. ``.url`` is its URL (also
        in REACH_URL during the test)."""
        from reach.fabric import Fabric

        async with Fabric(tmp_path / "reach-fabric", secure=False) as fabric:
            _hermetic(monkeypatch, tmp_path, fabric)
            yield fabric

    @_async_fixture
    async def reach_secure_fabric(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> AsyncIterator[Fabric]:
        """A fabric secured as ``reach up`` secures it (a ``reach.fabric.Fabric``): its own
        nats-server that logs clients in through the login gate, a token issuer, a
        registrar. Credentials: ``reach_credentials``, or ``.creds("dev")`` (level 4,
        admin role). ``.url`` is its URL (also in REACH_URL during the test)."""
        from reach.fabric import Fabric

        async with Fabric(tmp_path / "reach-secure-fabric", secure=True) as fabric:
            _hermetic(monkeypatch, tmp_path, fabric)
            yield fabric

    @pytest.fixture
    def reach_active_fabric(
        request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
    ) -> Fabric:
        """The fabric ``reach_agent`` and ``reach_client`` use: ``reach_secure_fabric``
        when the test (or a fixture it uses) asks for it or for ``reach_credentials``,
        else ``reach_fabric``. Override it in a conftest.py to choose another."""
        secure = "reach_secure_fabric" in request.fixturenames
        fabric = request.getfixturevalue("reach_secure_fabric" if secure else "reach_fabric")
        monkeypatch.setenv("REACH_URL", fabric.url)
        return cast("Fabric", fabric)

    @pytest.fixture
    def reach_credentials(reach_secure_fabric: Fabric) -> CredentialsFactory:
        """``await reach_credentials(client_id, level, agent_id=None, capabilities=(),
        roles=())``: a credentials file of the secured fabric (see
        ``CredentialsFactory``)."""
        return CredentialsFactory(reach_secure_fabric)

    @_async_fixture
    async def reach_agent(reach_active_fabric: Fabric) -> AsyncIterator[AgentFactory]:
        """``await reach_agent(manifest, handler, credentials=None, **options)``: an agent
        started on the fabric in use, stopped after the test (see ``AgentFactory``)."""
        factory = AgentFactory(reach_active_fabric)
        try:
            yield factory
        finally:
            await factory.close()

    @_async_fixture
    async def reach_client(reach_active_fabric: Fabric) -> AsyncIterator[ClientFactory]:
        """``await reach_client(credentials=None, level=None, roles=(), **options)``: a
        connected ``ReachClient`` on the fabric in use, closed after the test (see
        ``ClientFactory``)."""
        factory = ClientFactory(reach_active_fabric)
        try:
            yield factory
        finally:
            await factory.close()
