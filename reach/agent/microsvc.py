"""An agent as a NATS micro service: ``$SRV.PING``, ``$SRV.INFO`` and ``$SRV.STATS``.

Standard NATS tooling (``nats micro ls|info|stats``, nats.js's service client, any client
that gathers answers on ``$SRV.<verb>``) finds the fabric's agents this way. Each agent
answers every verb on the three subjects the NATS micro protocol defines: every service
(``$SRV.PING``), every instance of its name (``$SRV.PING.<name>``) and itself
(``$SRV.PING.<name>.<id>``). The answers are the protocol's JSON documents:

- the service ``name`` is the agent's ``agent_name`` (a subject token, so already in
  micro's alphabet ``[A-Za-z0-9_-]``; anything else would become ``_``), its ``id`` the
  ``agent_id`` (one per live instance), its ``version`` the manifest's (semver, as micro
  requires; one that is not would read ``0.0.0``);
- its endpoints are the capabilities: subject ``reach.v1.cap.<capability>``, queue group
  ``<capability>``, and metadata (strings, as micro requires) with the description, the
  input and output JSON Schemas as JSON text, and the security level;
- the statistics are those the call path counts as it serves (``ServedStats``): every call
  received (each of a batch, the refused ones too), those answered with an error of any
  kind, the last error, and the time spent on the calls that ran.

The three verbs are answered on small subscriptions of their own, never on the call path,
and calls go only through the capability subjects (``reach.agent.serving``): a micro service
here describes what is served, it serves nothing itself.
"""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from typing import Any

from reach.agent.endpoint import Endpoint
from reach.transport import Connection, Handler, Message, Subscription
from reach.wire import subjects
from reach.wire.models import Manifest

__all__ = [
    "INFO_TYPE",
    "PING_TYPE",
    "STATS_TYPE",
    "MicroService",
    "service_name",
    "service_version",
]

PING_TYPE = "io.nats.micro.v1.ping_response"
INFO_TYPE = "io.nats.micro.v1.info_response"
STATS_TYPE = "io.nats.micro.v1.stats_response"

_NOT_NAME = re.compile(r"[^A-Za-z0-9_-]")
#: semantic versioning 2.0.0, as NATS micro checks a service's version
_SEMVER = re.compile(
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-((?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(?:\.(?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*))?"
    r"(?:\+([0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*))?$"
)


def service_name(agent_name: str) -> str:
    """The micro service name of an agent: its name, each character micro does not allow
    in a name (``[A-Za-z0-9_-]``) replaced by ``_``."""
    return _NOT_NAME.sub("_", agent_name) or "_"


def service_version(version: str) -> str:
    """The micro service version of an agent: its manifest's (semver already), else
    ``0.0.0``."""
    return version if _SEMVER.fullmatch(version) else "0.0.0"


def _timestamp(unix: float) -> str:
    """RFC 3339 in UTC with milliseconds, as NATS micro writes ``started``."""
    moment = datetime.fromtimestamp(unix, tz=UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def _json(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def _endpoint_metadata(endpoint: Endpoint) -> dict[str, str]:
    cap = endpoint.capability
    return {
        "description": cap.description,
        "input_schema": json.dumps(cap.input_schema, separators=(",", ":"), sort_keys=True),
        "output_schema": json.dumps(cap.output_schema, separators=(",", ":"), sort_keys=True),
        "security_level": str(cap.security_level),
        "mode": "async" if endpoint.job else "sync",
    }


class MicroService:
    """The ``$SRV`` side of one agent instance: what it answers, and its subscriptions."""

    def __init__(self, manifest: Manifest, endpoints: list[Endpoint], started_at: float) -> None:
        self.name = service_name(manifest.agent_name)
        self.id = manifest.agent_id
        self.version = service_version(manifest.version)
        self.started_at = started_at
        self.metadata = {
            "agent_name": manifest.agent_name,
            "manifest_version": manifest.version,
            "mode": manifest.mode,
        }
        self._endpoints = endpoints
        self._subs: list[Subscription] = []
        # the identity and the endpoints do not change while it runs: packed once
        self._ping = _json(self._identity(PING_TYPE))
        self._info = _json(self.info())

    def _identity(self, kind: str) -> dict[str, Any]:
        return {
            "type": kind,
            "name": self.name,
            "id": self.id,
            "version": self.version,
            "metadata": self.metadata,
        }

    def subjects(self) -> list[tuple[str, str]]:
        """(verb, subject) of every control subject it answers on."""
        return [
            (verb, subject)
            for verb in subjects.SRV_VERBS
            for subject in (
                subjects.srv(verb),
                subjects.srv(verb, self.name),
                subjects.srv(verb, self.name, self.id),
            )
        ]

    def ping(self) -> dict[str, Any]:
        return self._identity(PING_TYPE)

    def info(self) -> dict[str, Any]:
        endpoints = [
            {
                "name": e.name,
                "subject": subjects.capability(e.name),
                "queue_group": e.name,
                "metadata": _endpoint_metadata(e),
            }
            for e in self._endpoints
        ]
        description = f"Agent-Reach agent {self.metadata['agent_name']}"
        return self._identity(INFO_TYPE) | {"description": description, "endpoints": endpoints}

    def stats(self) -> dict[str, Any]:
        endpoints = []
        for e in self._endpoints:
            s = e.stats
            total_ns = int(s.busy_sec * 1e9)
            endpoints.append(
                {
                    "name": e.name,
                    "subject": subjects.capability(e.name),
                    "queue_group": e.name,
                    "num_requests": s.requests,
                    "num_errors": s.errors,
                    "last_error": f"{s.last_code}: {s.last_description}" if s.last_code else "",
                    "processing_time": total_ns,
                    "average_processing_time": total_ns // s.requests if s.requests else 0,
                    "data": {"denied": s.denied},
                }
            )
        started = {"started": _timestamp(self.started_at), "endpoints": endpoints}
        return self._identity(STATS_TYPE) | started

    def answer(self, verb: str) -> bytes:
        """The JSON answer to ``verb`` (PING, INFO or STATS)."""
        if verb == "PING":
            return self._ping
        if verb == "INFO":
            return self._info
        return _json(self.stats())

    async def start(self, conn: Connection) -> None:
        """Answer the three verbs on ``conn`` (the caller flushes)."""
        await self.stop()
        for verb, subject in self.subjects():
            self._subs.append(await conn.subscribe(subject, self._answerer(conn, verb)))

    def _answerer(self, conn: Connection, verb: str) -> Handler:
        async def on_request(msg: Message) -> None:
            if msg.reply:
                await conn.respond(msg, self.answer(verb))

        return on_request

    async def stop(self) -> None:
        for sub in self._subs:
            await sub.unsubscribe()
        self._subs.clear()
