"""``reach up``: a local NATS (embedded nats-server with JetStream) plus a registrar.

With ``--servers URL`` (or ``REACH_URL``) it runs only the registrar part (token issuer,
login gates with ``--auth-callout``, registrar) against that NATS, in this process.
Otherwise it starts a nats-server (``--cluster N``: N of them on loopback that form one
JetStream cluster, the registry, credentials, keys and audit streams at 3 replicas,
fsync on every write) and runs the registrar part as a child process, ``reach up
--servers … --auth-callout``, whose pid is in ``<store>/registrar.pid``; a login gate
answers on every node. ``reach.supervisor`` keeps these children running: a
nats-server or registrar part that dies is started again (same port and store).
It runs until SIGINT/SIGTERM, then stops the registrar part and the servers in that
order; a second signal stops at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import sys
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path

import click
from click.core import ParameterSource

from reach.audit.reader import parse_duration
from reach.audit.streams import StreamSettings
from reach.cli.common import Target, connection_options, fail, run, store_option
from reach.embedded import EmbeddedServer, free_port, private_dir
from reach.errors import ConfigurationError, Disconnected, ReachError
from reach.registry import Registrar, RegistrarConfig
from reach.runtime import tune_gc
from reach.security import natsconf
from reach.security.credentials import CredentialStore
from reach.security.gate import LoginGate
from reach.security.issuer import TokenService, ensure_first_credentials
from reach.supervisor import ServerChild, ServiceProcess, Supervisor, server_failure
from reach.transport import Connection, connect

__all__ = ["register"]

log = logging.getLogger("reach.cli.up")

_HOST = "127.0.0.1"
_STOP_TIMEOUT = 10.0
#: how often the registrar part checks its connections
_WATCH_INTERVAL = 0.25
#: where the pid of the registrar part (a child of ``reach up``) is, in the store
REGISTRAR_PID_FILE = "registrar.pid"
#: how long a new cluster may take to elect its JetStream meta leader
_CLUSTER_READY_TIMEOUT = 30.0
#: replicas of the registry and streams on a local cluster (and the fewest nodes for them)
_CLUSTER_REPLICAS = 3


@dataclass(frozen=True)
class UpOptions:
    port: int
    store: Path
    replicas: int
    #: None: start an embedded nats-server; otherwise run only the registrar against these
    servers: list[str] | None
    #: how long REACH_AUDIT keeps events, seconds
    audit_max_age: float = 7 * 24 * 3600.0
    #: nats-servers to start (1: one server; 3 or more: a JetStream cluster)
    cluster: int = 1
    #: with ``servers``: they include ``reach nats-auth``'s file for this store; log in as
    #: the registrar's service user and answer their logins
    auth_callout: bool = False
    #: the registrar part run by a ``reach up`` that supervises it: its ready line is JSON
    supervised: bool = False


def register(main: click.Group) -> None:
    main.add_command(up)


@click.command("up")
@click.option(
    "--port",
    type=click.IntRange(1, 65535),
    default=4222,
    show_default=True,
    help="client port of the embedded nats-server (on 127.0.0.1)",
)
@store_option("directory for the JetStream store and the server log")
@click.option(
    "--replicas",
    type=click.IntRange(1, 5),
    default=1,
    show_default=True,
    help="KV and stream replicas (3 on a NATS cluster; needs --servers or --cluster)",
)
@click.option(
    "--cluster",
    type=click.IntRange(1, 7),
    default=1,
    show_default=True,
    help="start this many nats-servers as one JetStream cluster (3 or more; ports from --port)",
)
@click.option(
    "--audit-max-age",
    default="7d",
    show_default=True,
    help="how long the audit stream keeps events (30m, 12h, 7d)",
)
@click.option(
    "--auth-callout",
    is_flag=True,
    help=(
        "with --servers: the servers include the file `reach nats-auth --store STORE` wrote;"
        " log in as its service user and answer their clients' logins"
    ),
)
@click.option("--supervised", is_flag=True, hidden=True)
@connection_options
def up(
    target: Target,
    port: int,
    store: Path,
    replicas: int,
    audit_max_age: str,
    cluster: int,
    auth_callout: bool,
    supervised: bool,
) -> None:
    """Start NATS with JetStream and a registrar, and run until interrupted."""
    ctx = click.get_current_context()
    # An explicit --servers or REACH_URL means "use that NATS"; the default means "start one".
    explicit = ctx.params.get("servers") is not None or bool(os.environ.get("REACH_URL"))
    if cluster > 1:
        if explicit:
            fail("--cluster starts its own NATS: drop --servers (and REACH_URL)", code=2)
        if cluster < _CLUSTER_REPLICAS:
            fail(f"--cluster needs at least {_CLUSTER_REPLICAS} nodes (got {cluster})", code=2)
        if ctx.get_parameter_source("replicas") == ParameterSource.DEFAULT:
            replicas = _CLUSTER_REPLICAS
        elif replicas > cluster:
            fail(f"--replicas {replicas} needs at least {replicas} nodes (--cluster)", code=2)
    elif explicit and ctx.get_parameter_source("port") != ParameterSource.DEFAULT:
        given = ctx.params.get("servers") is not None
        where, hint = ("--servers", "") if given else ("REACH_URL", " (unset it to start one)")
        fail(
            f"--port starts a NATS of its own, {where} names one to use: drop one of them{hint}",
            code=2,
        )
    elif not explicit and replicas > 1:
        fail(f"--replicas {replicas} needs a NATS cluster: pass its URL with --servers", code=2)
    if auth_callout and not explicit:
        fail(
            "--auth-callout is for servers reach up does not start (--servers); the ones it"
            " starts always have it",
            code=2,
        )
    try:
        max_age = parse_duration(audit_max_age)
    except ConfigurationError as exc:
        fail(f"--audit-max-age: {exc}", code=2)
    options = UpOptions(
        port=port,
        store=store,
        replicas=replicas,
        servers=target.servers if explicit else None,
        audit_max_age=max_age,
        cluster=cluster,
        auth_callout=auth_callout,
        supervised=supervised,
    )
    error = run(_up(options))
    if error:
        fail(error)


async def _up(options: UpOptions) -> str | None:
    """Run until a signal; a one-line reason if it could not start or cannot go on."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    children: list[ServerChild | ServiceProcess] = []

    def on_signal() -> None:
        if stop.is_set():  # a second signal: the user does not want to wait for a clean stop
            for child in children:
                if isinstance(child, ServerChild):
                    child.server.kill()
                else:
                    child.kill()
            os._exit(130)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    try:
        # the store holds secrets, the JetStream data and the server logs: owner only
        private_dir(options.store)
        if options.servers is None:
            return await _supervise(options, stop, children)
        return await _serve(options, options.servers, stop)
    finally:
        # the registrar part first (it writes to NATS as it stops), then the servers
        for child in reversed(children):
            if isinstance(child, ServiceProcess):
                await _quietly(child.stop(), "stop the registrar")
        servers = [child.server for child in children if isinstance(child, ServerChild)]
        if servers:
            await _quietly(_stop_all(servers), "stop nats-server")
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


