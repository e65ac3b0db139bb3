"""The nats-servers a fabric starts itself: one, or N on loopback as one JetStream cluster.

With logins on, each server's config (written to the store, mode 0600) has the accounts
and the auth callout of ``reach.security.natsconf``: no anonymous access. A cluster's
nodes also log in to each other's route port with a password kept in the store, and
fsync every write (``sync_interval: always``) so an acknowledged message survives a
node's crash. Without logins a single server runs with JetStream and a config holding
only the heartbeat mapping (``natsconf.render_mappings``), which every config has.

Store layout (the names ``reach up`` has always used): one server keeps its config in
``<store>/nats.conf`` and its JetStream data and log in ``<store>/nats``; node N of a
cluster in ``<store>/nats-N.conf`` and ``<store>/nats-N``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from reach.errors import ConfigurationError, Disconnected
from reach.fabric.embedded import EmbeddedServer, free_port, port_in_use
from reach.fabric.supervisor import server_failure
from reach.security import natsconf

__all__ = ["HOST", "plan_nodes", "start_nodes"]

#: where a fabric's own servers listen: loopback only
HOST = "127.0.0.1"


def plan_nodes(
    store: Path, *, port: int | None, cluster: int, logins: bool
) -> list[EmbeddedServer]:
    """The servers to start (not started): client ports from ``port`` on (None: free
    ones). The first port must be free (ConfigurationError names it); a busy one after it
    is swapped for a free one."""
    if port is not None and port_in_use(port, HOST):
        raise ConfigurationError(
            f"port {port} on {HOST} is already in use (another reach up or nats-server?);"
            " choose another port"
        )
    if cluster == 1:
        return [_single(store, port or free_port(), logins)]
    return _cluster(store, port, cluster)


def _single(store: Path, port: int, logins: bool) -> EmbeddedServer:
    if logins:
        setup = natsconf.prepare(store)
        config = natsconf.write_config(
            setup, store / "nats.conf", port=port, store_dir=None, host=HOST
        )
    else:  # the heartbeat mapping only
        store.mkdir(parents=True, exist_ok=True)
        config = natsconf.write_open_config(store / "nats.conf")
    return EmbeddedServer(
        port=port,
        store_dir=store / "nats",
        host=HOST,
        config_file=config,
        log_size_limit=natsconf.LOG_SIZE_LIMIT,
    )


def _cluster(store: Path, port: int | None, cluster: int) -> list[EmbeddedServer]:
    """A cluster's nodes: free route ports, a config and a store directory each."""
    setup = natsconf.prepare(store)
    taken: set[int] = set()
    ports = [_port_or_free(None if port is None else port + i, taken) for i in range(cluster)]
    routes = [_port_or_free(None, taken) for _ in range(cluster)]
    members = [
        natsconf.ClusterNode(f"{natsconf.CLUSTER_NAME}-{i}", HOST, client, route)
        for i, (client, route) in enumerate(zip(ports, routes, strict=True), start=1)
    ]
    password = natsconf.route_user(store).password
    nodes = []
    for i, member in enumerate(members):
        directory = f"nats-{i + 1}"
        config = natsconf.write_config(
            setup,
            store / f"{directory}.conf",
            port=member.port,
            store_dir=None,
            host=HOST,
            server_name=member.name,
            cluster=natsconf.ClusterPeers.of(members, i, password),
            sync_always=True,
        )
        nodes.append(
            EmbeddedServer(
                port=member.port,
                store_dir=store / directory,
                host=HOST,
                config_file=config,
                name=member.name,
                log_size_limit=natsconf.LOG_SIZE_LIMIT,
            )
        )
    return nodes


def _port_or_free(port: int | None, taken: set[int]) -> int:
    """``port`` if it is free and not ``taken``, else a free port; recorded in ``taken``."""
    if port is None or port > 65535 or port in taken or port_in_use(port, HOST):
        port = free_port()
        while port in taken:
            port = free_port()
    taken.add(port)
    return port


async def start_nodes(nodes: list[EmbeddedServer]) -> None:
    """Start every node at once (a cluster node's JetStream waits for the others);
    Disconnected with the server's own reason if one does not start."""
    started = await asyncio.gather(*(n.start() for n in nodes), return_exceptions=True)
    for node, outcome in zip(nodes, started, strict=True):
        if isinstance(outcome, Disconnected):
            raise Disconnected(f"nats-server did not start: {server_failure(node, outcome)}")
        if isinstance(outcome, BaseException):
            raise outcome
