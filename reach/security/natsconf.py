"""The secure nats-server setup of ``reach up``: nkeys, service users and the config text.

No anonymous access: every client that is not one of the service users below is handed
to the auth callout (``reach.security.callout``), which checks its client id + secret and
returns a user JWT with its subject permissions and the account it is placed in.

* ``AUTH`` account: the callout service user. Nothing else lives there, so no client can see
  the authorization requests (they carry the clients' secrets) on ``$SYS.REQ.USER.AUTH``.
* ``REACH`` account (JetStream on): the registrar/issuer user, which connects with a
  password and bypasses the callout (it is in ``auth_users``) so that the registry and the
  credential store work before any credential exists, and the admins' tools.
* ``REACH_CLIENTS`` account (no JetStream): callers and agents (and an admin's connection
  that joins as a participant). It reaches ``REACH`` only through the service and stream
  imports of ``reach.security.accounts``, so no reply subject a client names can point a
  JetStream answer at a stream or at the JetStream API.
* ``SYS``: the system account, with one service user for the login gate: it asks the
  server to close the connections of a revoked client (``$SYS.REQ.SERVER.<id>.KICK``) and
  hears of disconnects (``reach.security.revocation``).

The issuer is an account nkey (ed25519) whose seed stays under the store directory (0600):
the server accepts a callout answer only if it is signed by it. Nkeys are made, encoded and
used to sign by nats-io's own ``nkeys`` package.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

import nkeys
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from reach.security import accounts
from reach.security.credentials import write_private_file
from reach.wire import subjects

__all__ = [
    "APP_ACCOUNT",
    "AUTH_ACCOUNT",
    "CALLOUT_USER",
    "CLIENT_ACCOUNT",
    "CLUSTER_NAME",
    "LOG_MAX_FILES",
    "LOG_SIZE_LIMIT",
    "REGISTRAR_USER",
    "ROUTE_USER",
    "SYSTEM_ACCOUNT",
    "SYSTEM_USER",
    "ClusterNode",
    "ClusterPeers",
    "NKey",
    "SecureSetup",
    "ServiceUser",
    "cluster_settings",
    "jetstream_settings",
    "load_or_create_password",
    "load_or_create_seed",
    "prepare",
    "render_auth",
    "render_config",
    "render_value",
    "route_user",
    "verify_signature",
    "write_auth",
    "write_config",
]

AUTH_ACCOUNT = "AUTH"
APP_ACCOUNT = "REACH"
#: where callers and agents live: no JetStream, only what ``reach.security.accounts`` lists
CLIENT_ACCOUNT = "REACH_CLIENTS"
SYSTEM_ACCOUNT = "SYS"
CALLOUT_USER = "reach-auth"
REGISTRAR_USER = "reach-registrar"
#: the login gate's system-account user (closes the connections of revoked clients)
SYSTEM_USER = "reach-system"
#: the user nodes of a ``reach up --cluster`` log in to each other's route port with
ROUTE_USER = "reach-route"
CLUSTER_NAME = "reach"

#: bytes after which a server of ``reach up`` starts a new log file, and how many old
#: ones it keeps: the log grows with refused logins, which anyone can send
LOG_SIZE_LIMIT = 10 * 1024 * 1024
LOG_MAX_FILES = 3

#: the kinds of nkey in use, by their prefix byte (the first character of the encoded key)
PREFIX_SERVER: int = nkeys.PREFIX_BYTE_SERVER  # N
PREFIX_ACCOUNT: int = nkeys.PREFIX_BYTE_ACCOUNT  # A
PREFIX_USER: int = nkeys.PREFIX_BYTE_USER  # U


def _decode(text: str) -> bytes:
    """The bytes of an encoded nkey (a seed or a public key), its checksum checked."""
    try:
        raw = base64.b32decode(text + "=" * (-len(text) % 8))
    except (ValueError, TypeError) as exc:
        raise ValueError("not an nkey") from exc
    if len(raw) < 3 or nkeys.crc16(raw[:-2]) != int.from_bytes(raw[-2:], "little"):
        raise ValueError("nkey checksum mismatch")
    return raw[:-2]


def decode_public_key(text: str, prefix: int | None = None) -> bytes:
    """The raw ed25519 key of an encoded public nkey; ValueError if malformed or wrong kind.

    (nkeys signs with a seed; checking a signature by a public key alone is done here.)"""
    raw = _decode(text)
    if len(raw) != 33 or not nkeys.valid_public_prefix_byte(raw[0]):
        raise ValueError("not a public nkey")
    if prefix is not None and raw[0] != prefix:
        raise ValueError("public nkey of the wrong kind")
    return raw[1:]


def is_public_key(text: str, prefix: int) -> bool:
    try:
        decode_public_key(text, prefix)
    except ValueError:
        return False
    return True


def verify_signature(public_key: str, data: bytes, signature: bytes) -> bool:
    """True if ``signature`` is the ed25519 signature of ``data`` by the nkey ``public_key``."""
    try:
        Ed25519PublicKey.from_public_bytes(decode_public_key(public_key)).verify(signature, data)
    except (ValueError, InvalidSignature):
        return False
    return True


class NKey:
    """An ed25519 nkey pair (account, user or server) known by its seed: nkeys' key pair."""

    def __init__(self, seed: str) -> None:
        """The key pair of an encoded seed (``S…``); ValueError if it is not one."""
        text = seed.strip()
        # nkeys reads a seed without checking its checksum: a damaged one is refused here
        if len(_decode(text)) != 34:
            raise ValueError("not an nkey seed")
        try:
            prefix, _ = nkeys.decode_seed(text.encode())
            self._pair = nkeys.from_seed(text.encode())
        except (nkeys.NkeysError, ValueError) as exc:
            raise ValueError("not an nkey seed") from exc
        self.prefix: int = prefix
        self.seed = text
        self.public_key: str = self._pair.public_key.decode()

    @classmethod
    def create(cls, prefix: int = PREFIX_ACCOUNT) -> NKey:
        """A new random key pair of the kind ``prefix``."""
        seed: bytes = nkeys.encode_seed(secrets.token_bytes(32), prefix)
        return cls(seed.decode())

    def sign(self, data: bytes) -> bytes:
        signature: bytes = self._pair.sign(data)
        return signature

    def __repr__(self) -> str:
        return f"NKey({self.public_key})"


