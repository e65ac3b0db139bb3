"""The agent SDK: announce a manifest, keep heartbeating, answer probes, serve calls.

::

    agent = Agent.from_yaml("agent.yaml")

    @agent.capability("generate_industry_report")
    async def generate(req: dict) -> dict: ...

    async with agent:
        await agent.serve_forever()  # until Ctrl-C or SIGTERM

or, for a program that is one agent, ``agent.run()``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import os
import signal
import sys
import threading
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar, cast

from reach.agent.jobs import JobStore
from reach.agent.joining import run_step
from reach.agent.microsvc import MicroService
from reach.agent.presence import Presence
from reach.agent.serving import REPLY_FRAMING, CallServer, Endpoint, endpoint_for
from reach.audit.events import denial_event
from reach.audit.writer import AuditWriter
from reach.clock import Clock, system_clock
from reach.deadline import Deadline
from reach.errors import ConfigurationError, LoginUnanswered, ReachError
from reach.security.claims import Claims
from reach.security.credentials import CredentialsFile
from reach.security.membership import FabricSecurity, connect_as
from reach.security.tokens import call_audience
from reach.settings import resolve_credentials, resolve_servers
from reach.tasks import cancel_and_wait
from reach.telemetry import Telemetry, trace_id_of
from reach.transport import Connection, Subscription
from reach.transport.adopt import Adoptable, adopt
from reach.wire import envelope, subjects
from reach.wire.models import Manifest, Readiness, parse_manifest

__all__ = ["Agent", "ReadinessCheck", "load_manifest"]

log = logging.getLogger("reach.agent.agent")

Handler = Callable[[Any], Awaitable[Any]]
ReadinessCheck = Callable[[], "Readiness | bool | Awaitable[Readiness | bool]"]
H = TypeVar("H", bound=Handler)


def load_manifest(path: str | os.PathLike[str]) -> Manifest:
    """Read and validate a YAML manifest; ConfigurationError lists every problem."""
    import yaml  # only an agent built from a file reads YAML

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


class Agent:
    """One agent instance: its manifest, its handlers, and its life on the fabric.

    ``connection``: a connection to use instead of opening one (a
    ``reach.transport.Connection``, or a connected nats-py client: ``reach.transport.adopt``), which
    a ``ReachClient`` may share. The agent then leaves it open when it stops, and still
    takes ``credentials`` (the ones the connection logged in with) for its token session
    on a secured fabric.
    """

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
        audit: bool = True,
        telemetry: Telemetry | None = None,
        connection: Adoptable | None = None,
    ) -> None:
        self.manifest = manifest if isinstance(manifest, Manifest) else parse_manifest(manifest)
        self.credentials = resolve_credentials(credentials)
        self.servers = resolve_servers(servers, self.credentials)
        self.instance_id = uuid.uuid4().hex
        self._readiness_check = readiness
        self._clock = clock
        #: how long ``start`` retries a step of joining that failed for a transient reason
        self._join_timeout = join_timeout
        self._drain_timeout = drain_timeout
        #: False only to measure the token check's cost (bench): calls are then not checked
        #: check each request's call token (a benchmark's variant turns it off)
        self._verify_tokens = True
        #: the connection given (None: the agent opens its own)
        self._given = connection
        self._conn: Connection | None = None
        self._cap_subs: list[Subscription] = []
        self._probe_sub: Subscription | None = None
        #: its ``$SRV`` side (NATS micro: PING, INFO, STATS) while it runs
        self.micro: MicroService | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._stopped = asyncio.Event()
        self._endpoints: dict[str, Endpoint] = {}
        self._server = CallServer(
            self.agent_id,
            max_concurrency=self.manifest.max_concurrency,
            clock=clock,
            is_ready=self._ready_now,
        )
        self._server.accepting = False  # until it has joined
        self._readiness = Readiness()
        self._presence = Presence(
            self.manifest,
            self.instance_id,
            self._server,
            self.current_readiness,
            clock,
            announce_timeout,
        )
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
            endpoint = endpoint_for(declared, func, job=self.manifest.mode_of(name) == "async")
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
        """Join the fabric: connect and log in (or adopt the connection given), token
        session and key follow, audit writer, job store, announce, subscriptions. A step
        that fails for a transient reason (a timeout, a lost connection, a login no gate
        answered) is tried again until ``join_timeout``; the error that ends ``start``
        names the step."""
        missing = [c.name for c in self.manifest.capabilities if c.name not in self._endpoints]
        if missing:
            raise ConfigurationError(f"no handler registered for: {', '.join(missing)}")
        self._stopped.clear()
        presence = self._presence
        presence.manifest = self.manifest  # with the schemas its handlers brought
        presence.started_at = self._clock.time()
        # real time, whatever the agent's clock: joining waits for other processes to answer
        deadline = Deadline.after(self._join_timeout, system_clock)
        conn, creds = await self._connect(deadline)
        self._conn = presence.conn = conn
        conn.on_reconnect(presence.wake.set)
        failure: BaseException | None = None
        try:
            await self._join(creds, deadline)
        except BaseException as exc:  # no await in here: compiled, it would leak the error
            failure = exc
        if failure is not None:
            # whatever started is stopped: subscriptions, audit writer, token session, and
            # the connection if the agent opened it
            await self._leave(conn, timeout=1.0)
            raise failure
        self._server.accepting = True
        self._heartbeat_task = asyncio.create_task(presence.heartbeat_loop(), name="heartbeat")
        log.info(
            "agent %s serving %s at %s",
            self.agent_id,
            ", ".join(self._endpoints) or "nothing",
            conn.connected_url,
        )

    async def _connect(self, deadline: Deadline) -> tuple[Connection, CredentialsFile | None]:
        """The connection given, or one opened and logged in; the credentials with it."""
        if self._given is not None:
            conn = adopt(self._given)
            self.servers = [conn.connected_url]
            path = self.credentials
            return conn, CredentialsFile.read(path) if path is not None else None
        return await run_step(
            self.agent_id,
            "connect and log in to NATS",
            deadline,
            lambda: connect_as(
                self.servers,
                name=f"agent:{self.agent_id}",
                credentials=self.credentials,
                participant=True,
            ),
            (LoginUnanswered,),
        )

    async def _join(self, creds: CredentialsFile | None, deadline: Deadline) -> None:
        """Token session and key follow, audit writer, job store, announce, then
        subscriptions."""
        conn = self.connection
        security = await run_step(
            self.agent_id,
            "token session and key follow (REACH_KEYS)",
            deadline,
            lambda: FabricSecurity.join(conn, creds, verify=self._verify_tokens, clock=self._clock),
        )
        self._presence.security = security
        self._server.verifier = security.verifier
        self._server.max_reply_bytes = conn.max_payload - REPLY_FRAMING
        if self._audit_enabled:
            self.audit = AuditWriter(conn, servers=self.servers)
            await run_step(self.agent_id, "audit writer (REACH_AUDIT)", deadline, self.audit.start)
            self._server.on_denied = self._audit_denial
            self._server.audit = self.audit  # every call served is recorded
        if self.manifest.runs_jobs:
            self._server.jobs = await run_step(
                self.agent_id, "job store (REACH_JOBS)", deadline, lambda: self._open_jobs(conn)
            )
        await run_step(self.agent_id, "announce", deadline, self._presence.announce, ())
        # Probe and call subscriptions only once accepted: a refused duplicate never
        # answers for the live instance.
        await run_step(self.agent_id, "subscribe", deadline, self._subscribe)

    async def _open_jobs(self, conn: Connection) -> JobStore:
        try:
            return await JobStore.open(conn)
        except ConfigurationError:
            raise ConfigurationError(
                f"{self.agent_id} runs capabilities as jobs (mode async) but the"
                " REACH_JOBS bucket does not exist: is `reach up` running?"
            ) from None

    async def _subscribe(self) -> None:
        conn = self.connection
        await self._unsubscribe()  # a failed attempt before leaves none behind
        server, tasks = self._server, self._tasks
        for name, endpoint in self._endpoints.items():
            # each subject takes the tokens made for it: on its own subject this
            # instance's, on the queue group's the capability's (see call_audience)
            group = dataclasses.replace(endpoint, audience=call_audience(name))
            self._cap_subs.append(
                await conn.subscribe_inline(
                    subjects.capability(name),
                    server.message_handler(group, conn, tasks),
                    queue=name,
                )
            )
            own = dataclasses.replace(endpoint, audience=call_audience(name, self.agent_id))
            self._cap_subs.append(
                await conn.subscribe_inline(
                    subjects.capability_instance(name, self.agent_id),
                    server.message_handler(own, conn, tasks),
                )
            )
        self._probe_sub = await conn.subscribe(
            subjects.probe(self.agent_id), self._presence.on_probe
        )
        self.micro = MicroService(
            self.manifest, list(self._endpoints.values()), self._presence.started_at
        )
        await self.micro.start(conn)
        await conn.flush()

    async def _unsubscribe(self) -> None:
        for sub in self._cap_subs:
            await sub.unsubscribe()
        self._cap_subs.clear()
        if self._probe_sub is not None:
            await self._probe_sub.unsubscribe()
            self._probe_sub = None
        if self.micro is not None:
            await self.micro.stop()
            self.micro = None

    async def serve_forever(self) -> None:
        """Wait until ``stop()`` is called, the task is cancelled, or (in the main thread)
        Ctrl-C or SIGTERM comes: a signal ends the wait, so that the agent stops as usual
        (deregistered, in-flight calls finished) and the program exits without a
        traceback. The signals' handlers are the program's own again afterwards."""
        restore = _stop_on_signals(self._stopped)
        try:
            await self._stopped.wait()
        finally:
            restore()

    def run(self) -> None:
        """Join the fabric and serve until Ctrl-C or SIGTERM, then leave it: the whole
        life of a program that is one agent (``python agent.py``). A signal while it
        joins ends it once joined (so that it leaves the registry as it came); an error
        that ends it is told in one line on stderr, and exits with status 1."""
        _log_to_stderr()
        try:
            asyncio.run(_serve(self))
        except KeyboardInterrupt:  # a second Ctrl-C while leaving: it was asked twice
            pass
        except ReachError as exc:
            print(f"{self.agent_id}: {type(exc).__name__}: {exc}", file=sys.stderr)
            raise SystemExit(1) from None

    async def stop(self) -> None:
        """Stop taking calls, let in-flight calls finish, deregister, disconnect (from a
        connection the agent opened; one it was given stays open)."""
        if self._conn is None:
            return
        conn = self._conn
        self._server.stop_accepting()
        for sub in self._cap_subs:
            await sub.drain()
        self._cap_subs.clear()
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=self._drain_timeout)
        if self._heartbeat_task is not None:
            await cancel_and_wait([self._heartbeat_task])
            self._heartbeat_task = None
        await self._presence.bye()
        await self._leave(conn)
        self._stopped.set()

    async def _leave(self, conn: Connection, timeout: float = 5.0) -> None:
        """Subscriptions gone, audit writer written out, token session ended; the
        connection closed if the agent opened it."""
        await self._unsubscribe()
        if self.audit is not None:
            self._server.audit = None
            await self.audit.stop(timeout=timeout)
            self.audit = None
        await self._presence.security.close()
        if self._given is None:
            await conn.close()
        self._conn = self._presence.conn = None

    # -- readiness ---------------------------------------------------------------------

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
        self._readiness_at = self._clock.monotonic()
        return readiness

    # -- calls -----------------------------------------------------------------------

    def _audit_denial(
        self, capability: str, meta: envelope.RequestMeta, code: str, description: str,
        claims: Claims | None,
    ) -> None:  # fmt: skip
        """A call this agent refused, to the audit stream: by the client its token names
        and the gateway that called for that client, if the token was valid."""
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
                    caller=claims.client_id if claims is not None else "",
                    caller_agent=meta.caller,
                    actor=claims.actor if claims is not None else None,
                    trace_id=trace_id_of(meta.traceparent),
                )
            )

    def _ready_now(self) -> tuple[bool, str]:
        """Readiness for admission: the last check's answer, refreshed at most every 0.5 s."""
        now = self._clock.monotonic()
        if self._readiness_check is not None and now - self._readiness_at > 0.5:
            self._readiness_at = now
            if self._refresh is None or self._refresh.done():
                self._refresh = asyncio.create_task(self.current_readiness())
        return self._readiness.ready, self._readiness.reason


