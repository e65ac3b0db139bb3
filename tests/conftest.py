"""Shared fixtures: a real nats-server per test (from reach.testing), fabrics on it started
with ``reach.fabric.Fabric`` (an open one's registrar, a secured one), a client, and agents
running as separate OS processes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from reach.agent.agent import Agent
from reach.caller.client import ReachClient
from reach.fabric import Fabric as ReachFabric
from reach.native import compiled_modules, stale_message
from reach.registry import Registrar, RegistrarConfig
from reach.security import natsconf
from reach.security.issuer import TokenService
from reach.testing import NatsServer
from reach.transport import Connection, connect

if TYPE_CHECKING:
    from tests.calls_helpers import Behaviour

HERE = Path(__file__).parent


#: the token fixtures (clock, ring, issuer, verifier) of the token and revocation tests,
#: and ``secured`` (a fabric `reach up` started) of the permission and CLI tests
pytest_plugins = ["tests.token_helpers", "tests.up_helpers"]


#: the variables of the test run itself (`make test` says which build it tests; the
#: console's browser test saves its screenshots where REACH_SCREENSHOTS says)
_RUN_VARIABLES = frozenset({"REACH_TEST_BUILD", "REACH_SCREENSHOTS"})


def pytest_sessionstart(session: pytest.Session) -> None:
    """Refuse to test compiled modules older than their sources: that is not the code
    under test (``make build`` rebuilds them; ``make pure`` removes them). Forget the
    REACH_* variables of the shell that started the run (REACH_URL, REACH_CREDS, ...):
    what a user set for their own fabric changes nothing here."""
    for name in list(os.environ):
        if name.startswith("REACH_") and name not in _RUN_VARIABLES:
            del os.environ[name]
    stale = stale_message()
    if stale is not None:
        pytest.exit(stale, returncode=4)
    # `make test` runs the suite on each build: it says which one it means to test
    expected = os.environ.get("REACH_TEST_BUILD")
    running = "compiled" if "reach.caller.client" in compiled_modules() else "pure"
    if expected is not None and expected != running:
        pytest.exit(
            f"REACH_TEST_BUILD={expected} but the {running} build of reach was imported"
            f" (from {Path(sys.modules['reach'].__file__ or '').parent})",
            returncode=4,
        )


def manifest(
    agent_id: str,
    *capabilities: str,
    interval: float = 0.5,
    timeout: float = 0.3,
    failures: int = 2,
    tags: tuple[str, ...] = ("test-tag",),
    version: str = "1.0.0",
    **extra: Any,
) -> dict[str, Any]:
    """A manifest dict with short health intervals so process tests run in seconds."""
    return {
        "agent_id": agent_id,
        "agent_name": agent_id.rsplit("-", 1)[0] if "-" in agent_id else agent_id,
        "version": version,
        "capabilities": [
            {"name": c, "tags": list(tags), "latency_sla_ms": 500, "security_level": 1}
            for c in (capabilities or ("echo",))
        ],
        "health": {
            "interval_sec": interval,
            "timeout_sec": timeout,
            "failures_before_unhealthy": failures,
        },
        **extra,
    }


@pytest.fixture
async def mapped_server(tmp_path: Path) -> AsyncIterator[NatsServer]:
    """A nats-server with the heartbeat mapping every config reach writes carries."""
    config = natsconf.write_open_config(tmp_path / "nats.conf")
    server = NatsServer(store_dir=tmp_path / "nats-mapped", config_file=config)
    await server.start()
    try:
        yield server
    finally:
        server.stop_now()


@pytest.fixture
async def conn(nats_server: NatsServer) -> AsyncIterator[Connection]:
    c = await connect([nats_server.url], name="test")
    yield c
    await c.close()


@pytest.fixture
async def registrar(nats_server: NatsServer, tmp_path: Path) -> AsyncIterator[Registrar]:
    """An open fabric's registrar (no tokens) on ``nats_server``."""
    config = RegistrarConfig(liveness_interval_sec=0.2)
    async with ReachFabric(
        tmp_path / "open-fabric", servers=[nats_server.url], secure=False, registrar=config
    ) as fabric:
        assert fabric.registrar is not None
        yield fabric.registrar