def _write_secret(path: Path, text: str) -> bool:
    """Create ``path`` with mode 0600 holding ``text``; False if it exists already."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as out:
        out.write(text + "\n")
    return True


def load_or_create_seed(path: str | os.PathLike[str], prefix: int = PREFIX_ACCOUNT) -> NKey:
    """The nkey whose seed is in ``path``, created (mode 0600) on first use."""
    file = Path(path)
    if not file.exists():
        _write_secret(file, NKey.create(prefix).seed)  # a racing creator wins: reread below
    key = NKey(file.read_text())
    if key.prefix != prefix:
        raise ValueError(f"{file} holds an nkey of the wrong kind")
    return key


def load_or_create_password(path: str | os.PathLike[str]) -> str:
    """A random service password kept in ``path`` (mode 0600), created on first use."""
    file = Path(path)
    if not file.exists():
        _write_secret(file, secrets.token_urlsafe(32))
    password = file.read_text().strip()
    if not password:
        raise ValueError(f"{file} is empty")
    return password


@dataclass(frozen=True, slots=True)
class ServiceUser:
    """A user defined in the server config (password login, no callout)."""

    name: str
    password: str
    account: str


@dataclass(frozen=True, slots=True)
class SecureSetup:
    """What the secure server needs: the callout issuer and the service users."""

    issuer: NKey
    callout_user: ServiceUser
    registrar_user: ServiceUser
    #: the login gate's system-account user: it closes the connections of revoked clients
    system_user: ServiceUser
    #: seconds the server waits for a client's CONNECT, and so for the callout's answer
    auth_timeout: float = 5.0


_SECRETS = ("issuer.nk", "callout.pass", "registrar.pass", "system.pass")


def prepare(store_dir: str | os.PathLike[str], *, create: bool = True) -> SecureSetup:
    """Create (once) or load the issuer seed and service passwords under ``<store>/auth``.

    ``create=False``: load only; ``FileNotFoundError`` names the first one missing (the
    servers were configured from another store, or not by ``reach nats-auth`` at all)."""
    auth = Path(store_dir) / "auth"
    if not create:
        for name in _SECRETS:
            if not (auth / name).is_file():
                raise FileNotFoundError(f"{auth / name} does not exist")
    return SecureSetup(
        issuer=load_or_create_seed(auth / "issuer.nk", PREFIX_ACCOUNT),
        callout_user=ServiceUser(
            CALLOUT_USER, load_or_create_password(auth / "callout.pass"), AUTH_ACCOUNT
        ),
        registrar_user=ServiceUser(
            REGISTRAR_USER, load_or_create_password(auth / "registrar.pass"), APP_ACCOUNT
        ),
        system_user=ServiceUser(
            SYSTEM_USER, load_or_create_password(auth / "system.pass"), SYSTEM_ACCOUNT
        ),
    )


@dataclass(frozen=True, slots=True)
class ClusterNode:
    """One node of a local cluster (``reach up --cluster N``): its name and its two ports."""

    name: str
    host: str
    #: client port
    port: int
    #: cluster route port
    route_port: int

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    @property
    def route_address(self) -> str:
        return f"{self.host}:{self.route_port}"


@dataclass(frozen=True, slots=True)
class ClusterPeers:
    """What one node's config says about its cluster: where it listens for routes, the
    other nodes' route addresses (``host:port``) and the route password shared by all."""

    listen: str
    routes: tuple[str, ...]
    password: str
    name: str = CLUSTER_NAME

    @classmethod
    def of(cls, nodes: list[ClusterNode], me: int, password: str) -> ClusterPeers:
        """The peers of ``nodes[me]``: every other node of ``nodes``."""
        others = tuple(n.route_address for i, n in enumerate(nodes) if i != me)
        return cls(listen=nodes[me].route_address, routes=others, password=password)


