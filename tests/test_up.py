"""``reach up`` as a real process: embedded nats-server + registrar, clean stops, no orphans.

It supervises what it starts: a SIGKILLed nats-server is started again on its port and
store, and the registrar part (a child process, pid in ``<store>/registrar.pid``)
recovers without a restart; a SIGKILLed registrar part is started again within 2 s while
nats-server runs on. Clients log in, agents register and calls work again after each.
Options that contradict each other are refused before anything starts."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from reach.agent.agent import Agent
from reach.caller.client import ReachClient
from reach.errors import AuthenticationFailed, ConfigurationError, ReachError
from reach.fabric.embedded import free_port
from reach.security.membership import connect_as
from reach.testing import NatsServer
from reach.transport import Connection
from reach.wire import subjects

from .cli_helpers import CLEAN_ENV, REACH, reach_cli
from .conftest import manifest
from .poll_helpers import until
from .up_helpers import EXIT_TIMEOUT, READY_TIMEOUT, gone, nats_children, read_line, reap

#: an end-to-end run of whole programs: `make test-long` (CI runs it after `make test`)
pytestmark = pytest.mark.long

Spawn = Callable[..., "subprocess.Popen[bytes]"]


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


async def _registry_exists(url: str, creds: Path | None = None) -> bool:
    conn, _ = await connect_as([url], name="test-up", credentials=creds)
    try:
        await conn.key_value(subjects.REGISTRY_BUCKET, create=False)
    except ValueError:  # ConfigurationError: the bucket does not exist
        return False
    finally:
        await conn.close()
    return True


@pytest.fixture
def reach_up(tmp_path: Path) -> Iterator[Spawn]:
    """Start ``reach up ARGS`` in ``tmp_path``; whatever is left is killed at teardown."""
    procs: list[subprocess.Popen[bytes]] = []
    env = {k: v for k, v in os.environ.items() if k not in ("REACH_URL", "REACH_CREDS")}

    def spawn(*args: str, extra_env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            [str(REACH), "up", *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=tmp_path,
            env={**env, **(extra_env or {})},
        )
        procs.append(proc)
        return proc

    yield spawn
    for proc in procs:
        reap(proc)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_up_serves_nats_with_a_registry_and_stops_cleanly_on_a_signal(
    reach_up: Spawn, tmp_path: Path, sig: signal.Signals
) -> None:
    port = free_port()
    proc = reach_up("--port", str(port), "--store", "store")
    line = read_line(proc)
    url = f"nats://127.0.0.1:{port}"
    assert line.startswith(f"Agent-Reach up: {url} (store store, registrar reg-")
    (child,) = nats_children(proc.pid)
    assert (tmp_path / "store" / "nats" / "jetstream").is_dir()
    for name in ("dev.creds", "admin.creds"):
        assert (tmp_path / "store" / name).stat().st_mode & 0o777 == 0o600
    # no anonymous access; the dev credential logs in
    with pytest.raises(AuthenticationFailed, match="refused an anonymous client"):
        asyncio.run(_registry_exists(url))
    assert asyncio.run(_registry_exists(url, tmp_path / "store" / "dev.creds"))

    proc.send_signal(sig)
    out, err = proc.communicate(timeout=EXIT_TIMEOUT)
    assert proc.returncode == 0, err.decode()
    # nothing more than the URL line and the first-start credentials lines
    assert all(line.startswith(b"created credentials ") for line in out.splitlines())
    assert gone(child)
    assert _port_free(port)


def test_nats_server_and_registrar_die_with_a_killed_reach_up(
    reach_up: Spawn, tmp_path: Path
) -> None:
    port = free_port()
    proc = reach_up("--port", str(port), "--store", "store")
    read_line(proc)
    (child,) = nats_children(proc.pid)
    registrar = int((tmp_path / "store" / "registrar.pid").read_text())

    proc.kill()
    proc.wait(EXIT_TIMEOUT)
    asyncio.run(until(lambda: gone(child), "nats-server exit after reach up was killed"))
    asyncio.run(until(lambda: gone(registrar), "registrar exit after reach up was killed"))
    asyncio.run(until(lambda: _port_free(port), "port release"))


@pytest.mark.parametrize("how", ["--servers", "REACH_URL"])
def test_up_against_existing_nats_runs_only_the_registrar(
    reach_up: Spawn, nats_server: NatsServer, tmp_path: Path, how: str
) -> None:
    if how == "--servers":
        proc = reach_up("--servers", nats_server.url, "--store", "store")
    else:
        proc = reach_up("--store", "store", extra_env={"REACH_URL": nats_server.url})
    line = read_line(proc)
    assert line.startswith(f"Agent-Reach up: {nats_server.url} (external NATS, registrar reg-")
    assert nats_children(proc.pid) == []
    # no nats-server store: only the issuer's signing key and the first credentials
    assert not (tmp_path / "store" / "nats").exists()
    assert (tmp_path / "store" / "dev.creds").stat().st_mode & 0o777 == 0o600
    assert asyncio.run(_registry_exists(nats_server.url))

    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=EXIT_TIMEOUT)
    assert proc.returncode == 0, err.decode()
    assert nats_server.running


def test_up_gates_the_logins_of_servers_it_did_not_start(reach_up: Spawn, tmp_path: Path) -> None:
    """`reach nats-auth` writes the accounts and auth callout a server of your own
    includes; `reach up --servers URL --auth-callout` answers its logins: no anonymous
    access there either."""
    result = subprocess.run(
        [str(REACH), "nats-auth", "--store", "store"],
        cwd=tmp_path,
        capture_output=True,
        timeout=READY_TIMEOUT,
        check=False,
    )
    assert result.returncode == 0, result.stderr.decode()
    auth = tmp_path / "store" / "nats-auth.conf"
    assert auth.stat().st_mode & 0o777 == 0o600
    node = tmp_path / "store" / "node.conf"  # the server's own config, next to the file
    node.write_text('server_name: "mine"\ninclude "nats-auth.conf"\n')
    with NatsServer(store_dir=tmp_path / "js", config_file=node) as server:
        proc = reach_up("--servers", server.url, "--store", "store", "--auth-callout")
        line = read_line(proc)
        assert line.startswith(f"Agent-Reach up: {server.url} (external NATS, auth callout,")
        with pytest.raises(AuthenticationFailed, match="refused an anonymous client"):
            asyncio.run(_registry_exists(server.url))
        assert asyncio.run(_registry_exists(server.url, tmp_path / "store" / "dev.creds"))
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=EXIT_TIMEOUT)
        assert proc.returncode == 0, err.decode()


def test_a_gated_cluster_with_a_node_down_still_lets_clients_in(
    reach_up: Spawn, tmp_path: Path
) -> None:
    """Three nodes of your own that include `reach nats-auth`'s file, one of them down when
    `reach up --auth-callout` starts: the gate of the missing node answers from another, and
    a credential logs in on every live node (replicas 2: the two live nodes hold them)."""
    store = tmp_path / "store"
    result = subprocess.run(
        [str(REACH), "nats-auth", "--store", str(store)],
        capture_output=True,
        timeout=READY_TIMEOUT,
        check=False,
    )
    assert result.returncode == 0, result.stderr.decode()
    ports = [free_port() for _ in range(3)]
    routes = [free_port() for _ in range(3)]
    servers = []
    for i in range(3):
        others = ", ".join(f'"nats-route://127.0.0.1:{routes[j]}"' for j in range(3) if j != i)
        conf = store / f"node-{i}.conf"
        conf.write_text(
            f'server_name: "node-{i}"\n'
            f'cluster: {{ name: "mine", listen: "127.0.0.1:{routes[i]}", routes: [ {others} ] }}\n'
            'include "nats-auth.conf"\n'
        )
        servers.append(NatsServer(store_dir=tmp_path / f"js-{i}", config_file=conf, port=ports[i]))
    urls = [s.url for s in servers]
    try:
        for server in servers[:2]:  # the third never starts
            server.start_now()
        proc = reach_up(
            "--servers", ",".join(urls), "--store", "store", "--replicas", "2", "--auth-callout"
        )
        line = read_line(proc)
        assert "auth callout" in line
        for url in urls[:2]:
            with pytest.raises(AuthenticationFailed, match="refused an anonymous client"):
                asyncio.run(_registry_exists(url))
            assert asyncio.run(_registry_exists(url, store / "dev.creds"))
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=EXIT_TIMEOUT)
        assert proc.returncode == 0, err.decode()
        assert b"node down, answering from another" in err
    finally:
        for server in servers:
            server.stop_now()


def test_auth_callout_needs_the_secrets_nats_auth_wrote(
    reach_up: Spawn, nats_server: NatsServer
) -> None:
    proc = reach_up("--servers", nats_server.url, "--store", "elsewhere", "--auth-callout")
    _, err = proc.communicate(timeout=READY_TIMEOUT)
    assert proc.returncode != 0
    lines = err.decode().strip().splitlines()
    assert len(lines) == 1, lines
    assert "reach nats-auth --store elsewhere" in lines[0]


def test_busy_port_fails_with_a_one_line_reason_and_leaves_no_store(
    reach_up: Spawn, nats_server: NatsServer, tmp_path: Path
) -> None:
    proc = reach_up("--port", str(nats_server.port), "--store", "store")
    out, err = proc.communicate(timeout=READY_TIMEOUT)
    assert proc.returncode != 0
    assert out == b""
    lines = err.decode().strip().splitlines()
    assert len(lines) == 1, lines
    assert str(nats_server.port) in lines[0]
    assert "in use" in lines[0]
    assert not (tmp_path / "store").exists()  # the next try starts as a first one would
    # a store that was there before stays, whatever failed
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "mine").write_text("x")
    proc = reach_up("--port", str(nats_server.port), "--store", "kept")
    proc.communicate(timeout=READY_TIMEOUT)
    assert proc.returncode != 0
    assert (tmp_path / "kept" / "mine").read_text() == "x"


def test_replicas_need_an_external_cluster(reach_up: Spawn) -> None:
    proc = reach_up("--port", str(free_port()), "--replicas", "3")
    _, err = proc.communicate(timeout=READY_TIMEOUT)
    assert proc.returncode == 2
    assert len(err.decode().strip().splitlines()) == 1
    assert "--servers" in err.decode()


def test_python_dash_m_reach_runs_the_cli() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "reach", "up", "--help"],
        capture_output=True,
        timeout=READY_TIMEOUT,
        check=False,
    )
    assert result.returncode == 0, result.stderr.decode()
    assert b"--port" in result.stdout


#: a registrar part killed is running again (a new pid) within this
REGISTRAR_RESTART = 2.0
#: logins, a registration and a call work again within this (a Python start, a reconnect)
RECOVERY = 30.0


def _registrar_pid(store: Path) -> int:
    return int((store / "registrar.pid").read_text())


def _alive(pid: int) -> bool:
    return not gone(pid)


async def _login_when_back(url: str, creds: Path) -> None:
    """Log in and reach the registrar as soon as the registrar part answers again (it may
    be starting: the login gate first, the registrar last)."""
    deadline = asyncio.get_running_loop().time() + RECOVERY
    while True:
        try:
            conn, _ = await connect_as([url], name="test-login", credentials=creds)
            try:
                await conn.request(subjects.REGISTRAR_PING, b"", timeout=1.0)
            finally:
                await conn.close()
        except (AuthenticationFailed, ReachError):
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.2)  # the gate is another process: no event to wait for
            continue
        return


async def _register_and_call(url: str, creds: Path, agent_id: str) -> None:
    """A new agent registers and a new client calls it."""
    await _login_when_back(url, creds)
    agent = Agent(
        manifest(agent_id, "work", interval=1.0, timeout=0.5), servers=[url], credentials=creds
    )

    @agent.capability("work")
    async def work(request: Any) -> Any:
        return {"by": agent_id}

    client = ReachClient(servers=[url], credentials=creds)
    try:
        await asyncio.wait_for(agent.start(), RECOVERY)
        await asyncio.wait_for(client.connect(), RECOVERY)
        await client.routes.wait_for(lambda c: bool(c.find("work")), timeout=RECOVERY)
        assert (await client.call("work", {})).value == {"by": agent_id}
    finally:
        await client.close()
        await agent.stop()


def _stop(proc: subprocess.Popen[bytes]) -> str:
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=EXIT_TIMEOUT)
    assert proc.returncode == 0, err.decode()
    return err.decode()


def _single_up(reach_up: Spawn, tmp_path: Path) -> tuple[subprocess.Popen[bytes], Path, str]:
    """A single-node ``reach up`` on a free port with store ``store``, once it is up:
    the process, the store and the URL."""
    port = free_port()
    url = f"nats://127.0.0.1:{port}"
    proc = reach_up("--port", str(port), "--store", "store")
    line = read_line(proc)
    assert line.startswith(f"Agent-Reach up: {url} (store store, registrar reg-")
    return proc, tmp_path / "store", url


@pytest.mark.slow
def test_a_killed_nats_server_is_started_again_and_the_registrar_recovers(
    reach_up: Spawn, tmp_path: Path
) -> None:
    proc, store, url = _single_up(reach_up, tmp_path)
    (server,) = nats_children(proc.pid)
    registrar = _registrar_pid(store)

    os.kill(server, signal.SIGKILL)
    asyncio.run(
        until(
            lambda: [p for p in nats_children(proc.pid) if p != server],
            "a new nats-server",
            timeout=EXIT_TIMEOUT,
            interval=0.02,  # reads all of /proc
        )
    )
    asyncio.run(_register_and_call(url, store / "dev.creds", "after-server"))
    # the registrar part came through the restart: same process
    assert _registrar_pid(store) == registrar
    assert _alive(registrar)

    err = _stop(proc)
    assert err.count("nats-server exited unexpectedly; starting it again") == 1, err
    assert "see store/nats/nats-server.log" in err
    assert gone(registrar)


@pytest.mark.slow
def test_a_killed_registrar_is_started_again_and_nats_server_runs_on(
    reach_up: Spawn, tmp_path: Path
) -> None:
    proc, store, url = _single_up(reach_up, tmp_path)
    (server,) = nats_children(proc.pid)
    registrar = _registrar_pid(store)

    os.kill(registrar, signal.SIGKILL)
    killed = time.monotonic()

    def replaced() -> bool:
        try:
            pid = _registrar_pid(store)
        except (FileNotFoundError, ValueError):
            return False
        return pid != registrar and _alive(pid)

    asyncio.run(until(replaced, "a new registrar part", timeout=REGISTRAR_RESTART))
    assert time.monotonic() - killed <= REGISTRAR_RESTART
    assert nats_children(proc.pid) == [server]
    asyncio.run(_register_and_call(url, store / "dev.creds", "after-registrar"))
    assert nats_children(proc.pid) == [server]

    again = _registrar_pid(store)
    err = _stop(proc)
    assert err.count("registrar exited unexpectedly; starting it again") == 1, err
    assert gone(again)
    assert gone(server)


# -- --port with a NATS to use ---------------------------------------------------------


def _listening(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(1.0)
        return sock.connect_ex(("127.0.0.1", port)) == 0


async def _has_registry(conn: Connection) -> bool:
    with contextlib.suppress(ConfigurationError):
        await conn.key_value(subjects.REGISTRY_BUCKET, create=False)
        return True
    return False


@pytest.mark.parametrize("how", ["REACH_URL", "--servers"])
async def test_up_with_a_port_and_a_nats_to_use_is_refused_before_starting_anything(
    nats_server: NatsServer, conn: Connection, tmp_path: Path, how: str
) -> None:
    port = free_port()
    args = ["up", "--port", str(port), "--store", str(tmp_path / "store")]
    env = dict(CLEAN_ENV)
    if how == "REACH_URL":
        env["REACH_URL"] = nats_server.url
    else:
        args += ["--servers", nats_server.url]
    code, _, err = await reach_cli(*args, env=env, cwd=tmp_path, timeout=20)
    assert code == 2, err
    assert "--port" in err
    assert how in err
    assert err.strip().count("\n") == 0
    # nothing started: no registrar on the NATS named, no NATS on the port, no store
    assert not await _has_registry(conn)
    assert not _listening(port)
    assert not (tmp_path / "store").exists()
