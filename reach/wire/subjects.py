"""Subject, bucket and stream names: the wire contract (docs/architecture.md, "Subjects,
buckets and streams"; the messages in schemas/)."""

from __future__ import annotations

import re

PREFIX = "reach.v1"

REGISTRY_BUCKET = "REACH_REGISTRY"
CREDENTIALS_BUCKET = "REACH_CREDENTIALS"
KEYS_BUCKET = "REACH_KEYS"
JOBS_BUCKET = "REACH_JOBS"
AUDIT_STREAM = "REACH_AUDIT"
ALERTS_STREAM = "REACH_ALERTS"

#: queue group shared by every registrar, so each announce/heartbeat is handled once
REGISTRAR_QUEUE = "reach-registrar"

ANNOUNCE_ALL = f"{PREFIX}.announce.*"
HEARTBEAT_ALL = f"{PREFIX}.hb.*"
BYE_ALL = f"{PREFIX}.bye.*"
#: heartbeats split by agent id into this many partitions, each handled by one registrar
HEARTBEAT_PARTITIONS = 128
#: where nats-server's subject mapping puts a heartbeat published on ``heartbeat(agent_id)``:
#: ``reach.v1.hbp.<partition>.<agent_id>``, the partition an FNV-1a hash of the agent id
#: (``reach.registry.partitions``); agents publish on ``reach.v1.hb.<agent_id>`` as ever
HEARTBEAT_PARTITION_PREFIX = f"{PREFIX}.hbp"
#: the mapping every server config reach writes carries (source → destination)
HEARTBEAT_MAPPING = (
    HEARTBEAT_ALL,
    f"{HEARTBEAT_PARTITION_PREFIX}.{{{{partition({HEARTBEAT_PARTITIONS},1)}}}}.{{{{wildcard(1)}}}}",
)
TOKEN = f"{PREFIX}.auth.token"
#: an admin asks the issuer for a new signing key
KEY_ROTATE = f"{PREFIX}.auth.rotate"
#: every registrar answers here (not a queue group): liveness for tools and for itself
REGISTRAR_PING = f"{PREFIX}.registrar.ping"

#: where an agent may publish its replies on a secured fabric: the call-reply subjects of a
#: client's inbox, ``_INBOX.<client_id>.r.<base>.<token>`` (see ``reach.transport.mux``), and no
#: other subject of anyone's inbox
CALL_REPLIES = "_INBOX.*.r.*.*"
#: the one-time reply subjects nats-server gives a request that crossed from one account
#: to another through a service import (an agent's probes come so from the registrar)
SERVICE_REPLIES = "_R_.>"

#: NATS micro services' control subjects (``$SRV.<verb>[.<name>[.<id>]]``): every agent
#: answers PING, INFO and STATS as a micro service (``reach.agent.microsvc``)
SRV_PREFIX = "$SRV"
SRV_VERBS = ("PING", "INFO", "STATS")
#: where an agent may publish its answers to ``$SRV`` requests on a secured fabric: the
#: discovery space of a client's inbox, ``_INBOX.<client_id>.srv.…`` (a tool that lists
#: the fabric's services connects with the inbox prefix ``_INBOX.<client_id>.srv``), and no
#: other subject of anyone's inbox
SRV_REPLIES = "_INBOX.*.srv.>"

#: registry keys: instances under ``agent.``, live registrars under ``registrar.``
AGENT_KEY_PREFIX = "agent."
REGISTRAR_KEY_PREFIX = "registrar."


#: what may stand for one token of a subject: an agent id, a capability name, a feature
TOKEN_RE = re.compile(r"^[A-Za-z0-9_-]{1,128}$")


def is_token(name: str) -> bool:
    """Whether ``name`` can be one token of a subject (no dots, spaces, wildcards)."""
    return TOKEN_RE.fullmatch(name) is not None  # "$" alone would let a final newline by


def announce(agent_id: str) -> str:
    return f"{PREFIX}.announce.{agent_id}"


def heartbeat(agent_id: str) -> str:
    return f"{PREFIX}.hb.{agent_id}"


def heartbeat_partition(partition: int, agent_id: str = "*") -> str:
    """A heartbeat in its partition (``agent_id="*"``: every heartbeat of the partition)."""
    return f"{HEARTBEAT_PARTITION_PREFIX}.{partition}.{agent_id}"


def bye(agent_id: str) -> str:
    return f"{PREFIX}.bye.{agent_id}"


def probe(agent_id: str) -> str:
    return f"{PREFIX}.probe.{agent_id}"


def capability(name: str) -> str:
    """Any instance of the capability (queue group)."""
    return f"{PREFIX}.cap.{name}"


def capability_instance(name: str, agent_id: str) -> str:
    """One chosen instance of the capability."""
    return f"{PREFIX}.cap.{name}.{agent_id}"


#: the writer token of audit subjects on an open fabric (no credentials: nobody to name);
#: never a client id (``reach creds add`` refuses it), so no caller can write as it
ANONYMOUS = "anonymous"
#: every audit batch, of any capability and writer (REACH_AUDIT's subjects)
AUDIT_ALL = f"{PREFIX}.audit.>"


def audit(capability_name: str, writer: str) -> str:
    """Where ``writer`` (its NATS user: client id, ``reach-registrar`` or ``ANONYMOUS``)
    stores a batch of the capability's events. The server lets each client publish only
    under its own id, so readers take the writer from here, never from the batch."""
    return f"{PREFIX}.audit.{capability_name}.{writer}"


def audited(capability_name: str, writer: str) -> str:
    """Core NATS, not stored: "REACH_AUDIT now holds a batch of this capability", with
    the batch's stream sequence and summary (what the registrars' alert rules read),
    under the same writer token as the batch."""
    return f"{PREFIX}.audited.{capability_name}.{writer}"


def writer_of(subject: str) -> str:
    """The writer token of an audit or notice subject; "" for a subject without one (a
    batch stored before subjects named their writer) or not of that shape."""
    tokens = subject.split(".")
    if len(tokens) != 5 or f"{tokens[0]}.{tokens[1]}" != PREFIX:
        return ""
    if tokens[2] not in ("audit", "audited"):
        return ""
    return tokens[4] if is_token(tokens[4]) else ""


def writer_token(user: str | None) -> str:
    """The writer token for a connection logged in as ``user`` (None: an open fabric)."""
    return user if user is not None and is_token(user) else ANONYMOUS


def alert(rule: str) -> str:
    return f"{PREFIX}.alert.{rule}"


def last_token(subject: str) -> str:
    return subject.rsplit(".", 1)[-1]


def agent_key(agent_id: str) -> str:
    return AGENT_KEY_PREFIX + agent_id


def registrar_key(registrar_id: str) -> str:
    return REGISTRAR_KEY_PREFIX + registrar_id


def srv(verb: str, name: str | None = None, service_id: str | None = None) -> str:
    """A NATS micro control subject: every service (no name), every instance of a service
    (a name), or one instance (a name and its id)."""
    if name is None:
        return f"{SRV_PREFIX}.{verb}"
    if service_id is None:
        return f"{SRV_PREFIX}.{verb}.{name}"
    return f"{SRV_PREFIX}.{verb}.{name}.{service_id}"
