"""NATS auth callout: the server asks us, on ``$SYS.REQ.USER.AUTH``, whether a client may connect.

How it works (nats-server >= 2.10, server-config mode, see ADR-26 "NATS Authorization
Callouts" and server/auth_callout.go):

1. A client that is not in ``auth_users`` connects with ``user``/``pass`` (our client id and
   secret). The server makes a throwaway user nkey for the connection and publishes an
   *authorization request* JWT to ``$SYS.REQ.USER.AUTH`` in the callout account, with a
   ``$SYS._INBOX`` reply subject. The JWT (``alg: ed25519-nkey``) is signed by the server's
   own nkey: ``iss`` = ``nats.server_id.id`` = the server id in INFO, ``aud`` =
   ``nats-authorization-request``, ``sub`` = our issuer's public key, ``exp`` = now + the
   auth timeout; ``nats.user_nkey`` is the nkey the answer must be for and
   ``nats.connect_opts`` holds what the client sent in CONNECT.
2. We answer with an *authorization response* JWT signed by the issuer account nkey:
   ``sub`` = that user nkey, ``aud`` = the server id, and ``nats.jwt`` = a user JWT
   (also ``sub`` = user nkey, ``iss`` = issuer, ``aud`` = the account to place the client in,
   ``nats.pub/sub/resp`` = its permissions) or ``nats.error`` to refuse.
3. The server checks the signature (issuer must equal ``auth_callout.issuer``), subject,
   audience and expiry, then applies the permissions for the life of the connection.

Requests are verified before we trust them: signature by the ``iss`` server key, which must
be the server we are connected to when ``server_ids`` is given, the audience, the subject
(our issuer), the expiry and the type. No xkey encryption: it needs NaCl boxes (PyNaCl);
the requests stay inside the dedicated AUTH account on loopback.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

from reach.errors import ReachError
from reach.security import accounts, natsconf
from reach.security.accounts import PARTICIPANT_SUFFIX
from reach.security.natsjwt import decode_jwt, encode_jwt
from reach.tasks import cancel_and_wait
from reach.transport import Connection, Message, Subscription
from reach.transport.kvfollow import republish_prefix
from reach.wire import subjects

__all__ = [
    "AUTH_SUBJECT",
    "ROLES",
    "AuthCallout",
    "Authenticator",
    "CalloutRequest",
    "LoginListener",
    "Permissions",
    "permissions_for",
]

log = logging.getLogger("reach.security.callout")

AUTH_SUBJECT = "$SYS.REQ.USER.AUTH"
_REQUEST_AUDIENCE = "nats-authorization-request"
_LEEWAY = 5  # seconds of clock skew tolerated on the request's exp/nbf


# -- permissions ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Permissions:
    """Subject permissions of one connection (NATS semantics: deny wins over allow)."""

    publish_allow: tuple[str, ...] = ()
    publish_deny: tuple[str, ...] = ()
    #: an entry may name a queue group: ``"reach.v1.cap.x x"`` allows only that group
    subscribe_allow: tuple[str, ...] = ()
    subscribe_deny: tuple[str, ...] = ()
    #: may publish one reply to the reply subject of each request it received
    allow_responses: bool = False
    response_max: int = 1
    response_ttl: float = 600.0
    #: the NATS account the client is placed in ("": the callout's own default)
    account: str = ""

    def claims(self) -> dict[str, Any]:
        """The ``pub``/``sub``/``resp`` part of a user JWT.

        An empty side would mean *no restriction* to the server, so it becomes ``deny >``.
        """

        def side(allow: Sequence[str], deny: Sequence[str]) -> dict[str, list[str]]:
            if not allow and not deny:
                return {"deny": [">"]}
            out = {"allow": list(allow)} if allow else {}
            return out | ({"deny": list(deny)} if deny else {})

        out: dict[str, Any] = {
            "pub": side(self.publish_allow, self.publish_deny),
            "sub": side(self.subscribe_allow, self.subscribe_deny),
        }
        if self.allow_responses:
            out["resp"] = {"max": self.response_max, "ttl": int(self.response_ttl * 1e9)}
        return out


#: roles of ClientRecord: ``registrar`` and ``admin`` (the credential and key tools) own the
#: REACH_* buckets; a client bound to an agent_id is an ``agent``; anyone else is a ``caller``
ROLES = ("agent", "caller", "registrar", "admin")


def _kv_follow(bucket: str) -> str:
    """Where a reader of the public bucket b hears of its changes (reach.transport.kvfollow)."""
    return f"{republish_prefix(bucket)}.>"


#: where callers and agents live: an account without JetStream (reach.security.accounts)
_CLIENTS = natsconf.CLIENT_ACCOUNT


def permissions_for(
    role: str,
    *,
    agent_id: str | None,
    capabilities: Sequence[str],
    inbox_prefix: str,
    async_jobs: bool = False,
) -> Permissions:
    """The NATS permissions of a client of ``role`` (see ROLES).

    ``inbox_prefix`` is the client's own reply prefix (``_INBOX.<client_id>``): the client
    must connect with it (nats-py ``inbox_prefix=``) since it may subscribe nowhere else for
    replies. ``async_jobs`` lets a client read the records of the jobs it called (keys
    ``job.<client_id>.…``, see ``reach.agent.jobs.new_job_id``) and an agent write those of the
    jobs it runs (``job.*.<agent_id>.*``): no one else's.
    """
    if role in ("registrar", "admin"):
        # the registrar/issuer and the admin tools own registry, credentials, keys, jobs,
        # streams: they live in the fabric account, where JetStream is
        return Permissions(
            publish_allow=(">",),
            subscribe_allow=(">",),
            allow_responses=True,
            account=natsconf.APP_ACCOUNT,
        )
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; expected one of {', '.join(ROLES)}")
    _check_inbox(inbox_prefix)
    pub = [
        subjects.TOKEN,  # exchange client id + secret for a token (request/reply)
        subjects.REGISTRAR_PING,  # registrar liveness (tools, clients)
        f"{subjects.PREFIX}.cap.>",  # call any capability: clearance is checked by the callee
        # audit events of its calls (and of the calls it denies), under its own client
        # id only: readers take the writer from the subject
        subjects.audit("*", _client_of(inbox_prefix)),
        subjects.audited("*", _client_of(inbox_prefix)),  # once stored: where (alert rules)
        accounts.JS_ACCOUNT_INFO,  # standard clients' check that JetStream is there
        *accounts.js_read(subjects.REGISTRY_BUCKET),  # route cache: read-only registry
        *accounts.js_read(subjects.KEYS_BUCKET),  # token verification keys: read-only
        f"{subjects.SRV_PREFIX}.>",  # NATS micro discovery: ask the agents PING/INFO/STATS
    ]
    sub = [
        f"{inbox_prefix}.>",  # replies and JetStream API answers
        _kv_follow(subjects.REGISTRY_BUCKET),  # route cache: the registry's changes
        _kv_follow(subjects.KEYS_BUCKET),  # token verification keys
    ]
    if async_jobs:
        # its own jobs only: a direct get names the key in its subject (the leader's get
        # and a scan name it in their bodies, which permissions cannot see)
        mine = f"$KV.{subjects.JOBS_BUCKET}.job.{_client_of(inbox_prefix)}.>"
        stream = f"KV_{subjects.JOBS_BUCKET}"
        pub += [f"$JS.API.STREAM.INFO.{stream}", f"$JS.API.DIRECT.GET.{stream}.{mine}"]
        sub.append(f"{republish_prefix(subjects.JOBS_BUCKET)}.job.{_client_of(inbox_prefix)}.>")
    if role == "caller":
        return Permissions(publish_allow=tuple(pub), subscribe_allow=tuple(sub), account=_CLIENTS)
    agent_pub, agent_sub = _agent_side(agent_id, capabilities, async_jobs)
    return Permissions(
        publish_allow=(*pub, *agent_pub), subscribe_allow=(*sub, *agent_sub), account=_CLIENTS
    )


def _agent_side(
    agent_id: str | None, capabilities: Sequence[str], async_jobs: bool
) -> tuple[list[str], list[str]]:
    """What an agent may publish and subscribe to beyond what every client may."""
    if agent_id is None or not subjects.is_token(agent_id):
        raise ValueError("an agent needs an agent_id that is one subject token")
    caps = list(dict.fromkeys(capabilities))
    for cap in caps:
        if not subjects.is_token(cap):
            raise ValueError(f"capability {cap!r} is not one subject token")
    pub = [
        subjects.announce(agent_id),  # announce only itself
        subjects.heartbeat(agent_id),  # heartbeat only itself
        subjects.bye(agent_id),  # deregister only itself
    ]
    if async_jobs:
        # the records of the jobs it runs (a KV put is a publish): its agent id second
        pub.append(f"$KV.{subjects.JOBS_BUCKET}.job.*.{agent_id}.*")
    # calls to the capabilities its credential lists, and no others (none listed: none)
    sub = [subjects.capability_instance(cap, agent_id) for cap in caps]  # to this instance
    sub += [f"{subjects.capability(cap)} {cap}" for cap in caps]  # its share of the queue
    sub.append(subjects.probe(agent_id))  # the registrar's health probes
    sub += _srv_subjects(agent_id)
    # Replies go to callers' call-reply subjects only, through a publish permission: never
    # NATS's response permission, which lets a client publish to the reply subject of any
    # message it receives, past every allow and deny list; an agent that sends itself a
    # message with reply "$KV.REACH_JOBS.job.<someone else's>…" would then write there
    # through the imports
    pub.append(subjects.CALL_REPLIES)
    # and the answers to probes, which come from the fabric account through the probe
    # import: the server hands them a one-time ``_R_.…`` reply that maps back to the
    # prober's inbox (see reach.security.accounts)
    pub.append(subjects.SERVICE_REPLIES)
    # answers to $SRV requests: in the discovery space of inboxes only (see SRV_REPLIES)
    pub.append(subjects.SRV_REPLIES)
    return pub, sub


def _srv_subjects(agent_id: str) -> list[str]:
    """The NATS micro control subjects an agent answers on: every service's, every
    instance's of a name, and its own id's only. A credential binds an agent id, not a
    name: any name at the middle level (where an agent could claim any name anyway, as it
    can in its answer to ``$SRV.PING``), the instance level only under its own id."""
    out: list[str] = []
    for verb in subjects.SRV_VERBS:
        out += [subjects.srv(verb), subjects.srv(verb, "*"), subjects.srv(verb, "*", agent_id)]
    return out


def _check_inbox(prefix: str) -> None:
    tokens = prefix.split(".")
    if (
        len(tokens) < 2
        or tokens[0] != "_INBOX"
        or not all(subjects.is_token(t) for t in tokens[1:])
    ):
        raise ValueError(f"inbox prefix {prefix!r} must be _INBOX.<token>[.<token>...]")


def _client_of(inbox_prefix: str) -> str:
    """The client id of a checked inbox prefix ``_INBOX.<client_id>``: the user the server
    logged in, and so the only writer token its audit subjects may carry."""
    return inbox_prefix.split(".", 1)[1]


def _mapping(value: object) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


# -- the callout service ----------------------------------------------------------------------

Authenticator = Callable[[str, str], Awaitable[Permissions | None]]


@dataclass(frozen=True, slots=True)
class CalloutRequest:
    """A verified authorization request."""

    server_id: str
    user_nkey: str
    user: str
    password: str
    client_name: str
    client_host: str
    #: the server's id of the connection (``nats.client_info.id``): with ``server_id``,
    #: what a kick names (0 if the request did not say)
    connection_id: int = 0


#: told of every login the callout admits, before the server hears the answer
LoginListener = Callable[[CalloutRequest], None]


class AuthCallout:
    """Answers the server's authorization requests on ``$SYS.REQ.USER.AUTH``.

    ``conn`` is a connection of the callout service user (``auth_users``, AUTH account).
    ``authenticate(user, password)`` returns the client's permissions, or None to refuse.
    ``server_ids``: the server keys whose requests we accept (None: any correctly signed one,
    the AUTH account is ours alone). ``user_ttl``: the user JWT's lifetime; when it expires
    the server drops the connection and the client logs in again (None: no expiry).
    """

    def __init__(
        self,
        conn: Connection,
        issuer: natsconf.NKey,
        authenticate: Authenticator,
        *,
        account: str = natsconf.APP_ACCOUNT,
        server_ids: Collection[str] | None = None,
        user_ttl: float | None = None,
        queue: str = "reach-auth",
        concurrency: int = 64,
        on_admitted: LoginListener | None = None,
    ) -> None:
        if issuer.prefix != natsconf.PREFIX_ACCOUNT:
            raise ValueError("the callout issuer must be an account nkey")
        self._conn = conn
        self._issuer = issuer
        self._authenticate = authenticate
        self._account = account
        self._server_ids = frozenset(server_ids) if server_ids is not None else None
        self._user_ttl = user_ttl
        self._queue = queue
        self._on_admitted = on_admitted
        self._slots = asyncio.Semaphore(concurrency)
        self._tasks: set[asyncio.Task[None]] = set()
        self._sub: Subscription | None = None
        self.refused = 0
        self.accepted = 0

    async def start(self) -> None:
        self._sub = await self._conn.subscribe(AUTH_SUBJECT, self._on_request, queue=self._queue)
        await self._settle()  # the server sends us requests from here on

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None
            with contextlib.suppress(ReachError):
                await self._settle()  # the server stops sending us requests from here on

    async def _settle(self) -> None:
        # the UNSUB reached the server before this returns (see Connection.flush)
        await self._conn.flush()
        await cancel_and_wait(list(self._tasks))

    async def __aenter__(self) -> AuthCallout:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _on_request(self, msg: Message) -> None:
        # one task per request: a slow password hash must not hold up the other logins
        task = asyncio.create_task(self._answer(msg))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _answer(self, msg: Message) -> None:
        try:
            request = self.verify_request(bytes(msg.data))
        except ValueError as exc:
            log.warning("auth callout: ignoring an invalid authorization request: %s", exc)
            return
        async with self._slots:
            try:
                perms = await self._check(request)
            except Exception:
                log.exception("auth callout: authenticate failed for %r", request.user)
                perms = None
        if perms is None:
            self.refused += 1
            # (debug: the authenticator logs refusals, rate-limited against floods)
            log.debug("auth callout: refused %r from %s", request.user, request.client_host)
            await self._conn.respond(msg, self.response(request, error="authentication failed"))
            return
        self.accepted += 1
        if self._on_admitted is not None:
            try:
                self._on_admitted(request)
            except Exception:  # a listener's fault must not cost the client its login
                log.exception("auth callout: the login listener failed for %r", request.user)
        await self._conn.respond(msg, self.response(request, permissions=perms))

    async def _check(self, request: CalloutRequest) -> Permissions | None:
        if not request.user or not request.password or not subjects.is_token(request.user):
            return None  # anonymous, or a user name that cannot be a client id
        return await self._authenticate(request.user, request.password)

    def verify_request(self, data: bytes) -> CalloutRequest:
        """Decode and check an authorization request JWT; ValueError if it is not one of ours."""
        claims = decode_jwt(data.decode("ascii", "replace"))
        nats = _mapping(claims.get("nats"))
        if nats.get("type") != "authorization_request":
            raise ValueError("not an authorization request")
        issuer = claims["iss"]
        if not natsconf.is_public_key(issuer, natsconf.PREFIX_SERVER):
            raise ValueError("request not signed by a server key")
        if _mapping(nats.get("server_id")).get("id") != issuer:
            raise ValueError("request signer is not the server it names")
        if self._server_ids is not None and issuer not in self._server_ids:
            raise ValueError(f"request from unknown server {issuer}")
        if claims.get("aud") != _REQUEST_AUDIENCE or claims.get("sub") != self._issuer.public_key:
            raise ValueError("request not addressed to this issuer")
        expires = claims.get("exp")
        if not isinstance(expires, int) or time.time() > expires + _LEEWAY:
            raise ValueError("request expired or without expiry")
        user_nkey = nats.get("user_nkey")
        if not isinstance(user_nkey, str) or not natsconf.is_public_key(
            user_nkey, natsconf.PREFIX_USER
        ):
            raise ValueError("request without a valid user nkey")
        opts = _mapping(nats.get("connect_opts"))
        info = _mapping(nats.get("client_info"))
        cid = info.get("id")
        return CalloutRequest(
            server_id=issuer,
            user_nkey=user_nkey,
            user=str(opts.get("user") or ""),
            password=str(opts.get("pass") or ""),
            client_name=str(opts.get("name") or ""),
            client_host=str(info.get("host") or ""),
            connection_id=cid if isinstance(cid, int) and not isinstance(cid, bool) else 0,
        )

    def response(
        self,
        request: CalloutRequest,
        *,
        permissions: Permissions | None = None,
        error: str = "",
    ) -> bytes:
        """The signed authorization response: a user JWT with ``permissions``, or ``error``."""
        body: dict[str, Any] = {"type": "authorization_response", "version": 2}
        if permissions is not None:
            body["jwt"] = self.user_jwt(request, permissions)
        else:
            body["error"] = error or "not authorized"
        claims = {"sub": request.user_nkey, "aud": request.server_id, "nats": body}
        return encode_jwt(claims, self._issuer).encode()

    def account_of(self, request: CalloutRequest, permissions: Permissions) -> str:
        """Where the login is placed: its permissions' account (else the callout's), or the
        clients' account when its connection name asks to join as a participant."""
        if request.client_name.endswith(PARTICIPANT_SUFFIX):
            return natsconf.CLIENT_ACCOUNT
        return permissions.account or self._account

    def user_jwt(self, request: CalloutRequest, permissions: Permissions) -> str:
        nats = {
            **permissions.claims(),
            "subs": -1,
            "data": -1,
            "payload": -1,
            "type": "user",
            "version": 2,
        }
        claims: dict[str, Any] = {
            "sub": request.user_nkey,
            # server-config mode: the account the client is placed in
            "aud": self.account_of(request, permissions),
            "name": request.user,
            "nats": nats,
        }
        if self._user_ttl is not None:
            claims["exp"] = int(time.time() + self._user_ttl)
        return encode_jwt(claims, self._issuer)
