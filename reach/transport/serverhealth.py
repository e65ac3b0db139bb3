"""The servers' own word on their health, and what it says of their JetStream store.

Every nats-server answers ``$SYS.REQ.SERVER.PING.HEALTHZ`` (its system account's
requests) with the health its monitoring endpoint ``/healthz`` reports. That is where a
server says that its store takes no writes:

* a single server whose write to a stream's store failed (``no space left on device``)
  keeps JetStream on, but that stream refuses every later write, without an answer to
  the publisher, until the stream is opened again (a restart of the server); its health
  reports the stream's write error meanwhile;
* a server of a cluster disables JetStream when its store runs out of space ("JetStream
  out of resources, will be DISABLED"), and reports "JetStream not enabled" until it is
  started again.

So a publisher only sees its writes go unanswered; ``reach up`` and the registrar part
read the reason here (``store_problem``), with the system account's user of a fabric with
logins (``reach.security.natsconf``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass
from typing import Any

from reach.transport.connection import Connection, Message

__all__ = ["HEALTHZ", "ServerHealth", "parse_health", "server_health", "store_problem"]

#: every server of the system account's servers answers it
HEALTHZ = "$SYS.REQ.SERVER.PING.HEALTHZ"


@dataclass(frozen=True, slots=True)
class ServerHealth:
    """One server's answer: its name and id, and every error its health reports."""

    name: str
    server_id: str
    errors: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.errors


def parse_health(data: bytes) -> ServerHealth | None:
    """A server's answer to ``HEALTHZ`` (None if it is not one)."""
    try:
        answer: Any = json.loads(data)
        server, health = answer["server"], answer["data"]
        name, server_id = str(server.get("name", "")), str(server.get("id", ""))
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
    if not isinstance(health, dict):
        return None
    errors: list[str] = []
    if health.get("error"):
        errors.append(str(health["error"]))
    for item in health.get("errors") or ():
        text = item.get("error") if isinstance(item, dict) else None
        if text and str(text) not in errors:
            errors.append(str(text))
    if not errors and health.get("status") not in (None, "ok"):
        errors.append(f"status {health.get('status')}")
    return ServerHealth(name, server_id, tuple(errors))


async def server_health(
    conn: Connection, *, expect: int = 1, timeout: float = 1.0
) -> list[ServerHealth]:
    """The answers of the servers reachable through ``conn`` (a system account user's
    connection) within ``timeout`` seconds, sooner once ``expect`` have answered."""
    answers: list[ServerHealth] = []
    enough = asyncio.Event()

    async def collect(msg: Message) -> None:
        health = parse_health(msg.data)
        if health is not None:
            answers.append(health)
            if len(answers) >= expect:
                enough.set()

    inbox = conn.new_inbox()
    sub = await conn.subscribe(inbox, collect)
    try:
        # every error, not only the first one the server finds
        await conn.publish(HEALTHZ, b'{"details": true}', reply=inbox)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(enough.wait(), timeout)
    finally:
        await sub.unsubscribe()
    return answers


def store_problem(health: ServerHealth) -> str | None:
    """What ``health`` says of the server's JetStream store, worded for an operator (the
    server's name first); None when it says nothing of it."""
    for error in health.errors:
        lowered = error.lower()
        if "no space left" in lowered:
            return f"{health.name}: out of disk space ({error})"
        if "jetstream not enabled" in lowered:
            return (
                f"{health.name}: JetStream disabled by the server (it disables it after a"
                " store error, a full disk above all)"
            )
        if "write error" in lowered:
            return f"{health.name}: {error}"
    return None