async def _supervise(
    options: UpOptions, stop: asyncio.Event, children: list[ServerChild | ServiceProcess]
) -> str | None:
    """Start nats-servers and the registrar part as children; keep them running."""
    if _port_in_use(_HOST, options.port):
        return (
            f"port {options.port} on {_HOST} is already in use"
            " (another reach up or nats-server?); choose another with --port"
        )
    # no anonymous access: every client logs in with its id and secret (auth callout)
    setup = natsconf.prepare(options.store)
    if options.cluster > 1:
        nodes = _cluster_nodes(options, setup)
    else:
        config = natsconf.write_config(
            setup, options.store / "nats.conf", port=options.port, store_dir=None, host=_HOST
        )
        nodes = [
            EmbeddedServer(
                port=options.port,
                store_dir=options.store / "nats",
                host=_HOST,
                config_file=config,
                log_size_limit=natsconf.LOG_SIZE_LIMIT,
            )
        ]
    children.extend(ServerChild(node) for node in nodes)
    # all at once: a cluster node's JetStream waits for the others
    started = await asyncio.gather(*(n.start() for n in nodes), return_exceptions=True)
    for node, outcome in zip(nodes, started, strict=True):
        if isinstance(outcome, Disconnected):
            return f"nats-server did not start: {server_failure(node, outcome)}"
        if isinstance(outcome, BaseException):
            raise outcome
    servers = [node.url for node in nodes]
    registrar = ServiceProcess(
        _registrar_command(options, servers),
        label="registrar",
        pid_file=options.store / REGISTRAR_PID_FILE,
    )
    children.append(registrar)
    try:
        await registrar.start()
        ready = json.loads(registrar.ready_line)
    except (ReachError, ValueError) as exc:
        return f"the registrar did not start: {exc}"
    if len(nodes) > 1:
        where = f"cluster {natsconf.CLUSTER_NAME} of {len(nodes)}, store {options.store}"
    else:
        where = f"store {options.store}"
    click.echo(f"Agent-Reach up: {','.join(servers)} ({where}, registrar {ready['registrar']})")
    for path in ready["created"]:
        click.echo(f"created credentials {path} (mode 0600)")
    supervisor = Supervisor(children, report=lambda line: click.echo(line, err=True))
    return await supervisor.run(stop)