def _log_to_stderr() -> None:
    """A program that is one agent (``Agent.run``) and set up no logging of its own says
    what the agent does on stderr: that it serves, that it lost the fabric and came back,
    what it refused. One that did set up logging keeps its own."""
    if logging.getLogger().handlers or logging.getLogger("reach").handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s", "%H:%M:%S"))
    reach_log = logging.getLogger("reach")
    reach_log.addHandler(handler)
    reach_log.setLevel(logging.INFO)


async def _serve(agent: Agent) -> None:
    signalled = asyncio.Event()
    restore = _stop_on_signals(signalled)  # taken from the start: see Agent.run
    try:
        await agent.start()
    finally:
        restore()
    try:
        if not signalled.is_set():
            await agent.serve_forever()
    finally:
        await agent.stop()


#: per event loop: the events that SIGINT and SIGTERM set (of every agent waiting in it,
#: and of a program starting one), and the handlers the signals had before
_SIGNALLED: dict[asyncio.AbstractEventLoop, tuple[set[asyncio.Event], dict[int, Any]]] = {}


def _stop_on_signals(stopped: asyncio.Event) -> Callable[[], None]:
    """Set ``stopped`` on SIGINT and SIGTERM (main thread only: elsewhere signals are
    not this loop's to take); returns what takes it off again. Agents waiting in one loop
    share the handlers (two agents of one program both stop), and once the last one is
    off the signals' previous handlers are back."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    loop = asyncio.get_running_loop()
    entry = _SIGNALLED.get(loop)
    if entry is None:
        waiting: set[asyncio.Event] = set()
        previous: dict[int, Any] = {}

        def fire() -> None:
            for event in list(waiting):
                event.set()

        for sig in (signal.SIGINT, signal.SIGTERM):
            handler = signal.getsignal(sig)
            try:
                loop.add_signal_handler(sig, fire)
            except (NotImplementedError, RuntimeError, ValueError):  # no such support here
                continue
            previous[sig] = handler
        entry = _SIGNALLED[loop] = (waiting, previous)
    entry[0].add(stopped)

    def restore() -> None:
        waiting, previous = entry
        waiting.discard(stopped)
        if waiting or _SIGNALLED.get(loop) is not entry:
            return
        del _SIGNALLED[loop]
        for sig, handler in previous.items():
            loop.remove_signal_handler(sig)
            if handler is not None:
                signal.signal(sig, handler)

    return restore
