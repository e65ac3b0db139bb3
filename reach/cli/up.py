"""``reach up``: a local NATS (embedded nats-server with JetStream) plus a registrar.

With ``--servers URL`` (or ``REACH_URL``) it runs only the registrar against that NATS.
It runs until SIGINT/SIGTERM, then stops the registrar, the connection and the server
in that order; a second signal stops at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path

import click

from reach.audit.reader import parse_duration
from reach.audit.streams import StreamSettings
from reach.cli.common import Target, connection_options, fail, run
from reach.embedded import EmbeddedServer
from reach.errors import ConfigurationError, Disconnected
from reach.registry import Registrar, RegistrarConfig
from reach.security import natsconf
from reach.security.gate import LoginGate
from reach.security.issuer import TokenService, ensure_first_credentials
from reach.settings import DEFAULT_STORE
from reach.transport import Connection, connect

__all__ = ["register"]

log = logging.getLogger("reach.cli.up")

_HOST = "127.0.0.1"
_STOP_TIMEOUT = 10.0
#: how often the embedded server is checked for an unexpected exit
_WATCH_INTERVAL = 0.25


@dataclass(frozen=True)
class UpOptions:
    port: int
    store: Path
    replicas: int
    #: None: start an embedded nats-server; otherwise run only the registrar against these
    servers: list[str] | None
    #: how long REACH_AUDIT keeps events, seconds
    audit_max_age: float = 7 * 24 * 3600.0


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
@click.option(
    "--store",
    type=click.Path(file_okay=False, path_type=Path),
    default=DEFAULT_STORE,
    show_default=True,
    help="directory for the JetStream store and the server log",
)
@click.option(
    "--replicas",
    type=click.IntRange(1, 5),
    default=1,
    show_default=True,
    help="KV replicas (3 on a NATS cluster; needs --servers)",
)
@click.option(
    "--audit-max-age",
    default="7d",
    show_default=True,
    help="how long the audit stream keeps events (30m, 12h, 7d)",
)
@connection_options
def up(target: Target, port: int, store: Path, replicas: int, audit_max_age: str) -> None:
    """Start NATS with JetStream and a registrar, and run until interrupted."""
    # An explicit --servers or REACH_URL means "use that NATS"; the default means "start one".
    explicit = click.get_current_context().params.get("servers") is not None or bool(
        os.environ.get("REACH_URL")
    )
    if not explicit and replicas > 1:
        fail(f"--replicas {replicas} needs a NATS cluster: pass its URL with --servers", code=2)
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
    )
    error = run(_up(options))
    if error:
        fail(error)


async def _up(options: UpOptions) -> str | None:
    """Run until a signal; a one-line reason if it could not start or the server died."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    server: EmbeddedServer | None = None

    def on_signal() -> None:
        if stop.is_set():  # a second signal: the user does not want to wait for a clean stop
            if server is not None:
                server.kill()
            os._exit(130)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    conn: Connection | None = None
    registrar: Registrar | None = None
    issuer: TokenService | None = None
    gate: LoginGate | None = None
    setup: natsconf.SecureSetup | None = None
    try:
        if options.servers is None:
            if _port_in_use(_HOST, options.port):
                return (
                    f"port {options.port} on {_HOST} is already in use"
                    " (another reach up or nats-server?); choose another with --port"
                )
            # no anonymous access: every client logs in with its id and secret (auth callout)
            setup = natsconf.prepare(options.store)
            config = natsconf.write_config(
                setup, options.store / "nats.conf", port=options.port, store_dir=None, host=_HOST
            )
            server = EmbeddedServer(
                port=options.port,
                store_dir=options.store / "nats",
                host=_HOST,
                config_file=config,
            )
            try:
                await server.start()
            except Disconnected as exc:
                return f"nats-server did not start: {_server_failure(server, exc)}"
            servers = [server.url]
        else:
            servers = options.servers
        service = setup.registrar_user if setup is not None else None
        conn = await connect(
            servers,
            name="reach-up",
            user=service.name if service else None,
            password=service.password if service else None,
        )
        issuer = TokenService(
            conn, key_file=options.store / "signing.key", replicas=options.replicas
        )
        await issuer.start()
        created = await ensure_first_credentials(issuer, options.store, servers[0])
        if setup is not None:
            assert issuer.credentials is not None
            gate = LoginGate(setup, issuer.credentials)
            await gate.start(servers)
        registrar = Registrar(
            conn,
            RegistrarConfig(
                replicas=options.replicas,
                streams=StreamSettings(audit_max_age=options.audit_max_age),
            ),
        )
        await registrar.start()
        where = f"store {options.store}" if server is not None else "external NATS"
        click.echo(
            f"Agent-Reach up: {server.url if server else conn.connected_url}"
            f" ({where}, registrar {registrar.registrar_id})"
        )
        for path in created:
            click.echo(f"created credentials {path} (mode 0600)")
        if server is None:
            await stop.wait()
            return None
        return await _until_stopped_or_dead(stop, server)
    finally:
        if registrar is not None:
            await _quietly(registrar.stop(), "stop the registrar")
        if gate is not None:
            await _quietly(gate.stop(), "stop the login gate")
        if issuer is not None:
            await _quietly(issuer.stop(), "stop the token issuer")
        if conn is not None:
            await _quietly(conn.close(), "close the connection")
        if server is not None:
            await _quietly(server.stop(), "stop nats-server")
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


async def _until_stopped_or_dead(stop: asyncio.Event, server: EmbeddedServer) -> str | None:
    stopped = asyncio.create_task(stop.wait())
    try:
        while not stopped.done():
            if not server.running:
                return f"nats-server exited unexpectedly; see {server.log_file}"
            await asyncio.wait({stopped}, timeout=_WATCH_INTERVAL)
        return None
    finally:
        stopped.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await stopped


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


def _server_failure(server: EmbeddedServer, exc: Exception) -> str:
    """The server's own fatal/error line from its log when there is one, else ``exc``."""
    try:
        lines = server.log_file.read_text(errors="replace").splitlines()
    except OSError:
        return str(exc)
    for line in reversed(lines):
        for mark in ("[FTL]", "[ERR]"):
            if mark in line:
                return f"{line.split(mark, 1)[1].strip()} (see {server.log_file})"
    return str(exc)