@pytest.fixture
async def client(nats_server: NatsServer, registrar: Registrar) -> AsyncIterator[ReachClient]:
    async with ReachClient(servers=nats_server.url) as c:
        yield c


@dataclass
class Fabric:
    """A secured fabric: a token issuer, a registrar, and credentials of four clients."""

    url: str
    conn: Connection
    issuer: TokenService
    creds: dict[str, Path]


@pytest.fixture
async def fabric(nats_server: NatsServer, tmp_path: Path) -> AsyncIterator[Fabric]:
    """Tokens on ``nats_server`` (no NATS logins: tests send raw requests anonymously)."""
    async with ReachFabric(tmp_path / "fabric", servers=[nats_server.url]) as root:
        services = root.services
        assert services is not None
        assert services.conn is not None
        assert services.issuer is not None
        creds = {}
        # agent credentials serve exactly the capabilities they list
        for client_id, level, agent_id, caps in (
            ("vault", 3, "vault-1", ("customer_orders",)),
            ("analyst", 2, None, ()),
            ("auditor", 3, None, ()),
            ("intruder", 1, "intruder-1", ("weather", "step_b")),
        ):
            creds[client_id] = await root.add_client(
                client_id, level, agent_id=agent_id, capabilities=caps
            )
        yield Fabric(root.url, services.conn, services.issuer, creds)


def vault_agent(fabric: Fabric, behaviour: Behaviour) -> Agent:
    """vault-1 serving customer_orders at level 3, with the vault's credentials."""
    from tests.calls_helpers import capability, make_agent

    agent, _ = make_agent(
        fabric.url, "vault-1", capability("customer_orders", level=3), behaviour=behaviour
    )
    agent.credentials = fabric.creds["vault"]
    return agent


class AgentProcess:
    """A running tests/agent_process.py."""

    def __init__(self, proc: subprocess.Popen[str], agent_id: str) -> None:
        self.proc = proc
        self.agent_id = agent_id

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return self.proc.returncode


async def _read_line(proc: subprocess.Popen[str], timeout: float) -> str:
    assert proc.stdout is not None
    line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), timeout)
    return line.strip()


@pytest.fixture
def spawn_agent(nats_server: NatsServer) -> Iterator[Callable[..., Any]]:
    """``await spawn_agent(manifest_dict, not_ready_file=..., expect="READY")``."""
    started: list[AgentProcess] = []

    async def spawn(
        manifest_data: dict[str, Any],
        *,
        not_ready_file: Path | None = None,
        delay_ms: float = 0,
        expect: str = "READY",
        url: str | None = None,
    ) -> AgentProcess:
        cmd = [
            sys.executable,
            str(HERE / "agent_process.py"),
            url or nats_server.url,
            json.dumps(manifest_data),
            "--delay-ms",
            str(delay_ms),
        ]
        if not_ready_file is not None:
            cmd += ["--not-ready-file", str(not_ready_file)]
        proc = subprocess.Popen(  # noqa: ASYNC220 - fork+exec, returns at once
            cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
        agent = AgentProcess(proc, manifest_data["agent_id"])
        started.append(agent)
        line = await _read_line(proc, 20)
        assert line.startswith(expect), f"agent process said {line!r}, expected {expect}"
        return agent

    yield spawn
    for agent in started:
        with contextlib.suppress(Exception):
            agent.stop()


@pytest.fixture(autouse=True)
def _collect_garbage_per_test() -> Iterator[None]:
    # Unclosed sockets warn when collected: collect now, so a leak is blamed on its own test.
    # What survives is frozen (moved where the collector no longer looks), so that each
    # test's collection walks the objects of that test, not of every test run before it.
    yield
    import gc

    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def _own_working_directory(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each test runs in an empty directory of its own: a ``.reach/dev.creds`` that
    ``reach up`` left in the checkout (or anywhere the run starts) is not found."""
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd", numbered=True))


@pytest.fixture(autouse=True)
def _audit_spool_per_test(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Audit writers (and agent processes the test starts) spool in a directory of the
    test's own: never in the user's, and never what another test's writers left."""
    root = tmp_path_factory.getbasetemp() / "audit-spool" / os.urandom(6).hex()
    monkeypatch.setenv("REACH_AUDIT_SPOOL", str(root))