def route_user(store_dir: str | os.PathLike[str]) -> ServiceUser:
    """The route login of a local cluster, its password kept in ``<store>/auth/route.pass``.

    Without it any local process could join the cluster as a server and see every message,
    the callout's authorization requests (which carry client secrets) included.
    """
    password = load_or_create_password(Path(store_dir) / "auth" / "route.pass")
    return ServiceUser(ROUTE_USER, password, SYSTEM_ACCOUNT)


#: how often a node pings the other nodes over its routes, and the pings unanswered after
#: which it gives a route up. A stalled node (SIGSTOP, a hung host) keeps its sockets
#: open: until its routes are given up, the others keep routing to the subscriptions its
#: clients had, a login gate's queue subscription included, though those clients have
#: long moved to another node. nats-server's default notices after minutes.
ROUTE_PING_INTERVAL = "250ms"
ROUTE_PING_MAX = 2


def cluster_settings(peers: ClusterPeers) -> dict[str, object]:
    """The ``cluster`` block of one node's config."""
    user = f"{ROUTE_USER}:{peers.password}@"
    return {
        "name": peers.name,
        "listen": peers.listen,
        "authorization": {"user": ROUTE_USER, "password": peers.password},
        "routes": [f"nats-route://{user}{route}" for route in peers.routes],
        "ping_interval": ROUTE_PING_INTERVAL,
        "ping_max": ROUTE_PING_MAX,
    }


def jetstream_settings(
    store_dir: str | os.PathLike[str] | None, *, sync_always: bool = False
) -> dict[str, object]:
    """The ``jetstream`` block; ``sync_always``: fsync on every write (``sync_interval:
    always``), so an acknowledged message survives a node's crash, not just its process."""
    settings: dict[str, object] = {}
    if store_dir is not None:
        settings["store_dir"] = str(store_dir)
    if sync_always:
        settings["sync_interval"] = "always"
    return settings


def render_mappings(indent: int = 0) -> str:
    """The ``mappings`` block: every heartbeat onto its partition's subject, so that it
    reaches the one registrar that keeps that partition (``reach.registry.heartbeats``).
    Put in the account the registrars live in: nats-server maps a message in the account
    it is delivered to after a service import, and checks a client's publish permissions
    on the subject as mapped in the client's own account, so agents elsewhere keep
    publishing on ``reach.v1.hb.<agent_id>`` with the permissions they have."""
    source, destination = subjects.HEARTBEAT_MAPPING
    pad = "  " * indent
    return f"{pad}mappings: {{\n{pad}  {_q(source)}: {_q(destination)}\n{pad}}}"


def render_open_config() -> str:
    """The config of a server without logins (``reach up`` without them): only the
    heartbeat mapping; the rest is given on the command line."""
    return f"# generated by reach: no logins\n{render_mappings()}\n"


def write_open_config(path: str | os.PathLike[str]) -> Path:
    """Write ``render_open_config`` and return its path."""
    file = Path(path)
    write_private_file(file, render_open_config().encode("utf-8"))
    return file


