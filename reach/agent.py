"""The agent SDK: announce a manifest, keep heartbeating, answer probes, serve calls.

::

    agent = Agent.from_yaml("agent.yaml")

    @agent.capability("generate_industry_report")
    async def generate(req: dict) -> dict: ...

    async with agent:
        await agent.serve_forever()
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import logging
import os
import random
import resource
import secrets
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar, cast

import yaml

from reach import envelope, subjects
from reach.audit.events import denial_event
from reach.audit.writer import AuditWriter
from reach.clock import Clock, system_clock
from reach.context import set_current
from reach.errors import (
    CodecError,
    ConfigurationError,
    DiscoveryError,
    LoginUnanswered,
    NoResponders,
    ReachError,
    ReachTimeout,
    RegistrationRefused,
)
from reach.jobs import JobStore
from reach.joining import run_step
from reach.messages import decode_model, encode_model
from reach.models import (
    FEATURES,
    AnnounceReply,
    AnnounceRequest,
    Bye,
    Heartbeat,
    HeartbeatReply,
    Manifest,
    ProbeReply,
    Readiness,
    parse_manifest,
)
from reach.security.credentials import CredentialsFile
from reach.security.fabric import FabricSecurity, connect_as
from reach.security.tokens import call_audience
from reach.serving import REPLY_FRAMING, CallServer, Endpoint, endpoint_for
from reach.settings import resolve_credentials, resolve_servers
from reach.tasks import cancel_and_wait, run_eagerly
from reach.telemetry import Telemetry, trace_id_of
from reach.transport import Connection, Message, ReplyBatch, Subscription

__all__ = ["Agent", "ReadinessCheck", "load_manifest"]

log = logging.getLogger("reach.agent")

Handler = Callable[[Any], Awaitable[Any]]
ReadinessCheck = Callable[[], "Readiness | bool | Awaitable[Readiness | bool]"]
H = TypeVar("H", bound=Handler)


def load_manifest(path: str | os.PathLike[str]) -> Manifest:
    """Read and validate a YAML manifest; ConfigurationError lists every problem."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigurationError(f"cannot read manifest {path}: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigurationError(f"{path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigurationError(f"{path}: a manifest must be a YAML mapping")
    return parse_manifest(data, source=str(path))


def _memory_bytes() -> int:
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Agent:
    """One agent instance: its manifest, its handlers, and its life on the fabric."""

    def __init__(
        self,
        manifest: Manifest | dict[str, Any],
        *,
        servers: str | list[str] | None = None,
        credentials: str | os.PathLike[str] | None = None,
        readiness: ReadinessCheck | None = None,
        clock: Clock = system_clock,
        announce_timeout: float = 10.0,
        join_timeout: float = 30.0,
        drain_timeout: float = 10.0,
        verify_tokens: bool = True,
        audit: bool = True,
        telemetry: Telemetry | None = None,
    ) -> None:
        self.manifest = manifest if isinstance(manifest, Manifest) else parse_manifest(manifest)
        self.credentials = resolve_credentials(credentials)
        self.servers = resolve_servers(servers, self.credentials)
        self.instance_id = uuid.uuid4().hex
        self._readiness_check = readiness
        self._clock = clock
        self._announce_timeout = announce_timeout
        #: how long ``start`` retries a step of joining that failed for a transient reason
        self._join_timeout = join_timeout
        #: set on a reconnect: the next heartbeat goes out at once (and re-announces)
        self._wake = asyncio.Event()
        self._drain_timeout = drain_timeout
        #: False only to measure the token check's cost (bench): calls are then not checked
        self._verify_tokens = verify_tokens
        self._conn: Connection | None = None
        self._cap_subs: list[Subscription] = []
        self._probe_sub: Subscription | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._stopped = asyncio.Event()
        self._accepting = False
        self._started_at = 0.0
        self._seq = 0
        self._endpoints: dict[str, Endpoint] = {}
        self._server = CallServer(
            self.agent_id,
            max_concurrency=self.manifest.max_concurrency,
            clock=clock,
            is_ready=self._ready_now,
        )
        self._readiness = Readiness()
        self._security = FabricSecurity()
        #: denials of calls are written to REACH_AUDIT by this side (the side that denied)
        self._audit_enabled = audit
        self.audit: AuditWriter | None = None
        self.telemetry = telemetry or Telemetry()
        if self.telemetry.metrics_on or self.telemetry.tracing_on:
            self._server.telemetry = self.telemetry
        self._readiness_at = 0.0
        self._refresh: asyncio.Task[Readiness] | None = None

    @property
    def in_flight(self) -> int:
        """Calls being handled right now."""
        return self._server.in_flight

    @property
    def completed(self) -> int:
        return self._server.completed

    @property
    def last_completion_at(self) -> float | None:
        return self._server.last_completion_at

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str], **kwargs: Any) -> Agent:
        """An agent from its ``agent.yaml``; keyword arguments as for ``Agent(...)``."""
        return cls(load_manifest(path), **kwargs)

    @property
    def agent_id(self) -> str:
        return self.manifest.agent_id

    @property
    def connection(self) -> Connection:
        if self._conn is None:
            raise RuntimeError("the agent is not running: use `async with agent:` first")
        return self._conn

    # -- registration of handlers -----------------------------------------------------

    def capability(self, name: str) -> Callable[[H], H]:
        """Register the handler of a capability declared in the manifest."""
        if self.manifest.capability(name) is None:
            declared = ", ".join(c.name for c in self.manifest.capabilities) or "none"
            raise ConfigurationError(
                f"capability {name!r} is not in the manifest of {self.agent_id}"
                f" (declared: {declared})"
            )

        def register(func: H) -> H:
            if not inspect.iscoroutinefunction(cast(Any, func)):
                raise ConfigurationError(f"the handler of {name!r} must be an async function")
            declared = self.manifest.capability(name)
            assert declared is not None
            endpoint = endpoint_for(declared, func)
            self._endpoints[name] = endpoint
            if endpoint.capability != declared:
                # schemas derived from the handler's pydantic models travel in the manifest
                caps = [
                    endpoint.capability if c.name == name else c for c in self.manifest.capabilities
                ]
                self.manifest = self.manifest.model_copy(update={"capabilities": caps})
            return func

        return register

    def readiness(self, check: ReadinessCheck) -> ReadinessCheck:
        """Register the business readiness check (decorator form of ``readiness=``)."""
        self._readiness_check = check
        return check

    # -- life cycle -------------------------------------------------------------------

    async def __aenter__(self) -> Agent:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        """Join the fabric: connect and log in, token session and key follow, audit
        writer, job store, announce, subscriptions. A step that fails for a transient
        reason (a timeout, a lost connection, a login no gate answered) is tried again
        until ``join_timeout``; the error that ends ``start`` names the step."""
        missing = [c.name for c in self.manifest.capabilities if c.name not in self._endpoints]
        if missing:
            raise ConfigurationError(f"no handler registered for: {', '.join(missing)}")
        self._stopped.clear()
        self._started_at = self._clock.time()
        deadline = time.monotonic() + self._join_timeout
        conn, creds = await run_step(
            self.agent_id,
            "connect and log in to NATS",
            deadline,
            lambda: connect_as(
                self.servers, name=f"agent:{self.agent_id}", credentials=self.credentials
            ),
            (LoginUnanswered,),
        )
        self._conn = conn
        conn.on_reconnect(self._wake.set)
        failure: BaseException | None = None
        try:
            await self._join(creds, deadline)
        except BaseException as exc:  # no await in here: compiled, it would leak the error
            failure = exc
        if failure is not None:
            # whatever started is stopped: audit writer, token session, connection
            if self.audit is not None:
                await self.audit.stop(timeout=1.0)
                self.audit = None
            await self._security.close()
            await conn.close()
            self._conn = None
            raise failure
        self._accepting = True
        self._heartbeat_task = asyncio.create_task(self._heartbeat_loop(), name="heartbeat")
        log.info("agent %s serving %d capabilities", self.agent_id, len(self._endpoints))

    async def _join(self, creds: CredentialsFile | None, deadline: float) -> None:
        """Token session and key follow, audit writer, job store, announce, then
        subscriptions."""
        conn = self.connection
        self._security = await run_step(
            self.agent_id,
            "token session and key follow (REACH_KEYS)",
            deadline,
            lambda: FabricSecurity.join(conn, creds, verify=self._verify_tokens, clock=self._clock),
        )
        self._server.verifier = self._security.verifier
        self._server.max_reply_bytes = conn.max_payload - REPLY_FRAMING
        if self._audit_enabled:
            self.audit = AuditWriter(conn, servers=self.servers)
            await run_step(self.agent_id, "audit writer (REACH_AUDIT)", deadline, self.audit.start)
            self._server.on_denied = self._audit_denial
        if self.manifest.mode == "async":
            self._server.jobs = await run_step(
                self.agent_id, "job store (REACH_JOBS)", deadline, lambda: self._open_jobs(conn)
            )
        await run_step(self.agent_id, "announce", deadline, self._announce, ())
        # Probe and call subscriptions only once accepted: a refused duplicate never
        # answers for the live instance.
        await run_step(self.agent_id, "subscribe", deadline, self._subscribe)

    async def _open_jobs(self, conn: Connection) -> JobStore:
        try:
            return await JobStore.open(conn)
        except ConfigurationError:
            raise ConfigurationError(
                f"{self.agent_id} runs in async mode but the REACH_JOBS bucket does"
                " not exist: is `reach up` running?"
            ) from None

    async def _subscribe(self) -> None:
        conn = self.connection
        for sub in self._cap_subs:  # a failed attempt before leaves none behind
            await sub.unsubscribe()
        self._cap_subs.clear()
        for name, endpoint in self._endpoints.items():
            # each subject takes the tokens made for it: on its own subject this
            # instance's, on the queue group's the capability's (see call_audience)
            queue = self._call_handler(dataclasses.replace(endpoint, audience=call_audience(name)))
            self._cap_subs.append(
                await conn.subscribe_inline(subjects.capability(name), queue, queue=name)
            )
            own = dataclasses.replace(endpoint, audience=call_audience(name, self.agent_id))
            self._cap_subs.append(
                await conn.subscribe_inline(
                    subjects.capability_instance(name, self.agent_id), self._call_handler(own)
                )
            )
        if self._probe_sub is not None:
            await self._probe_sub.unsubscribe()
        self._probe_sub = await conn.subscribe(subjects.probe(self.agent_id), self._on_probe)
        await conn.flush()

    async def serve_forever(self) -> None:
        """Wait until ``stop()`` is called (or the task is cancelled)."""
        await self._stopped.wait()

    async def stop(self) -> None:
        """Stop taking calls, let in-flight calls finish, deregister, disconnect."""
        if self._conn is None:
            return
        conn = self._conn
        self._accepting = False
        for sub in self._cap_subs:
            await sub.drain()
        self._cap_subs.clear()
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=self._drain_timeout)
        if self._heartbeat_task is not None:
            await cancel_and_wait([self._heartbeat_task])
            self._heartbeat_task = None
        with contextlib.suppress(ReachError):
            bye = Bye(agent_id=self.agent_id, instance_id=self.instance_id)
            await conn.request(
                subjects.bye(self.agent_id), self._control_request(encode_model(bye)), timeout=2.0
            )
        if self._probe_sub is not None:
            await self._probe_sub.unsubscribe()
        if self.audit is not None:
            await self.audit.stop()
            self.audit = None
        await self._security.close()
        await conn.close()
        self._conn = None
        self._stopped.set()

    # -- registration ----------------------------------------------------------------

    def _control_request(self, body: bytes) -> bytes:
        meta = envelope.RequestMeta(
            call_id=secrets.token_hex(8), caller=self.agent_id, token=self._security.token()
        )
        return envelope.pack_request(meta, body)

    async def _announce(self) -> None:
        request = AnnounceRequest(
            manifest=self.manifest,
            instance_id=self.instance_id,
            started_at=self._started_at,
            readiness=await self.current_readiness(),
            features=list(FEATURES),
        )
        data = self._control_request(encode_model(request))
        deadline = time.monotonic() + self._announce_timeout
        delay = 0.05
        while True:
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
            raise RegistrationRefused(f"{reply.kind}: {reply.description}", agent_id=self.agent_id)
        answer = decode_model(AnnounceReply, reply.body)
        if not answer.accepted:
            raise RegistrationRefused(answer.reason, agent_id=self.agent_id)

    async def current_readiness(self) -> Readiness:
        """The business readiness check's answer; a failing check means not ready."""
        if self._readiness_check is None:
            return self._readiness
        try:
            result = self._readiness_check()
            if inspect.isawaitable(result):
                result = await result
        except Exception as exc:
            readiness = Readiness(ready=False, reason=f"readiness check raised {exc!r}")
        else:
            if isinstance(result, Readiness):
                readiness = result
            else:
                reason = "" if result else "readiness check failed"
                readiness = Readiness(ready=bool(result), reason=reason)
        self._readiness = readiness
        self._readiness_at = time.monotonic()
        return readiness

    async def _heartbeat_loop(self) -> None:
        health = self.manifest.health
        while self._conn is not None:
            # the interval, or at once after a reconnect: the registrar may have evicted
            # this instance while it was away, and the heartbeat's answer says so
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    self._wake.wait(), health.interval_sec * random.uniform(0.9, 1.0)
                )
            self._wake.clear()
            try:
                await self._send_heartbeat()
            except asyncio.CancelledError:
                raise
            except ReachError as exc:
                log.debug("heartbeat of %s failed: %s", self.agent_id, exc)
            except Exception:
                log.exception("heartbeat of %s failed", self.agent_id)

    async def _send_heartbeat(self) -> None:
        self._seq += 1
        hb = Heartbeat(
            agent_id=self.agent_id,
            instance_id=self.instance_id,
            seq=self._seq,
            sent_at=self._clock.time(),
            in_flight=self.in_flight,
            max_concurrency=self.manifest.max_concurrency,
            last_completion_at=self.last_completion_at,
            completed=self.completed,
            memory_bytes=_memory_bytes(),
            readiness=await self.current_readiness(),
        )
        raw = await self.connection.request(
            subjects.heartbeat(self.agent_id),
            self._control_request(encode_model(hb)),
            timeout=self.manifest.health.timeout_sec,
        )
        reply = envelope.unpack_reply(raw)
        if not reply.ok:
            log.warning("registrar rejected heartbeat of %s: %s", self.agent_id, reply.description)
            return
        answer = decode_model(HeartbeatReply, reply.body)
        if answer.reannounce:
            log.info("registrar forgot %s (%s); announcing again", self.agent_id, answer.reason)
            await self._announce()
        elif not answer.ok:
            log.warning("registrar refused heartbeat of %s: %s", self.agent_id, answer.reason)

    async def _on_probe(self, msg: Message) -> None:
        reply = ProbeReply(
            agent_id=self.agent_id,
            instance_id=self.instance_id,
            in_flight=self.in_flight,
            max_concurrency=self.manifest.max_concurrency,
            last_completion_at=self.last_completion_at,
            readiness=await self.current_readiness(),
        )
        await self.connection.respond(msg, envelope.pack_ok(encode_model(reply), self.agent_id))

    # -- calls -----------------------------------------------------------------------

    def _audit_denial(
        self, capability: str, meta: envelope.RequestMeta, code: str, description: str, client: str
    ) -> None:
        if self.audit is not None:
            self.audit.record(
                denial_event(
                    side="callee",
                    ts=self._clock.time(),
                    capability=capability,
                    callee=self.agent_id,
                    call_id=meta.call_id,
                    code=code,
                    description=description,
                    caller=client,
                    caller_agent=meta.caller,
                    trace_id=trace_id_of(meta.traceparent),
                )
            )

    def _call_handler(self, endpoint: Endpoint) -> Callable[[Message], None]:
        server = self._server
        conn = self.connection
        respond = conn.replier()
        tasks = self._tasks

        async def serve(msg: Message) -> None:
            respond(msg.reply, await server.handle(endpoint, msg.data))

        async def serve_one_of(batch: ReplyBatch, token: str, request: bytes) -> None:
            batch.add(token, await server.handle(endpoint, request))

        def continued(task: asyncio.Task[None], deadline: float | None) -> None:
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            server.watch_task(task, deadline)

        def on_call(msg: Message) -> None:
            # A call runs right here, as its message is read, until it has to wait; only
            # then does it get a task of its own, so a handler that waits never holds up
            # the next message.
            if not self._accepting:
                # stopping (subscriptions drain one by one): said at once, so the caller
                # goes to another instance now rather than after its timeout
                respond(msg.reply, server.stopping())
                return
            if not envelope.is_batch(msg.data):
                run_eagerly(serve(msg), on_task=continued)
                set_current(None)
                return
            # several calls in one message: each is served as if it came alone; the
            # replies ready together go back together
            try:
                requests = envelope.unpack_batch(msg.data)
            except CodecError as exc:
                respond(msg.reply, server.refuse_batch(str(exc)))
                return
            batch = conn.reply_batch(msg)
            for token, request in requests:
                run_eagerly(serve_one_of(batch, token, request), on_task=continued)
                set_current(None)
            batch.flush()

        return on_call

    def _ready_now(self) -> tuple[bool, str]:
        """Readiness for admission: the last check's answer, refreshed at most every 0.5 s."""
        now = time.monotonic()
        if self._readiness_check is not None and now - self._readiness_at > 0.5:
            self._readiness_at = now
            if self._refresh is None or self._refresh.done():
                self._refresh = asyncio.create_task(self.current_readiness())
        return self._readiness.ready, self._readiness.reason