def _registrar_command(options: UpOptions, servers: list[str]) -> list[str]:
    """``reach up --servers … --auth-callout`` for the registrar part of this ``reach up``."""
    return [
        sys.executable,
        "-m",
        "reach",
        "up",
        "--servers",
        ",".join(servers),
        "--store",
        str(options.store),
        "--auth-callout",
        "--replicas",
        str(options.replicas),
        "--audit-max-age",
        f"{options.audit_max_age:g}s",
        "--supervised",
    ]


async def _serve(options: UpOptions, servers: list[str], stop: asyncio.Event) -> str | None:
    """The registrar part against ``servers``: token issuer, login gates (with
    ``--auth-callout``) and registrar, until ``stop`` or a connection closed for good."""
    setup: natsconf.SecureSetup | None = None
    if options.auth_callout:
        try:
            setup = natsconf.prepare(options.store, create=False)
        except FileNotFoundError as exc:
            return (
                f"--auth-callout: {exc}; run `reach nats-auth --store {options.store}`"
                " and include its file in each nats-server's config"
            )
    conn: Connection | None = None
    registrar: Registrar | None = None
    issuer: TokenService | None = None
    gates: list[LoginGate] = []
    try:
        service = setup.registrar_user if setup is not None else None
        conn = await connect(
            servers,
            name="reach-up",
            user=service.name if service else None,
            password=service.password if service else None,
        )
        if len(servers) > 1 or options.replicas > 1:
            await _cluster_ready(conn, options.replicas)
        issuer = TokenService(
            conn, key_file=options.store / "signing.key", replicas=options.replicas
        )
        await issuer.start()
        created = await ensure_first_credentials(issuer, options.store, ",".join(servers))
        if setup is not None:
            assert issuer.credentials is not None
            gates = await _start_gates(setup, issuer.credentials, servers)
        tune_gc()  # the registrar replaces a record per heartbeat (reach.runtime)
        registrar = Registrar(
            conn,
            RegistrarConfig(
                replicas=options.replicas,
                streams=StreamSettings(audit_max_age=options.audit_max_age),
            ),
        )
        await registrar.start()
        if options.supervised:
            ready = {"registrar": registrar.registrar_id, "created": [str(p) for p in created]}
            click.echo(json.dumps(ready))
        else:
            where = "external NATS" + (", auth callout" if options.auth_callout else "")
            shown = conn.connected_url
            click.echo(f"Agent-Reach up: {shown} ({where}, registrar {registrar.registrar_id})")
            for path in created:
                click.echo(f"created credentials {path} (mode 0600)")
        return await _until_stopped_or_closed(stop, [conn, *(g.connection for g in gates)])
    finally:
        if registrar is not None:
            await _quietly(registrar.stop(), "stop the registrar")
        for gate in gates:
            await _quietly(gate.stop(), "stop the login gate")
        if issuer is not None:
            await _quietly(issuer.stop(), "stop the token issuer")
        if conn is not None:
            await _quietly(conn.close(), "close the connection")


async def _start_gates(
    setup: natsconf.SecureSetup, credentials: CredentialStore, servers: list[str]
) -> list[LoginGate]:
    """A gate on every node: each answers the logins of its own node, so logging in does
    not depend on one node (the callout requests would cross the routes)."""
    gates: list[LoginGate] = []
    try:
        for url in servers:
            gate = LoginGate(setup, credentials)
            gates.append(gate)
            try:
                await gate.start([url])
            except Disconnected:
                if len(servers) == 1:
                    raise
                # its node is down: the gate answers from another (the requests cross
                # the routes), so a cluster with a node down still lets clients in
                log.warning("login gate for %s: node down, answering from another", url)
                await gate.start(servers)
    except BaseException:
        for gate in gates:
            await _quietly(gate.stop(), "stop the login gate")
        raise
    return gates