def render_value(value: object, indent: int = 0) -> str:
    """``value`` in nats-server config syntax: maps as blocks, lists, quoted strings."""
    if isinstance(value, dict):
        pad = "  " * (indent + 1)
        lines = [f"{pad}{key}: {render_value(item, indent + 1)}" for key, item in value.items()]
        return "{\n" + "\n".join(lines) + "\n" + "  " * indent + "}"
    if isinstance(value, list):
        return "[ " + ", ".join(render_value(item, indent) for item in value) + " ]"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return f"{value:g}" if isinstance(value, float) else str(value)
    return _q(str(value))


def _q(text: str) -> str:
    """A quoted string for the nats-server config (JSON escapes are understood)."""
    return json.dumps(text)


def _user(user: ServiceUser) -> str:
    return f"{{ user: {_q(user.name)}, password: {_q(user.password)} }}"


def render_config(
    setup: SecureSetup,
    *,
    port: int,
    store_dir: str | os.PathLike[str] | None,
    host: str = "127.0.0.1",
    server_name: str = "reach",
    cluster: ClusterPeers | None = None,
    sync_always: bool = False,
) -> str:
    """The nats-server configuration text: auth on, callout, JetStream in ``REACH`` only.

    ``store_dir=None`` leaves the JetStream store to the command line (``-sd``, as
    ``EmbeddedServer`` passes it: nats-server refuses a store_dir given twice).
    ``cluster``: this node's routes to the other nodes of a cluster; every node gets the
    same accounts and auth callout, so a client may log in on any of them.
    """
    js_settings = jetstream_settings(store_dir, sync_always=sync_always)
    jetstream = render_value(js_settings) if js_settings else "enabled"
    routes = f"cluster: {render_value(cluster_settings(cluster))}\n" if cluster else ""
    return f"""# generated by reach: authentication on, no anonymous access (auth callout)
server_name: {_q(server_name)}
listen: {_q(f"{host}:{port}")}
logfile_max_num: {LOG_MAX_FILES}
jetstream: {jetstream}
{routes}{render_auth(setup)}"""


def render_auth(setup: SecureSetup) -> str:
    """The accounts and the auth callout: the part of the config that shuts out anonymous
    clients. ``render_config`` embeds it; a server ``reach up`` did not start includes it
    (``reach nats-auth``) and ``reach up --servers URL --auth-callout`` answers its logins."""
    call, reg, sys_user = setup.callout_user, setup.registrar_user, setup.system_user
    service_users = [call.name, reg.name, sys_user.name]
    return f"""accounts {{
  {AUTH_ACCOUNT}: {{
    users: [ {_user(call)} ]
  }}
  {APP_ACCOUNT}: {{
    jetstream: enabled
    users: [ {_user(reg)} ]
{render_mappings(2)}
{accounts.fabric_links(APP_ACCOUNT, CLIENT_ACCOUNT)}
  }}
  {CLIENT_ACCOUNT}: {{
{accounts.client_links(APP_ACCOUNT, CLIENT_ACCOUNT)}
  }}
  {SYSTEM_ACCOUNT}: {{
    users: [ {_user(sys_user)} ]
  }}
}}
system_account: {SYSTEM_ACCOUNT}
authorization {{
  timeout: {setup.auth_timeout:g}
  auth_callout {{
    issuer: {_q(setup.issuer.public_key)}
    account: {AUTH_ACCOUNT}
    auth_users: [ {", ".join(_q(name) for name in service_users)} ]
  }}
}}
"""


def write_auth(setup: SecureSetup, path: str | os.PathLike[str]) -> Path:
    """Write ``render_auth`` for a nats-server config to include (mode 0600: it holds the
    service passwords) and return its path."""
    file = Path(path)
    text = "# generated by reach nats-auth: no anonymous access (auth callout)\n"
    write_private_file(file, (text + render_auth(setup)).encode("utf-8"))
    return file


def write_config(
    setup: SecureSetup,
    path: str | os.PathLike[str],
    *,
    port: int,
    store_dir: str | os.PathLike[str] | None,
    host: str = "127.0.0.1",
    server_name: str = "reach",
    cluster: ClusterPeers | None = None,
    sync_always: bool = False,
) -> Path:
    """Write the config (mode 0600: it holds the service passwords) and return its path."""
    file = Path(path)
    text = render_config(
        setup,
        port=port,
        store_dir=store_dir,
        host=host,
        server_name=server_name,
        cluster=cluster,
        sync_always=sync_always,
    )
    write_private_file(file, text.encode("utf-8"))
    return file
