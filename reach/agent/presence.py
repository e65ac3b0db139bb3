"""An agent's presence in the registry: its announce, its heartbeats, its answers to the
registrar's probes, and its goodbye.

The announce carries the manifest and is retried with back-off until a registrar
answers; a heartbeat goes out every ``health.interval_sec`` (at once after a reconnect:
the registrar may have evicted the instance meanwhile, and its answer then asks for a
new announce); a probe is answered with the instance's load and readiness.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import resource
import secrets
import time
from collections.abc import Awaitable, Callable

from reach.agent.serving import CallServer
from reach.clock import Clock
from reach.errors import (
    ClearanceExceeded,
    DiscoveryError,
    NoResponders,
    ReachError,
    ReachTimeout,
    RegistrationRefused,
)
from reach.security.membership import FabricSecurity
from reach.transport import Connection, Message
from reach.wire import envelope, subjects
from reach.wire.modelcodec import decode_model, encode_model
from reach.wire.models import (
    FEATURES,
    AnnounceReply,
    AnnounceRequest,
    Bye,
    Heartbeat,
    HeartbeatReply,
    Manifest,
    ProbeReply,
    Readiness,
)

__all__ = ["Presence"]

log = logging.getLogger("reach.agent.agent")


def _memory_bytes() -> int:
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _refusal(reply: envelope.Reply, agent_id: str) -> RegistrationRefused:
    """The error of an announce the registrar answered with an error: ClearanceExceeded
    for ``denied``/``above_clearance:<capability>:<level>:<held>``, else
    RegistrationRefused."""
    name, _, args = reply.code.partition(":")
    parts = args.split(":")
    if (
        reply.kind == "denied"
        and name == "above_clearance"
        and len(parts) == 3
        and parts[1].isdigit()
        and parts[2].isdigit()
    ):
        return ClearanceExceeded(
            reply.description,
            capability=parts[0],
            security_level=int(parts[1]),
            clearance=int(parts[2]),
            agent_id=agent_id,
        )
    return RegistrationRefused(f"{reply.kind}: {reply.description}", agent_id=agent_id)


class Presence:
    """How one agent instance is known to the registry.

    ``manifest``, ``conn``, ``security`` and ``started_at`` are the agent's, set as it
    starts; ``server`` says how loaded the instance is and ``readiness`` how ready."""

    def __init__(
        self,
        manifest: Manifest,
        instance_id: str,
        server: CallServer,
        readiness: Callable[[], Awaitable[Readiness]],
        clock: Clock,
        announce_timeout: float,
    ) -> None:
        self.manifest = manifest
        self.instance_id = instance_id
        self.conn: Connection | None = None
        self.security = FabricSecurity()
        self.started_at = 0.0
        #: set on a reconnect: the next heartbeat goes out at once (and re-announces)
        self.wake = asyncio.Event()
        self._server = server
        self._readiness = readiness
        self._clock = clock
        self._announce_timeout = announce_timeout
        self._seq = 0

    @property
    def agent_id(self) -> str:
        return self.manifest.agent_id

    @property
    def connection(self) -> Connection:
        if self.conn is None:
            raise RuntimeError("the agent is not running: use `async with agent:` first")
        return self.conn

    def control_request(self, body: bytes) -> bytes:
        """A request to the fabric's services, under the agent's fabric token."""
        meta = envelope.RequestMeta(
            call_id=secrets.token_hex(8), caller=self.agent_id, token=self.security.token()
        )
        return envelope.pack_request(meta, body)

    async def announce(self) -> None:
        """Announce the manifest until a registrar answers (DiscoveryError after
        ``announce_timeout``); RegistrationRefused if it refuses (ClearanceExceeded for a
        capability above the clearance of the agent's credential)."""
        request = AnnounceRequest(
            manifest=self.manifest,
            instance_id=self.instance_id,
            started_at=self.started_at,
            readiness=await self._readiness(),
            features=list(FEATURES),
        )
        data = self.control_request(encode_model(request))
        deadline = time.monotonic() + self._announce_timeout
        delay = 0.05
        while True:
            # while away, wait for the connection rather than leave announces in its buffer
            await self.connection.wait_connected(max(0.0, deadline - time.monotonic()))
            # no await inside the except block: compiled by mypyc, an await there loses
            # track of which exception is being handled (nats-py's own escaped)
            try:
                raw = await self.connection.request(
                    subjects.announce(self.agent_id), data, timeout=2.0
                )
                break
            except (NoResponders, ReachTimeout) as exc:
                failure: ReachError = exc
            if time.monotonic() + delay > deadline:
                raise DiscoveryError(
                    f"no registrar answered the announce of {self.agent_id} within"
                    f" {self._announce_timeout:.0f}s ({type(failure).__name__}):"
                    " is `reach up` running?"
                ) from failure
            await asyncio.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, 1.0)
        reply = envelope.unpack_reply(raw)
        if not reply.ok:
            raise _refusal(reply, self.agent_id)
        answer = decode_model(AnnounceReply, reply.body)
        if not answer.accepted:
            raise RegistrationRefused(answer.reason, agent_id=self.agent_id)

    async def heartbeat_loop(self) -> None:
        """Heartbeats until the agent stops (this task is cancelled)."""
        health = self.manifest.health
        while self.conn is not None:
            # the interval, or at once after a reconnect: the registrar may have evicted
            # this instance while it was away, and the heartbeat's answer says so
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    self.wake.wait(), health.interval_sec * random.uniform(0.9, 1.0)
                )
            self.wake.clear()
            if not self.connection.is_connected:
                # sent now it would wait in the client's buffer and reach the registrar
                # with every other one sent while away, stale and over the agent's budget
                # (reach.registry.controlbudget); the reconnect wakes this loop
                continue
            try:
                await self.send_heartbeat()
            except asyncio.CancelledError:
                raise
            except RegistrationRefused as exc:
                # forgotten and announced again, refused: no calls are routed here now
                log.warning("%s is not registered: %s", self.agent_id, exc)
            except ReachError as exc:
                log.debug("heartbeat of %s failed: %s", self.agent_id, exc)
            except Exception:
                log.exception("heartbeat of %s failed", self.agent_id)

    async def send_heartbeat(self) -> None:
        """One heartbeat, and what its answer asks (a new announce, if forgotten)."""
        self._seq += 1
        server = self._server
        hb = Heartbeat(
            agent_id=self.agent_id,
            instance_id=self.instance_id,
            seq=self._seq,
            sent_at=self._clock.time(),
            in_flight=server.in_flight,
            max_concurrency=self.manifest.max_concurrency,
            last_completion_at=server.last_completion_at,
            completed=server.completed,
            memory_bytes=_memory_bytes(),
            readiness=await self._readiness(),
        )
        raw = await self.connection.request(
            subjects.heartbeat(self.agent_id),
            self.control_request(encode_model(hb)),
            timeout=self.manifest.health.timeout_sec,
        )
        reply = envelope.unpack_reply(raw)
        if not reply.ok:
            log.warning("registrar rejected heartbeat of %s: %s", self.agent_id, reply.description)
            return
        answer = decode_model(HeartbeatReply, reply.body)
        if answer.reannounce:
            log.info("registrar forgot %s (%s); announcing again", self.agent_id, answer.reason)
            await self.announce()
        elif not answer.ok:
            log.warning("registrar refused heartbeat of %s: %s", self.agent_id, answer.reason)

    async def on_probe(self, msg: Message) -> None:
        """The answer to the registrar's probe: load and readiness."""
        server = self._server
        reply = ProbeReply(
            agent_id=self.agent_id,
            instance_id=self.instance_id,
            in_flight=server.in_flight,
            max_concurrency=self.manifest.max_concurrency,
            last_completion_at=server.last_completion_at,
            completed=server.completed,
            readiness=await self._readiness(),
        )
        await self.connection.respond(msg, envelope.pack_ok(encode_model(reply), self.agent_id))

    async def bye(self) -> None:
        """Tell the registrar this instance is leaving (best effort)."""
        with contextlib.suppress(ReachError):
            bye = Bye(agent_id=self.agent_id, instance_id=self.instance_id)
            await self.connection.request(
                subjects.bye(self.agent_id), self.control_request(encode_model(bye)), timeout=2.0
            )