async def _until_stopped_or_closed(
    stop: asyncio.Event, connections: list[Connection | None]
) -> str | None:
    """Wait for ``stop``; a connection closed for good (it no longer reconnects) ends the
    wait with the reason, so that whoever supervises this process starts it again."""
    stopped = asyncio.create_task(stop.wait())
    try:
        while not stopped.done():
            if any(c is not None and c.is_closed for c in connections):
                return "a connection to NATS was closed for good; the registrar part exits"
            await asyncio.wait({stopped}, timeout=_WATCH_INTERVAL)
        return None
    finally:
        stopped.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await stopped


def _cluster_nodes(options: UpOptions, setup: natsconf.SecureSetup) -> list[EmbeddedServer]:
    """The nodes of a local cluster: client ports from ``--port`` on (a busy one is swapped
    for a free one), free route ports, a config and a store directory each."""
    taken: set[int] = set()
    ports = [_port_or_free(options.port + i, taken) for i in range(options.cluster)]
    routes = [_port_or_free(None, taken) for _ in range(options.cluster)]
    members = [
        natsconf.ClusterNode(f"{natsconf.CLUSTER_NAME}-{i}", _HOST, port, route)
        for i, (port, route) in enumerate(zip(ports, routes, strict=True), start=1)
    ]
    password = natsconf.route_user(options.store).password
    nodes = []
    for i, member in enumerate(members):
        directory = f"nats-{i + 1}"
        config = natsconf.write_config(
            setup,
            options.store / f"{directory}.conf",
            port=member.port,
            store_dir=None,
            host=_HOST,
            server_name=member.name,
            cluster=natsconf.ClusterPeers.of(members, i, password),
            sync_always=True,
        )
        nodes.append(
            EmbeddedServer(
                port=member.port,
                store_dir=options.store / directory,
                host=_HOST,
                config_file=config,
                name=member.name,
                log_size_limit=natsconf.LOG_SIZE_LIMIT,
            )
        )
    return nodes


def _port_or_free(port: int | None, taken: set[int]) -> int:
    """``port`` if it is free and not ``taken``, else a free port; recorded in ``taken``."""
    if port is None or port > 65535 or port in taken or _port_in_use(_HOST, port):
        port = free_port()
        while port in taken:
            port = free_port()
    taken.add(port)
    return port


async def _cluster_ready(conn: Connection, replicas: int) -> None:
    """Wait until the cluster can place ``replicas`` copies of a stream.

    A JetStream meta leader answers the account info before every node has joined the meta
    group, and a stream of 3 replicas created then fails with "no suitable peers for
    placement": so a small stream of ``replicas`` replicas is created (in memory) and
    deleted again, until that works.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + _CLUSTER_READY_TIMEOUT
    probe = f"REACH_PLACEMENT_PROBE_{os.getpid()}"
    config = json.dumps({"name": probe, "storage": "memory", "num_replicas": replicas}).encode()
    last = "no answer"
    while loop.time() < deadline:
        try:
            info = json.loads(await conn.request("$JS.API.INFO", b"", timeout=2.0))
            if "error" not in info:
                placed = json.loads(
                    await conn.request(f"$JS.API.STREAM.CREATE.{probe}", config, timeout=5.0)
                )
                if "error" not in placed:
                    await conn.request(f"$JS.API.STREAM.DELETE.{probe}", b"", timeout=5.0)
                    return
                info = placed
            last = str(info["error"].get("description", info["error"]))
        except (ReachError, ValueError) as exc:
            last = str(exc) or type(exc).__name__
        await asyncio.sleep(0.1)  # polling the server: no event to wait for
    raise Disconnected(
        f"the cluster cannot place {replicas} replicas after {_CLUSTER_READY_TIMEOUT:g}s: {last}"
    )


async def _stop_all(nodes: list[EmbeddedServer]) -> None:
    await asyncio.gather(*(node.stop() for node in nodes))


async def _quietly(step: Awaitable[None], what: str) -> None:
    """Shut one part down within a bound; a failure must not keep the others running."""
    try:
        await asyncio.wait_for(step, _STOP_TIMEOUT)
    except Exception as exc:
        log.warning("could not %s: %s", what, exc or type(exc).__name__)


def _port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # SO_REUSEADDR: a port with only TIME_WAIT connections left is free for nats-server too
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False
