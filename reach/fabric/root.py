"""``Fabric``: the one way to start an Agent-Reach fabric, as a library.

``reach up``, ``reach demo``, the benchmarks and the test fixtures all start their
fabrics here. A fabric is nats-servers (started here: one, or a JetStream cluster of
N on loopback; or given: ``servers=``) and its registrar part (token issuer, login gates,
registrar: ``reach.fabric.services``), run in this process, in a child process, or not
at all. Everything it started is kept running (``reach.fabric.supervisor``: a nats-server or
registrar part that dies is started again, and so is a nats-server whose JetStream store
failed on a full disk, once the disk has room: ``reach.fabric.storewatch``) and stopped
in order: the registrar part first, then the servers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import shutil
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from reach.errors import ConfigurationError, ReachError
from reach.fabric.embedded import EmbeddedServer, private_dir
from reach.fabric.storewatch import Checkup, HealthPoll, StoreGuard
from reach.fabric.supervisor import Child, ServerChild, ServiceProcess, Supervisor
from reach.registry import Registrar, RegistrarConfig
from reach.security.credentials import CredentialsFile, CredentialStore
from reach.security.membership import connect_as
from reach.tasks import cancel_and_wait

if TYPE_CHECKING:
    # imported when a fabric starts: ``import reach`` stays without the login gate's
    # and the server config's modules
    from reach.fabric.services import FabricServices

__all__ = ["Fabric", "RegistrarPart"]

log = logging.getLogger("reach.fabric")

#: where the registrar part runs: in this process, as a supervised child process
#: (``reach up --servers … --supervised``, its pid in ``<store>/registrar.pid``), or
#: nowhere (the servers alone, for a registrar part run elsewhere)
RegistrarPart = Literal["in-process", "child-process", "none"]

#: where the pid of a registrar part run as a child process is, in the store
REGISTRAR_PID_FILE = "registrar.pid"
#: the fewest nodes of a cluster (and its replicas)
CLUSTER_MIN = 3
#: how often an unsupervised in-process registrar part's connections are checked
_WATCH_INTERVAL = 0.25


class Fabric:
    """A running fabric: ``async with Fabric(store, ...) as fabric:`` (or ``await
    fabric.start()`` … ``await fabric.stop()``).

    ``store``: the directory of its secrets and state (created for the owner only).
    ``port``: client port of the first server it starts (None: a free one); ``cluster``:
    servers to start as one JetStream cluster (1, or 3 and more); ``servers``: URLs of
    running NATS servers to use instead. ``secure``: a token issuer runs, every
    participant needs credentials and every call carries a token its callee checks;
    ``logins`` (default: ``secure`` on servers it starts): NATS refuses clients without
    credentials (auth callout answered by the login gates; servers given must include
    ``reach nats-auth``'s file). ``replicas`` of the registry and streams (default 3 on a
    cluster started here, else 1); ``audit_max_age`` seconds of audit events kept;
    ``registrar``: the registrar's other settings. ``supervise``: start what dies again;
    ``report(line)`` tells of each restart (default: a warning in the log).

    Credentials: on its first start a secure fabric writes ``<store>/admin.creds`` and
    ``<store>/dev.creds`` (level 4, admin role; ``creds("dev")``); ``add_client`` makes
    more. A process running the registrar part should call ``reach.runtime.tune_gc()`` first.
    """

    def __init__(
        self,
        store: str | Path,
        *,
        port: int | None = None,
        cluster: int = 1,
        servers: Sequence[str] | None = None,
        secure: bool = True,
        logins: bool | None = None,
        replicas: int | None = None,
        audit_max_age: float | None = None,
        registrar: RegistrarConfig | None = None,
        registrar_part: RegistrarPart = "in-process",
        supervise: bool = True,
        report: Callable[[str], None] | None = None,
    ) -> None:
        self.store = Path(store)
        self._given = list(servers) if servers is not None else None
        self.logins = (secure and self._given is None) if logins is None else logins
        self.secure = secure
        self._port = port
        self._cluster = cluster
        self._part = registrar_part
        self._supervise = supervise
        self._report = report or (lambda line: log.warning("%s", line))
        self.replicas = replicas if replicas is not None else (3 if cluster > 1 else 1)
        self._registrar_config = _registrar_config(registrar, self.replicas, audit_max_age)
        self._audit_max_age = self._registrar_config.streams.audit_max_age
        self._check(registrar is not None)
        #: the servers it started (empty with ``servers=``)
        self.nodes: list[EmbeddedServer] = []
        self._services: FabricServices | None = None
        self._process: ServiceProcess | None = None
        self._supervisor: Supervisor | None = None
        self._watch: asyncio.Task[None] | None = None
        self._health: HealthPoll | None = None
        self._ended: asyncio.Future[str] | None = None
        self._created: list[Path] = []

    def _check(self, custom_registrar: bool) -> None:
        """ConfigurationError naming the first option that does not fit the others."""
        own = self._given is None
        problem = None
        if self._cluster < 1 or self._cluster == 2:
            problem = f"cluster {self._cluster}: 1 server, or {CLUSTER_MIN} or more"
        elif not own and (self._cluster > 1 or self._port is not None):
            problem = "servers= names NATS to use: it takes neither port= nor cluster="
        elif not own and not self._given:
            problem = "servers= is empty"
        elif self.replicas < 1 or (own and self.replicas > self._cluster):
            problem = f"replicas {self.replicas} needs at least {self.replicas} servers"
        elif self.logins and not self.secure:
            problem = "logins need secure=True (the login gates check credentials)"
        elif own and self._cluster > 1 and not self.logins:
            problem = (
                "a cluster started here runs with logins (secure=True): its nodes' configs"
                " hold the route password beside the accounts"
            )
        elif self._part == "child-process" and (not self.secure or custom_registrar):
            problem = (
                "a registrar part in a child process runs `reach up --servers`:"
                " secure, with reach up's registrar settings"
            )
        elif self._part == "none" and not own:
            problem = "registrar_part='none' with servers= leaves nothing to start"
        if problem is not None:
            raise ConfigurationError(problem)

    # -- what it runs --------------------------------------------------------------------

    @property
    def urls(self) -> list[str]:
        """Client URLs of its servers."""
        return list(self._given) if self._given is not None else [n.url for n in self.nodes]

    @property
    def url(self) -> str:
        """The URLs as one string, as ``servers=``, ``--servers`` and REACH_URL take them."""
        return ",".join(self.urls)

    @property
    def services(self) -> FabricServices | None:
        """The registrar part when it runs in this process (None otherwise)."""
        return self._services

    @property
    def registrar(self) -> Registrar | None:
        """The registrar when it runs in this process."""
        return self._services.registrar if self._services is not None else None

    @property
    def registrar_id(self) -> str | None:
        """The running registrar's id (None without a registrar part)."""
        if self._services is not None and self._services.registrar is not None:
            return self._services.registrar.registrar_id
        if self._process is not None and self._process.ready_line:
            return str(json.loads(self._process.ready_line)["registrar"])
        return None

    @property
    def registrar_pid(self) -> int | None:
        """The registrar part's process id when it runs as a child process."""
        return self._process.pid if self._process is not None else None

    @property
    def created(self) -> list[Path]:
        """Credentials files this start wrote (a secure fabric's first start)."""
        return list(self._created)

    @property
    def restarts(self) -> dict[str, int]:
        """Restarts done by supervision, per part (``nats-server reach-1``, ``registrar``)."""
        return dict(self._supervisor.restarts) if self._supervisor is not None else {}

    def creds(self, client_id: str = "dev") -> Path:
        """The credentials file ``<store>/<client_id>.creds``; ConfigurationError if there
        is none (an open fabric has none; ``add_client`` writes one)."""
        path = self.store / f"{client_id}.creds"
        if not path.is_file():
            raise ConfigurationError(f"no credentials file {path}")
        return path

    async def add_client(
        self,
        client_id: str,
        level: int,
        *,
        agent_id: str | None = None,
        capabilities: Iterable[str] = (),
        roles: Iterable[str] = (),
        path: Path | None = None,
    ) -> Path:
        """A new credential, written (mode 0600) to ``path`` (default
        ``<store>/<client_id>.creds``); the path. Made by the registrar part's issuer
        when it runs here, else with the admin's credentials (``creds("admin")``)."""
        if not self.secure:
            raise ConfigurationError("an open fabric (secure=False) has no credentials")
        issuer = self._services.issuer if self._services is not None else None
        if issuer is not None and issuer.credentials is not None:
            _, secret = await issuer.credentials.add(
                client_id, level, agent_id=agent_id, roles=roles, capabilities=capabilities
            )
        else:
            conn, _ = await connect_as(
                self.urls, name="reach-fabric-admin", credentials=self.creds("admin")
            )
            try:
                credentials = await CredentialStore.open(conn, create=False)
                _, secret = await credentials.add(
                    client_id, level, agent_id=agent_id, roles=roles, capabilities=capabilities
                )
            finally:
                await conn.close()
        path = path or self.store / f"{client_id}.creds"
        CredentialsFile(self.url, client_id, secret).write(path)
        return path

    # -- lifecycle -----------------------------------------------------------------------

    async def start(self) -> Fabric:
        """Start the servers, then the registrar part; on a failure what started is
        stopped again. Returns the fabric."""
        from reach.fabric.nodes import plan_nodes, start_nodes

        if self._ended is not None:
            raise ConfigurationError("a Fabric starts once; make a new one to start again")
        loop = asyncio.get_running_loop()
        self._ended = loop.create_future()
        new_store = not self.store.exists()
        try:
            private_dir(self.store)  # secrets, JetStream data, server logs: owner only
            if self._given is None:
                self.nodes = plan_nodes(
                    self.store, port=self._port, cluster=self._cluster, logins=self.logins
                )
                await start_nodes(self.nodes)
            if self._part == "in-process":
                self._services = self._new_services()
                await self._services.start()
                self._created = self._services.created
            elif self._part == "child-process":
                await self._start_process()
            self._watch = asyncio.create_task(self._keep())
        except BaseException:
            await self.stop()
            if new_store:
                # a fabric that never started leaves no store behind (a busy port, say):
                # the next try starts as the first would have
                shutil.rmtree(self.store, ignore_errors=True)
            raise
        return self

    def _new_services(self) -> FabricServices:
        from reach.fabric.services import FabricServices

        return FabricServices(
            self.urls,
            self.store,
            secure=self.secure,
            logins=self.logins,
            registrar=self._registrar_config,
        )

    async def _start_process(self) -> None:
        command = [
            sys.executable,
            *("-m", "reach", "up", "--servers", self.url, "--store", str(self.store)),
            *(["--auth-callout"] if self.logins else []),
            *("--replicas", str(self.replicas)),
            *("--audit-max-age", f"{self._audit_max_age:g}s", "--supervised"),
        ]
        self._process = ServiceProcess(
            command, label="registrar", pid_file=self.store / REGISTRAR_PID_FILE
        )
        try:
            await self._process.start()
            ready = json.loads(self._process.ready_line)
            self._created = [Path(p) for p in ready["created"]]
        except (ReachError, ValueError, KeyError, TypeError) as exc:
            raise ReachError(f"the registrar did not start: {exc}") from exc

    def _store_guards(self) -> list[StoreGuard | None]:
        """A guard of each node's JetStream store, on a poll of the servers' health
        through the system account (a fabric with logins only: an open one has no
        user there); None for each node otherwise."""
        if not (self.logins and self._supervise and self.nodes):
            return [None] * len(self.nodes)
        from reach.security import natsconf

        try:
            user = natsconf.prepare(self.store, create=False).system_user
        except OSError as exc:  # the servers were configured from it: not expected
            log.warning("the servers' stores go unwatched: %s", exc)
            return [None] * len(self.nodes)

        self._health = HealthPoll.as_user(self.urls, user.name, user.password)
        self._health.start()
        single = len(self.nodes) == 1
        return [
            StoreGuard(self._health, node.store_dir, name=None if single else node.name)
            for node in self.nodes
        ]

    async def _keep(self) -> None:
        """Supervise what runs until ``stop``; the reason it cannot go on ends ``wait``."""
        guards = self._store_guards()
        children: list[Child] = [
            ServerChild(node, guard) for node, guard in zip(self.nodes, guards, strict=True)
        ]
        if self._process is not None:
            children.append(self._process)
        elif self._services is not None:
            children.append(_InProcessPart(self))
        if self._supervise and children:
            self._supervisor = Supervisor(children, report=self._report)
            reason = await self._supervisor.run(asyncio.Event())
        elif self._services is not None:
            # polled, as the supervisor polls its children: a connection tells of its
            # close only through callbacks its owners set
            while not self._services.closed_for_good:  # noqa: ASYNC110
                await asyncio.sleep(_WATCH_INTERVAL)
            reason = "a connection to NATS was closed for good; the registrar part exits"
        else:
            return
        if reason is not None and self._ended is not None and not self._ended.done():
            self._ended.set_result(reason)

    async def _restart_services(self) -> None:
        if self._services is not None:
            await self._services.stop()
            self._services = None
        services = self._new_services()
        await services.start()
        self._services = services

    async def wait(self) -> str:
        """Wait until the fabric cannot go on (a part that could not be started again, or
        an unsupervised registrar part that lost its connection for good): the reason."""
        if self._ended is None:
            raise ConfigurationError("the fabric is not started")
        return await asyncio.shield(self._ended)

    async def stop(self) -> None:
        """Stop supervising, then the registrar part, then the servers (each bounded)."""
        from reach.fabric.services import quietly

        if self._watch is not None:
            await cancel_and_wait([self._watch])
            self._watch = None
        if self._health is not None:
            await self._health.stop()
            self._health = None
        if self._services is not None:
            await self._services.stop()
            self._services = None
        if self._process is not None:
            await quietly(self._process.stop(), "stop the registrar")
        if self.nodes:
            await quietly(_stop_all(self.nodes), "stop nats-server")
        if self._ended is not None and not self._ended.done():
            self._ended.set_result("stopped")

    def kill(self) -> None:
        """SIGKILL every process it started, at once (for a second Ctrl-C)."""
        if self._process is not None:
            self._process.kill()
        for node in self.nodes:
            node.kill()

    async def __aenter__(self) -> Fabric:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


class _InProcessPart:
    """The in-process registrar part as a supervised child: it has died when one of its
    connections is closed for good, and starts again with new ones."""

    label = "registrar"

    def __init__(self, fabric: Fabric) -> None:
        self._fabric = fabric

    @property
    def running(self) -> bool:
        services = self._fabric.services
        return services is not None and not services.closed_for_good

    def exit_note(self) -> str:
        return "a connection to NATS was closed for good"

    def check(self) -> Checkup:
        return Checkup()  # it ends by itself when it cannot go on (``running``)

    async def start(self) -> None:
        await self._fabric._restart_services()

    async def stop(self) -> None:
        services = self._fabric.services
        if services is not None:
            await services.stop()


def _registrar_config(
    given: RegistrarConfig | None, replicas: int, audit_max_age: float | None
) -> RegistrarConfig:
    config = dataclasses.replace(given or RegistrarConfig(), replicas=replicas)
    if audit_max_age is not None:
        streams = dataclasses.replace(config.streams, audit_max_age=audit_max_age)
        config = dataclasses.replace(config, streams=streams)
    return config


async def _stop_all(nodes: list[EmbeddedServer]) -> None:
    await asyncio.gather(*(node.stop() for node in nodes))
