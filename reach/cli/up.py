"""``reach up``: a local NATS (embedded nats-server with JetStream) plus a registrar.

The fabric is a ``reach.fabric.Fabric``. With ``--servers URL`` (or ``REACH_URL``) it
runs only the registrar part (token issuer, login gates with ``--auth-callout``,
registrar) against that NATS, in this process, and exits when a connection of it is
closed for good, so that whoever runs it starts it again. Otherwise it starts a
nats-server (``--cluster N``: N of them on loopback that form one JetStream cluster, the
registry, credentials, keys and audit streams at 3 replicas, fsync on every write) and
runs the registrar part as a child process, ``reach up --servers … --auth-callout
--supervised``, whose pid is in ``<store>/registrar.pid``; a login gate answers on every
node. The fabric keeps these children running (``reach.fabric.supervisor``): a nats-server or
registrar part that dies is started again (same port and store), and so is a nats-server
whose JetStream store takes no writes (a full disk) once its disk has room again; what
happens to the store is printed on stderr as it changes.
It runs until SIGINT/SIGTERM, then stops the registrar part and the servers in that
order; a second signal stops at once.
"""

from __future__ import annotations

import json
import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import click
from click.core import ParameterSource

from reach.cli.common import Target, connection_options, fail, run, store_option
from reach.errors import ConfigurationError, ReachError
from reach.runtime import tune_gc

if TYPE_CHECKING:
    import asyncio

    from reach.fabric import Fabric

__all__ = ["register"]


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


@click.command("up", short_help="Start a local fabric and run until Ctrl-C.")
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
    """Start NATS with JetStream and a registrar, and run until interrupted (what dies,
    and a nats-server whose store's disk filled once it has room, is started again)."""
    from reach.audit.reader import parse_duration

    ctx = click.get_current_context()
    # An explicit --servers or REACH_URL means "use that NATS"; the default means "start one".
    explicit = ctx.params.get("servers") is not None or bool(os.environ.get("REACH_URL"))
    replicas = _checked_replicas(ctx, explicit, cluster, replicas)
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


def _checked_replicas(ctx: click.Context, explicit: bool, cluster: int, replicas: int) -> int:
    """The replicas to use; exit code 2 with the reason when the options disagree."""
    from reach.fabric.root import CLUSTER_MIN

    if cluster > 1:
        if explicit:
            fail("--cluster starts its own NATS: drop --servers (and REACH_URL)", code=2)
        if cluster < CLUSTER_MIN:
            fail(f"--cluster needs at least {CLUSTER_MIN} nodes (got {cluster})", code=2)
        if ctx.get_parameter_source("replicas") == ParameterSource.DEFAULT:
            return CLUSTER_MIN
        if replicas > cluster:
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
    return replicas


async def _up(options: UpOptions) -> str | None:
    """Run until a signal; a one-line reason if it could not start or cannot go on."""
    import asyncio

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    fabric = _fabric(options)

    def on_signal() -> None:
        if stop.is_set():  # a second signal: the user does not want to wait for a clean stop
            fabric.kill()
            os._exit(130)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    try:
        if options.servers is not None:
            tune_gc()  # the registrar replaces a record per heartbeat (reach.runtime)
        try:
            await fabric.start()
        except ReachError as exc:
            return str(exc)
        try:
            _announce(fabric, options)
            return await _until_stopped_or_ended(stop, fabric)
        finally:
            await fabric.stop()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def _fabric(options: UpOptions) -> Fabric:
    """Servers of its own with the registrar part as a supervised child process, or the
    registrar part alone against ``--servers``, in this process (whoever runs this
    process starts it again if it exits)."""
    from reach.fabric import Fabric

    if options.servers is None:
        return Fabric(
            options.store,
            port=options.port,
            cluster=options.cluster,
            replicas=options.replicas,
            audit_max_age=options.audit_max_age,
            registrar_part="child-process",
            report=lambda line: click.echo(line, err=True),
        )
    return Fabric(
        options.store,
        servers=options.servers,
        logins=options.auth_callout,
        replicas=options.replicas,
        audit_max_age=options.audit_max_age,
        supervise=False,
    )


def _announce(fabric: Fabric, options: UpOptions) -> None:
    """The ready line (JSON for the ``reach up`` that supervises this one) and the
    credentials files created."""
    from reach.security import natsconf

    if options.supervised:
        created = [str(p) for p in fabric.created]
        click.echo(json.dumps({"registrar": fabric.registrar_id, "created": created}))
        return
    if options.servers is not None:
        where = "external NATS" + (", auth callout" if options.auth_callout else "")
        conn = fabric.services.conn if fabric.services is not None else None
        shown = conn.connected_url if conn is not None else fabric.url
    elif len(fabric.nodes) > 1:
        where = f"cluster {natsconf.CLUSTER_NAME} of {len(fabric.nodes)}, store {options.store}"
        shown = fabric.url
    else:
        where, shown = f"store {options.store}", fabric.url
    click.echo(f"Agent-Reach up: {shown} ({where}, registrar {fabric.registrar_id})")
    for path in fabric.created:
        click.echo(f"created credentials {path} (mode 0600)")


async def _until_stopped_or_ended(stop: asyncio.Event, fabric: Fabric) -> str | None:
    """Wait for ``stop`` (None) or for the fabric to end on its own (the reason)."""
    import asyncio

    from reach.tasks import cancel_and_wait

    stopped = asyncio.create_task(stop.wait())
    ended = asyncio.create_task(fabric.wait())
    try:
        await asyncio.wait({stopped, ended}, return_when=asyncio.FIRST_COMPLETED)
        return None if stopped.done() else ended.result()
    finally:
        await cancel_and_wait([stopped, ended])
