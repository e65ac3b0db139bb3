"""The registrar part of a fabric, in this process: token issuer, login gates, registrar.

``FabricServices`` connects to the fabric's servers as the registrar's service user
(with logins on) or anonymously, waits until a cluster can place the replicas asked for,
starts the token issuer (REACH_CREDENTIALS, REACH_KEYS; the signing key in
``<store>/signing.key``) and writes the first credentials (``<store>/admin.creds``,
``<store>/dev.creds``), starts a login gate per server (with logins on: each answers
the logins of its own node), then the registrar. With logins it also reads the servers'
health through the system account, every second, and tells the registrar what it says of
their JetStream store (``reach.fabric.storewatch``): a full disk is then named in the
answers to registrar pings, in the alert ``store_full`` and in its own writes' errors.
``Fabric`` runs it here or in a child process (``reach up --servers … --supervised``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Awaitable
from pathlib import Path

from reach.errors import ConfigurationError, Disconnected, ReachError
from reach.fabric.storewatch import HealthPoll, fabric_store_problem
from reach.registry import Registrar, RegistrarConfig
from reach.security import natsconf
from reach.security.credentials import CredentialStore
from reach.security.gate import LoginGate
from reach.security.issuer import TokenService, ensure_first_credentials
from reach.transport import Connection, connect
from reach.transport.serverhealth import ServerHealth

__all__ = ["FabricServices", "cluster_ready", "quietly"]

log = logging.getLogger("reach.fabric")

#: how long a new cluster may take to elect its JetStream meta leader
CLUSTER_READY_TIMEOUT = 30.0
#: bound on stopping one part, so that a stuck one does not keep the others running
STOP_TIMEOUT = 10.0


class FabricServices:
    """Token issuer, login gates and registrar against ``servers``.

    ``secure=False``: no token issuer (an open fabric: calls carry no tokens); ``logins``:
    the servers hand their clients' logins to us (auth callout, configured from the
    secrets under ``<store>/auth``, as ``reach nats-auth`` or ``Fabric`` wrote them).
    """

    def __init__(
        self,
        servers: list[str],
        store: Path,
        *,
        secure: bool,
        logins: bool,
        registrar: RegistrarConfig,
    ) -> None:
        self.servers = list(servers)
        self.store = store
        self.secure = secure
        self.logins = logins
        self.registrar_config = registrar
        #: the registrar's (and issuer's) connection; None before ``start``
        self.conn: Connection | None = None
        #: the registrar's intake: what agents send to it is read here
        self.intake: Connection | None = None
        #: the token issuer's connection
        self.issuer_conn: Connection | None = None
        self.issuer: TokenService | None = None
        self.gates: list[LoginGate] = []
        self.registrar: Registrar | None = None
        #: the servers' health, read for what it says of their JetStream store (logins on)
        self.health: HealthPoll | None = None
        #: credentials files written by this start (a fabric's first)
        self.created: list[Path] = []

    async def start(self) -> None:
        """Start every part; on a failure the ones started are stopped again."""
        try:
            await self._start()
        except BaseException:
            await self.stop()
            raise

    async def _start(self) -> None:
        setup = self._setup() if self.logins else None
        service = setup.registrar_user if setup is not None else None

        async def connect_as(name: str) -> Connection:
            """A connection of the fabric's services (their service user, if secured)."""
            return await connect(
                self.servers,
                name=name,
                user=service.name if service else None,
                password=service.password if service else None,
            )

        self.conn = await connect_as("reach-up")
        replicas = self.registrar_config.replicas
        if len(self.servers) > 1 or replicas > 1:
            await cluster_ready(self.conn, replicas)
        if self.secure:
            # token requests come from every client: read on a connection of their own,
            # a flood of them never queues in front of the registrar's work
            self.issuer_conn = await connect_as("reach-up-issuer")
            self.issuer = TokenService(
                self.issuer_conn, key_file=self.store / "signing.key", replicas=replicas
            )
            await self.issuer.start()
            self.created = await ensure_first_credentials(
                self.issuer, self.store, ",".join(self.servers)
            )
            if setup is not None:
                assert self.issuer.credentials is not None
                self.gates = await _start_gates(setup, self.issuer.credentials, self.servers)
        # what agents send (heartbeats, announces) is read on a connection of its own, so a
        # flood of it never queues in front of probe answers, registry acks and tokens
        self.intake = await connect_as("reach-up-intake")
        self.registrar = Registrar(self.conn, self.registrar_config, intake=self.intake)
        await self.registrar.start()
        if setup is not None:
            system = setup.system_user

            self.health = HealthPoll.as_user(
                self.servers, system.name, system.password, on_answers=self._store_health
            )
            self.health.start()

    def _store_health(self, answers: list[ServerHealth]) -> None:
        """A round of the servers' health: what it says of their store goes to the
        registrar and to every connection of ours that writes to JetStream."""
        problem = fabric_store_problem(answers)
        if self.issuer_conn is not None:
            self.issuer_conn.denials.store.known = problem
        if self.registrar is not None:
            self.registrar.store_changed(problem)

    def _setup(self) -> natsconf.SecureSetup:
        try:
            return natsconf.prepare(self.store, create=False)
        except FileNotFoundError as exc:
            raise ConfigurationError(
                f"{exc}; run `reach nats-auth --store {self.store}` and include its file in"
                " each nats-server's config"
            ) from None

    @property
    def closed_for_good(self) -> bool:
        """True once one of our connections no longer reconnects: the part cannot go on."""
        connections = [
            self.conn,
            self.intake,
            self.issuer_conn,
            *(gate.connection for gate in self.gates),
        ]
        return any(c is not None and c.is_closed for c in connections)

    async def stop(self) -> None:
        """The registrar first (it writes to NATS as it stops), then the gates, the issuer
        and the connection; each within a bound, a failure logged."""
        if self.health is not None:
            await quietly(self.health.stop(), "stop reading the servers' health")
            self.health = None
        if self.registrar is not None:
            await quietly(self.registrar.stop(), "stop the registrar")
        for gate in self.gates:
            await quietly(gate.stop(), "stop the login gate")
        if self.issuer is not None:
            await quietly(self.issuer.stop(), "stop the token issuer")
        for conn in (self.intake, self.issuer_conn, self.conn):
            if conn is not None:
                await quietly(conn.close(), "close the connection")
        self.registrar, self.gates, self.issuer, self.conn = None, [], None, None
        self.intake = self.issuer_conn = None


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
            await quietly(gate.stop(), "stop the login gate")
        raise
    return gates


async def cluster_ready(conn: Connection, replicas: int) -> None:
    """Wait until the cluster can place ``replicas`` copies of a stream.

    A JetStream meta leader answers the account info before every node has joined the meta
    group, and a stream of 3 replicas created then fails with "no suitable peers for
    placement": so a small stream of ``replicas`` replicas is created (in memory) and
    deleted again, until that works.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + CLUSTER_READY_TIMEOUT
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
        f"the cluster cannot place {replicas} replicas after {CLUSTER_READY_TIMEOUT:g}s: {last}"
    )


async def quietly(step: Awaitable[None], what: str) -> None:
    """Shut one part down within a bound; a failure must not keep the others running."""
    try:
        await asyncio.wait_for(step, STOP_TIMEOUT)
    except Exception as exc:
        log.warning("could not %s: %s", what, exc or type(exc).__name__)
