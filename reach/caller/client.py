"""The caller: a live route cache, discovery, and calls to capabilities.

A call finds the best instance from the local route cache (no network round trip),
speaks its contract, and fails only when it must — then says which layer failed::

    async with ReachClient() as client:
        result = await client.call("generate_industry_report", {"industry": "ev", ...})
        result.value, result.agent_id, result.attempts

``ReachClient`` puts together the concerns of a call, each in a module of its own
(``reach.caller``): planning, one attempt, the retry policy, fallbacks; the audit event
of each call is written by ``reach.audit.recording``, jobs are reached through
``reach.agent.jobs``. What it owns itself is the connection's life: connecting (or adopting a
connection it is given), the registry's route cache, the token session and the audit
writer, and closing what it opened.
"""

from __future__ import annotations

import contextlib
import difflib
import os
from collections.abc import Iterable, Sequence
from typing import Any

from pydantic import BaseModel

from reach.agent.context import current_call
from reach.agent.jobs import ClientJobs, JobHandle
from reach.audit.events import AttemptRow
from reach.audit.recording import CallRecorder
from reach.audit.writer import AuditWriter, WriterConfig
from reach.caller.attempt import AttemptRunner
from reach.caller.callstate import CallState
from reach.caller.plan import REQUEST_FRAMING, CallPlanner
from reach.caller.result import CallResult
from reach.caller.routecache import NAMED_CANDIDATES, RouteCache
from reach.caller.routing import Peers, RouteEntry
from reach.clock import Clock, system_clock
from reach.errors import ConfigurationError, NotFound, ReachError
from reach.registry.store import RegistryStore
from reach.resilience import BreakerBoard, BreakerConfig, RetryBudget
from reach.resilience.fallback import NO_FALLBACK, Fallback
from reach.resilience.fallbackcall import Fallbacks, falls_back
from reach.resilience.outliers import OutlierDetector
from reach.resilience.retry import RetryPolicy
from reach.security.credentials import CredentialsFile
from reach.security.membership import FabricSecurity, connect_as
from reach.security.session import TokenSession
from reach.settings import resolve_credentials, resolve_servers
from reach.telemetry import Telemetry
from reach.transport import Connection
from reach.transport.adopt import Adoptable, adopt
from reach.wire.envelope import RequestMeta
from reach.wire.models import Instance

__all__ = ["CallResult", "ReachClient"]

_NOT_CONNECTED = "connect the client first: `async with ReachClient() as client:`"


