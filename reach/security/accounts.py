"""What crosses between the fabric's two NATS accounts on a secured fabric.

Callers and agents live in an account without JetStream (``natsconf.CLIENT_ACCOUNT``);
JetStream, the registrar, the token issuer and the admins live in the fabric account
(``natsconf.APP_ACCOUNT``). A JetStream API request or a JetStream publish answers on
the reply subject its sender names, inside the account the request is served in and
with that account's rights; NATS permissions cannot restrict reply subjects. In the
fabric account a client could therefore have a stream store the answer (a direct get of
bytes it chose, answered on ``$KV.REACH_KEYS.pub.<kid>``: a signing key of its own) or
have the API run it as another request (a PubAck answered on
``$JS.API.STREAM.PURGE.<stream>``). Outside it, a client reaches the fabric account only
through the service imports listed here, and the server hands every answer back through
a one-time ``_R_.…`` mapping to the requester's reply subject *in the clients' account*,
where no stream and no JetStream API listens.

One service export carries every one of these imports (``">"``, open to the clients'
account only; it grants nothing beyond what the clients' account imports). An answer
delivered onto a reply subject that is itself one of these imports (an audit subject, a
job record's key, the token subject) would be forwarded into the fabric account as a new
request; nats-server drops a message that would pass through the export it already came
back through, and with a single export that is every one of them. The export's
responses are of the stream type: a batched direct get answers with several messages.

The other way, the fabric account imports the agents' probe subjects (the registrar and
``reach doctor`` probe agents) and their NATS micro discovery (``$SRV``: an admin's
``nats micro ls`` lists the agents too, every one of them answering), and the republished
changes of the public buckets reach
the clients' account as stream imports.

The clients' import of the token subject shares the requester (``share: true``): the
server stamps each token request with a ``Nats-Request-Info`` header naming the NATS user
that sent it, which is the client id (:func:`requester`), whatever the client wrote; the
issuer holds each client to a rate by it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from reach.transport.kvfollow import republish_prefix
from reach.wire import subjects

#: the end of the connection name of a login that joins the fabric as a participant (an
#: agent, a client): an admin's credential is then placed with the callers and agents,
#: whom it could not reach from the fabric account, rather than where JetStream is
PARTICIPANT_SUFFIX = "@clients"

__all__ = [
    "JS_ACCOUNT_INFO",
    "PARTICIPANT_SUFFIX",
    "REQUEST_INFO_HEADER",
    "RESPONSE_THRESHOLD",
    "SHARED_IMPORTS",
    "client_links",
    "client_service_imports",
    "client_stream_imports",
    "discovery_imports",
    "fabric_links",
    "fabric_service_imports",
    "jobs_read",
    "jobs_write",
    "js_read",
    "requester",
]

#: the JetStream account info (read-only: the account's usage and limits), asked by
#: standard clients before they open a bucket (nats.js ``js.views.kv()``, nats-py
#: ``js.account_info()``, the nats CLI): without it they report JetStream as missing
JS_ACCOUNT_INFO = "$JS.API.INFO"

#: how long the server keeps the mapping of a request's answer after its last answer
#: (a batched direct get answers with several messages, so a mapping outlives the first)
RESPONSE_THRESHOLD = "30s"


def js_read(bucket: str) -> list[str]:
    """What a reader of the public bucket publishes: open it, get a key, scan it, as any
    NATS client's key-value API does it (nats-py, nats.js, nats.go). No JetStream
    consumer (a client's ``kv.watch()`` and ``kv.keys()`` make one): changes arrive as
    the server republishes them, so a reader leaves no state on the server and points
    nothing anywhere."""
    stream = f"KV_{bucket}"
    return [
        f"$JS.API.STREAM.INFO.{stream}",  # open the bucket: read its config
        f"$JS.API.STREAM.MSG.GET.{stream}",  # get a key (answered by the stream leader)
        f"$JS.API.DIRECT.GET.{stream}",  # scan the bucket (batched direct gets)
        f"$JS.API.DIRECT.GET.{stream}.>",  # a key's last value (nats clients' kv get)
    ]


def jobs_read() -> list[str]:
    """The JetStream API a client with the jobs role may use on ``REACH_JOBS`` (its
    permissions narrow the gets to its own keys)."""
    stream = f"KV_{subjects.JOBS_BUCKET}"
    return [f"$JS.API.STREAM.INFO.{stream}", f"$JS.API.DIRECT.GET.{stream}.>"]


def jobs_write() -> str:
    """Where job records are put (an agent's permissions narrow it to its own jobs)."""
    return f"$KV.{subjects.JOBS_BUCKET}.job.>"


#: the header nats-server stamps on a request crossing a service import
REQUEST_INFO_HEADER = "Nats-Request-Info"
#: the imports of the clients' account whose requests name their sender's user
SHARED_IMPORTS = (subjects.TOKEN,)


def requester(headers: Mapping[str, str] | None) -> str | None:
    """The NATS user that sent a request through a sharing import, as the server stamped
    it in ``Nats-Request-Info`` (a client sets that header in vain: the server writes it
    over); None if there is none (a request from the fabric account, or through an import
    that does not share)."""
    if not headers:
        return None
    stamped = headers.get(REQUEST_INFO_HEADER)
    if not stamped:
        return None
    try:
        info = json.loads(stamped)
    except ValueError:
        return None
    user = info.get("user") if isinstance(info, dict) else None
    return user if isinstance(user, str) and user else None


def client_service_imports() -> list[str]:
    """The fabric account's subjects the clients' account imports as services: what a
    caller or an agent may ever send to the fabric's services and to JetStream. Each
    client's permissions then narrow them (audit under its own id, its own agent id)."""
    return [
        subjects.TOKEN,
        subjects.REGISTRAR_PING,
        subjects.ANNOUNCE_ALL,
        subjects.HEARTBEAT_ALL,
        subjects.BYE_ALL,
        subjects.AUDIT_ALL,  # audit batches, stored by REACH_AUDIT
        f"{subjects.PREFIX}.audited.>",  # their notices, read by the registrars' alert rules
        JS_ACCOUNT_INFO,
        *js_read(subjects.REGISTRY_BUCKET),
        *js_read(subjects.KEYS_BUCKET),
        *jobs_read(),
        jobs_write(),
    ]


def client_stream_imports() -> list[str]:
    """What the fabric account publishes that clients may hear: the republished changes
    of the registry, the signing keys and the job records (never the credentials)."""
    buckets = (subjects.REGISTRY_BUCKET, subjects.KEYS_BUCKET, subjects.JOBS_BUCKET)
    return [f"{republish_prefix(bucket)}.>" for bucket in buckets]


def fabric_service_imports() -> list[str]:
    """The clients' account's subjects the fabric account imports as services: the
    agents' probe subjects (the registrar's health probes, ``reach doctor``), and their
    NATS micro discovery (``$SRV``, answered by every agent: ``discovery_imports``)."""
    return [f"{subjects.PREFIX}.probe.*", *discovery_imports()]


def discovery_imports() -> list[str]:
    """The imports of the fabric account that many agents answer at once (``$SRV``)."""
    return [f"{subjects.SRV_PREFIX}.>"]


# -- the accounts' blocks of the nats-server config ------------------------------------------


def _q(text: str) -> str:
    return json.dumps(text)


def _links(exports: list[str], imports: list[str]) -> str:
    pad = "    "
    return (
        f"{pad}exports: [\n{pad}  "
        + f",\n{pad}  ".join(exports)
        + f"\n{pad}]\n"
        + (f"{pad}imports: [\n{pad}  " + f",\n{pad}  ".join(imports) + f"\n{pad}]")
    )


def fabric_links(fabric: str, clients: str) -> str:
    """The exports and imports of the fabric account (named ``fabric``): one service
    export for every import of the clients' account, the public buckets' changes, and
    the probes it sends to the agents."""
    to_clients = f"accounts: [ {clients} ]"
    exports = [
        f'{{ service: ">", {to_clients}, response_type: "stream",'
        f" response_threshold: {_q(RESPONSE_THRESHOLD)} }}"
    ]
    exports += [f"{{ stream: {_q(s)}, {to_clients} }}" for s in client_stream_imports()]
    imports = [
        f"{{ service: {{ account: {clients}, subject: {_q(s)} }} }}"
        for s in fabric_service_imports()
    ]
    return _links(exports, imports)


def client_links(fabric: str, clients: str) -> str:
    """The exports and imports of the clients' account: what it imports from the fabric
    account, and the agents' probe subjects it exports to it."""
    many = discovery_imports()
    exports = [
        f"{{ service: {_q(s)}, accounts: [ {fabric} ]"
        + (
            f', response_type: "stream", response_threshold: {_q(RESPONSE_THRESHOLD)}'
            if s in many
            else ""
        )
        + " }"
        for s in fabric_service_imports()
    ]
    imports = [
        f"{{ service: {{ account: {fabric}, subject: {_q(s)} }}"
        + (", share: true" if s in SHARED_IMPORTS else "")
        + " }"
        for s in client_service_imports()
    ]
    imports += [
        f"{{ stream: {{ account: {fabric}, subject: {_q(s)} }} }}" for s in client_stream_imports()
    ]
    return _links(exports, imports)