class ReachClient:
    """Connects to the fabric; ``async with ReachClient() as client: ...``.

    ``connection``: a connection to use instead of opening one (a
    ``reach.transport.Connection``, or a connected nats-py client: ``reach.transport.adopt``). The
    client then leaves it open when it closes, writes its audit events over it too, and
    still takes ``credentials`` (the ones the connection logged in with) for the token
    session of a secured fabric. A client that opens its own connection opens a second
    one for its audit writer: a batch of audit events never queues on the socket ahead
    of calls (docs/operations.md, "Audit events").
    """

    def __init__(
        self,
        *,
        servers: str | list[str] | None = None,
        credentials: str | os.PathLike[str] | None = None,
        name: str = "reach-client",
        validate: bool = True,
        fallback: Fallback | None = None,
        breaker: BreakerConfig | None = None,
        retry_budget: RetryBudget | None = None,
        max_retries: int = 3,
        clock: Clock = system_clock,
        sync_timeout: float = 10.0,
        audit: bool = True,
        audit_config: WriterConfig | None = None,
        telemetry: Telemetry | None = None,
        reconnect_settle_sec: float = 10.0,
        connection: Adoptable | None = None,
    ) -> None:
        if max_retries < 0:
            raise ConfigurationError("max_retries must be >= 0")
        if isinstance(reconnect_settle_sec, bool) or not 0 <= reconnect_settle_sec <= 3600:
            raise ConfigurationError(
                f"reconnect_settle_sec must be between 0 and 3600, got {reconnect_settle_sec!r}"
            )
        self.credentials = resolve_credentials(credentials)
        self.servers = resolve_servers(servers, self.credentials)
        self.name = name
        self.fallback = fallback
        self._clock = clock
        self._sync_timeout = sync_timeout
        #: the connection given (None: the client opens its own)
        self._given = connection
        self._conn: Connection | None = None
        self._audit_conn: Connection | None = None
        self._routes: RouteCache | None = None
        #: the token session (a secured fabric): call tokens for the attempts
        self._security = FabricSecurity()
        #: every call leaves an audit event in REACH_AUDIT (written in the background)
        self.audit_enabled = audit
        self._audit_config = audit_config
        self.telemetry = telemetry or Telemetry()
        self._jobs = ClientJobs()
        breakers = BreakerBoard(breaker or BreakerConfig(), clock)
        self._attempts = AttemptRunner(clock, breakers, Peers(clock=clock), self._jobs)
        self._attempts.settle_sec = reconnect_settle_sec
        budget = retry_budget or RetryBudget(clock=clock)
        self._retry = RetryPolicy(self._attempts, clock, budget, max_retries)
        self._planner = CallPlanner(clock, self.telemetry, validate=validate)
        self._recorder = CallRecorder(self.telemetry, clock, self._first_names)
        self._fallbacks = Fallbacks(clock, self.call)

    # -- what this client observed ------------------------------------------------------

    @property
    def breakers(self) -> BreakerBoard:
        """A circuit breaker per instance this client called (read ``.get(agent_id)``)."""
        return self._attempts.breakers

    @property
    def peers(self) -> Peers:
        """What this client observed of each instance (latency) and its calls in flight."""
        return self._attempts.peers

    @property
    def outliers(self) -> OutlierDetector:
        """The outlier detection: which instances answer badly enough to be set aside
        (each peer's ``.outlier`` says whether it is, and why)."""
        return self._attempts.outliers

    @property
    def retry_budget(self) -> RetryBudget:
        """The retry budget: the calls and retries it counted, the retries left."""
        return self._retry.budget

    @property
    def audit(self) -> AuditWriter | None:
        """The audit writer (None: not connected, or no audit); ``await .flush()`` writes
        what it holds."""
        return self._recorder.audit

    @property
    def reconnect_settle_sec(self) -> float:
        """For this long after the connection came back, "no responders" is the fabric
        settling (agents reconnect after the caller), not the instance's fault."""
        return self._attempts.settle_sec

    @reconnect_settle_sec.setter
    def reconnect_settle_sec(self, seconds: float) -> None:
        self._attempts.settle_sec = seconds

    # -- the connection's life ---------------------------------------------------------

    async def __aenter__(self) -> ReachClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def connect(self) -> None:
        self._attempts.closing = False
        if self._given is not None:
            self._conn = adopt(self._given)
            self.servers = [self._conn.connected_url]
            path = self.credentials
            creds = CredentialsFile.read(path) if path is not None else None
        else:
            self._conn, creds = await connect_as(
                self.servers, name=self.name, credentials=self.credentials, participant=True
            )
        failure: BaseException | None = None
        try:
            await self._join(self._conn, creds)
        except BaseException as exc:  # no await in here: compiled, it would leak the error
            failure = exc
        if failure is not None:
            # whatever started is stopped (route cache, token session, connections opened)
            with contextlib.suppress(Exception):
                await self.close()
            raise failure

    async def _join(self, conn: Connection, creds: CredentialsFile | None) -> None:
        """Registry, token session, route cache, audit writer."""
        store = await RegistryStore.existing(conn, self.servers)
        attempts = self._attempts
        attempts.conn = conn
        attempts.request = conn.raw_request
        # a client that connects is as new to the fabric as one that reconnects: started
        # right after `reach up` (a script, `reach call`), it may find agents that have
        # not logged in again yet
        attempts.on_reconnect()
        conn.on_reconnect(attempts.on_reconnect)
        self._planner.max_body = conn.max_payload - REQUEST_FRAMING
        self._jobs.conn = conn
        self._security = await FabricSecurity.join(conn, creds, verify=False, clock=self._clock)
        attempts.security = self._security
        # the audit's caller: the authenticated client id (on an open fabric, the name)
        self._recorder.caller = creds.client_id if creds is not None else self.name
        # it follows the capabilities this client calls or asks about, not the registry
        self._routes = RouteCache(store, self.peers, follow_all=False)
        self._planner.routes = self._routes
        self._routes.on_change(self._instance_changed)
        await self._routes.start(self._sync_timeout)
        if self.audit_enabled:
            audit_conn = conn
            if self._given is None:
                # a connection of its own: a batch of events never queues ahead of calls
                self._audit_conn, _ = await connect_as(
                    self.servers,
                    name=f"{self.name}.audit",
                    credentials=self.credentials,
                    participant=True,
                )
                audit_conn = self._audit_conn
            writer = AuditWriter(audit_conn, self._audit_config, servers=self.servers)
            self._set_audit(writer)
            await writer.start()
        self.telemetry.watch_breakers(self.breakers.open_count, self.name)

    def _set_audit(self, writer: AuditWriter | None) -> None:
        self._recorder.audit = writer
        self._attempts.audits = writer is not None

    def _instance_changed(self, agent_id: str, instance: Instance | None) -> None:
        """An instance left the registry: what this client kept of it goes too. Otherwise
        its breaker and the outlier detection hear what the registry says of it."""
        if instance is None:
            self.breakers.forget(agent_id)  # (its peer the route cache forgets)
        else:
            healthy = instance.status == "healthy"
            self.breakers.registry_health(agent_id, healthy)
            if agent_id in self.peers:
                outlier = self.peers.peer(agent_id).outlier
                self.outliers.registry(outlier, instance.instance_id, healthy)

    async def close(self) -> None:
        """Stop what the client started and close the connections it opened (not one it
        was given)."""
        attempts = self._attempts
        attempts.closing = True  # calls in flight fail now (Disconnected), not retried
        writer = self.audit
        if writer is not None:
            # what was recorded is written before the connection goes
            await writer.stop()
            self._set_audit(None)
        if self._audit_conn is not None:
            await self._audit_conn.close()
            self._audit_conn = None
        if self._routes is not None:
            await self._routes.stop()
            self._routes = None
            self._planner.routes = None
        await self._security.close()
        self._jobs.forget()
        if self._conn is not None:
            if self._given is None:
                await self._conn.close()
            self._conn = None
            attempts.conn = None

    @property
    def routes(self) -> RouteCache:
        """The live route cache (fails loudly before ``connect``)."""
        if self._routes is None:
            raise RuntimeError(_NOT_CONNECTED)
        return self._routes

    @property
    def connection(self) -> Connection:
        if self._conn is None:
            raise RuntimeError(_NOT_CONNECTED)
        return self._conn

    @property
    def token_session(self) -> TokenSession | None:
        """This client's own token session (None on an open fabric, or before
        ``connect``): what a gateway acts with for the callers that log in through it."""
        return self._security.own

    async def discover(
        self,
        capability: str | None = None,
        tags: Iterable[str] = (),
        version: str | None = None,
        include_unhealthy: bool = False,
    ) -> list[Instance]:
        """Instances from the local route cache: no network round trip once the cache
        follows ``capability`` (the first time, one scan of its route keys; without a
        capability, of the whole registry)."""
        routes = self.routes
        if capability is None:
            await routes.follow_everything(self._sync_timeout)
        elif not routes.ready(capability):
            await routes.follow(capability, self._sync_timeout)
        return routes.find(capability, tags, version, include_unhealthy)

    def _first_names(
        self, capability: str, tags: tuple[str, ...], candidates: Sequence[RouteEntry]
    ) -> tuple[str, ...]:
        routes = self._routes
        if routes is None:  # the client closed while the call was in flight
            return tuple(e.agent_id for e in candidates[:NAMED_CANDIDATES])
        return routes.first_names(capability, tags, candidates)

    # -- async jobs --------------------------------------------------------------------

    async def submit(self, capability: str, payload: Any, **kwargs: Any) -> JobHandle:
        """Call an async-mode capability and return its job at once."""
        routes = self.routes
        if not routes.ready(capability):
            await routes.follow(capability, self._sync_timeout)
        known = routes.entries(capability, kwargs.get("tags", ()))
        if known and all(entry.instance.manifest.mode_of(capability) != "async" for entry in known):
            # refused before it runs: a sync call made here would do the work for nothing
            raise ConfigurationError(f"{capability} is not an async-mode capability")
        result = await self.call(capability, payload, **kwargs)
        if result.job is None:
            raise ConfigurationError(f"{capability} is not an async-mode capability")
        return result.job

    async def job(self, job_id: str) -> JobHandle:
        """A handle on an earlier job, also from another process or after a restart."""
        return await self._jobs.handle(job_id)

    # -- calls -------------------------------------------------------------------------

    async def call(
        self,
        capability: str,
        payload: Any,
        *,
        timeout: float | None = None,
        tags: Iterable[str] = (),
        idempotency_key: str | None = None,
        fallback: Fallback | None = None,
    ) -> CallResult:
        """Call a capability on its best instance, retrying only where it is safe.

        ``timeout`` defaults to 1.5 × the capability's latency SLA and never exceeds the
        deadline of the call being served (nested calls inherit it). Raises one of the
        documented errors (``reach.errors``), or returns a fallback result when one is
        configured and the failure is a reachability failure.
        """
        fb = fallback if fallback is not None else self.fallback
        # a dict, the common case, skips the check against BaseModel (an ABC: slow to say no)
        if type(payload) is not dict and isinstance(payload, BaseModel):
            payload = payload.model_dump(mode="json")
        clock = self._clock
        started = clock.perf_counter()
        state: CallState | None = None
        meta: RequestMeta | None = None
        # No await inside an except block here: compiled by mypyc, one there leaves the
        # error it handled behind as the "current" exception of whatever runs next.
        failure: ReachError | None = None
        routes = self._routes
        if routes is not None and not routes.ready(capability):
            await self._follow(routes, capability)
        try:
            state, meta, body = self._planner.plan(
                capability, payload, timeout, tuple(tags), idempotency_key
            )
            self._retry.budget.record_call()
            first: ReachError | None = None
            try:
                # the first attempt needs no retry machinery: the common case stays cheap
                value = await self._attempts.attempt(state, meta, body)
            except ReachError as exc:
                first = exc
            if first is not None:
                value = await self._retry.recover(first, state, meta, body, trials=fb is None)
        except ReachError as exc:
            failure = exc
        if failure is not None:
            return await self._failed(
                capability, payload, fb, failure, timeout, started, state, meta
            )
        assert state is not None
        assert meta is not None
        latency_ms = (clock.perf_counter() - started) * 1000
        route = tuple(state.route)  # once, for the result and the audit event
        self._recorder.served(state, meta, latency_ms, route)
        if isinstance(value, JobHandle):
            return _result(state, meta, {"job_id": value.job_id}, latency_ms, route, value)
        if fb is not None and fb.cache_max_age_sec is not None:
            self._fallbacks.remember(capability, body, value)
        return _result(state, meta, value, latency_ms, route)

    async def _follow(self, routes: RouteCache, capability: str) -> None:
        """A capability called for the first time: its instances are known before the
        call is planned (one scan of its route keys). A scan that does not answer leaves
        the call to find none (NotFound), as an empty registry would."""
        with contextlib.suppress(TimeoutError, ReachError):
            await routes.follow(capability, self._sync_timeout)

    async def _failed(
        self,
        capability: str,
        payload: Any,
        fb: Fallback | None,
        failure: ReachError,
        timeout: float | None,
        started: float,
        state: CallState | None,
        meta: RequestMeta | None,
    ) -> CallResult:
        """A failed call's fallback answer, or its error raised; recorded either way."""
        if failure.dependency is None and current_call() is not None:
            failure.dependency = capability  # raised inside a handler (see ReachError)
        if isinstance(failure, NotFound) and self._routes is not None:
            offered = self._routes.capabilities()
            with contextlib.suppress(ReachError, TimeoutError):
                offered = await self._routes.capability_names()
            _name_close_matches(failure, capability, offered)
        recorder = self._recorder
        if fb is None or fb is NO_FALLBACK or not falls_back(failure):
            recorder.failed(capability, state, meta, self._since(started), failure)
            raise failure
        missed: ReachError | None = None
        # the call's deadline bounds its backup where the caller gave a timeout
        deadline = state.deadline if state is not None and timeout is not None else None
        try:
            result = await self._fallbacks.answer(
                capability, payload, fb, failure, deadline, started
            )
        except ReachError as exc:  # no fallback applied (a cache miss, a backup failed)
            missed = exc
        if missed is not None:
            recorder.failed(capability, state, meta, self._since(started), missed)
            raise missed
        recorder.failed(capability, state, meta, self._since(started), failure, result.fallback)
        return result

    def _since(self, started: float) -> float:
        """Milliseconds since ``started`` (the clock's ``perf_counter``)."""
        return (self._clock.perf_counter() - started) * 1000


def _name_close_matches(failure: NotFound, capability: str, offered: list[str]) -> None:
    """Add to ``failure`` the offered capabilities whose names are close to the one
    called (a typo), when none of that name is offered at all."""
    if capability in offered:
        return
    close = difflib.get_close_matches(capability, offered, n=3, cutoff=0.6)
    if close:
        failure.args = (f"{failure}; did you mean {' or '.join(close)}?",)


def _result(
    state: CallState,
    meta: RequestMeta,
    value: Any,
    latency_ms: float,
    route: tuple[AttemptRow, ...],
    job: JobHandle | None = None,
) -> CallResult:
    """What a served call returns (an accepted job's: its id, and its handle)."""
    return CallResult(
        value=value,
        capability=state.capability,
        call_id=meta.call_id,
        agent_id=state.last_target,
        attempts=state.attempts,
        latency_ms=latency_ms,
        job=job,
        route=route,
    )
