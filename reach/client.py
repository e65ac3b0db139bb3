"""The caller: a live route cache, discovery, and calls to capabilities.

A call finds the best instance from the local route cache (no network round trip),
speaks its contract, and fails only when it must — then says which layer failed::

    async with ReachClient() as client:
        result = await client.call("generate_industry_report", {"industry": "ev", ...})
        result.value, result.agent_id, result.attempts
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import secrets
import time
from collections.abc import Iterable, Sequence
from typing import Any, Final

from pydantic import BaseModel
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt

from reach import codec, envelope, subjects
from reach.audit.events import CallEvent, ErrorClass, Outcome, error_class
from reach.audit.writer import AuditWriter, WriterConfig
from reach.clock import Clock, system_clock
from reach.context import current_call
from reach.contract import ROOT, Validator, compile_schema
from reach.errors import (
    AuthenticationFailed,
    AuthError,
    BusinessError,
    CircuitOpen,
    ConfigurationError,
    ContractError,
    Disconnected,
    DiscoveryError,
    InternalError,
    NoHealthyInstance,
    NoResponders,
    NotAuthorized,
    NotFound,
    ReachError,
    ReachTimeout,
    RemoteError,
    RetriesExhausted,
    Unavailable,
)
from reach.fallback import MISSING, NO_FALLBACK, Fallback, FallbackInfo, ResultCache
from reach.jobs import JobHandle, JobStore
from reach.models import Instance
from reach.plain import Plain
from reach.registry.routecache import NAMED_CANDIDATES, RouteCache
from reach.registry.store import RegistryStore
from reach.resilience import (
    BreakerBoard,
    BreakerConfig,
    RetryBudget,
    stop_at_deadline,
    wait_backoff,
)
from reach.routing import Peer, Peers, RouteEntry, choose
from reach.security.credentials import CredentialsFile
from reach.security.fabric import FabricSecurity, connect_as
from reach.security.replay import MAX_AHEAD_SEC
from reach.settings import resolve_credentials, resolve_servers
from reach.telemetry import Span, Telemetry, end_span, new_traceparent, trace_id_of, traceparent_of
from reach.transport import Connection, RawRequest

__all__ = ["CallResult", "ReachClient"]

log = logging.getLogger("reach.client")

#: latency SLA assumed when no instance of the capability is known (queue-subject calls)
DEFAULT_SLA_MS = 1000.0
#: bytes of a request's envelope beside its payload, at most (token, trace context, ids)
REQUEST_FRAMING = 4096
#: a call's timeout at most (a day; NaN and infinities are refused with it)
#: a call's deadline lies at most this far ahead: callees refuse one further
MAX_TIMEOUT_SEC = MAX_AHEAD_SEC


#: CallResult's fields, in the constructor's order
_RESULT_FIELDS = (
    "value",
    "capability",
    "call_id",
    "agent_id",
    "attempts",
    "latency_ms",
    "fallback",
    "job",
    "route",
)


class CallResult(Plain):
    """What a call returned, who served it, and how (read-only).

    A plain class with read-only attributes rather than a frozen dataclass: one is built
    for every call, and compiled (``make build``) its constructor costs a thirtieth of a
    frozen dataclass's. Compiled, assigning to an attribute raises AttributeError.
    """

    __slots__ = _RESULT_FIELDS
    _NAMES = _RESULT_FIELDS

    def __init__(
        self,
        value: Any,
        capability: str,
        call_id: str,
        agent_id: str,
        attempts: int,
        latency_ms: float,
        fallback: FallbackInfo | None = None,
        job: JobHandle | None = None,
        route: tuple[tuple[str, float | None, str, float], ...] = (),
    ) -> None:
        self.value: Final = value
        self.capability: Final = capability
        self.call_id: Final = call_id
        self.agent_id: Final = agent_id
        self.attempts: Final = attempts
        self.latency_ms: Final = latency_ms
        self.fallback: Final = fallback
        #: for async-mode capabilities: the accepted job (``await result.job.result()``)
        self.job: Final = job
        #: every attempt: (agent id, routing score or None, "ok" or error class, latency ms)
        self.route: Final = route

    @property
    def from_fallback(self) -> bool:
        return self.fallback is not None

    def _fields(self) -> tuple[object, ...]:
        return (
            self.value,
            self.capability,
            self.call_id,
            self.agent_id,
            self.attempts,
            self.latency_ms,
            self.fallback,
            self.job,
            self.route,
        )


def _remote_error(reply: envelope.Reply, target: str) -> ReachError:
    """The exception of the one documented tree for a failed reply."""
    by = reply.by or target
    desc = reply.description
    if reply.kind == "contract":
        return ContractError(
            f"{desc} (at {by})", path=desc.split(":", 1)[0] if ":" in desc else "", rule=reply.code
        )
    if reply.kind == "business":
        return BusinessError(desc, code=reply.code, agent_id=by)
    if reply.kind == "unavailable":
        return Unavailable(f"{by}: {desc}")
    if reply.kind == "timeout":
        return ReachTimeout(f"{by}: {desc}")
    if reply.kind == "denied":
        if reply.code.startswith("insufficient_level:"):
            try:
                _, required_text, held_text = reply.code.split(":")
                required, held = int(required_text), int(held_text)
            except ValueError:  # a callee that does not say it our way
                return AuthenticationFailed(f"{by}: {desc}")
            return NotAuthorized(f"{by}: {desc}", level_required=required, level_held=held)
        return AuthenticationFailed(f"{by}: {desc}")
    return InternalError(desc, code=reply.code, agent_id=by)


def _falls_back(exc: ReachError) -> bool:
    """Fallbacks cover reachability failures, never contract, business or auth errors."""
    return exc.retryable or isinstance(exc, CircuitOpen | DiscoveryError | RetriesExhausted)


class _Attempt:
    """State of one call across its attempts."""

    __slots__ = (
        "attempt_timeout",
        "attempts",
        "candidates",
        "capability",
        "deadline",
        "failed",
        "issuer_silent",
        "last_target",
        "retry_timeouts",
        "route",
        "score",
        "skipped",
        "span",
        "started_at",
        "tags",
    )

    def __init__(
        self,
        capability: str,
        deadline: float,
        attempt_timeout: float,
        started_at: float,
        candidates: Sequence[RouteEntry],
        tags: tuple[str, ...] = (),
    ) -> None:
        self.capability = capability
        self.deadline = deadline
        #: wall time the call started (audit) and the candidates it was routed among
        self.started_at = started_at
        self.candidates = candidates
        #: one attempt waits at most 1.5 × SLA, so a slow instance leaves time for another
        self.attempt_timeout = attempt_timeout
        self.attempts = 0
        self.failed: set[str] = set()
        self.last_target = ""
        #: a timed-out attempt may be retried: the capability is idempotent or keyed
        self.retry_timeouts = False
        #: the token issuer did not answer for an attempt's instance: no retry waits for it
        self.issuer_silent = False
        #: routing score of the instance chosen last (None: the only candidate, not ranked)
        self.score: float | None = None
        #: per attempt: (agent id, score, "ok" or error class, latency ms) — for the audit
        self.route: list[tuple[str, float | None, str, float]] = []
        #: instances passed over because their breaker was open
        self.skipped: list[str] = []
        self.span: Span | None = None
        #: the tags every candidate's capability carries
        self.tags = tags


class ReachClient:
    """Connects to the fabric; ``async with ReachClient() as client: ...``."""

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
        self.validate = validate
        self.fallback = fallback
        self.max_retries = max_retries
        self._clock = clock
        self._sync_timeout = sync_timeout
        self._conn: Connection | None = None
        self._audit_conn: Connection | None = None
        self._routes: RouteCache | None = None
        self.breakers = BreakerBoard(breaker or BreakerConfig(), clock)
        self.retry_budget = retry_budget or RetryBudget(clock=clock)
        #: what this client observed of each instance (latency) and its calls in flight
        self.peers = Peers(clock=clock)
        #: calls in flight to the capability's queue subject (no instance known)
        self._anyone = Peer("")
        self._results = ResultCache()
        self._jobs: JobStore | None = None
        self._validators: dict[int, tuple[dict[str, Any], Validator]] = {}
        self._nats_request: RawRequest = _not_connected
        self._security = FabricSecurity()
        self._call_prefix = secrets.token_hex(8) + "-"
        self._call_seq = 0
        #: the largest payload a request can carry (the server's max_payload, less room
        #: for the envelope: token, trace context, deadline); set on connect
        self._max_body = 1 << 62
        self._closing = False
        #: every call leaves an audit event in REACH_AUDIT (written in the background)
        self.audit_enabled = audit
        self._audit_config = audit_config
        self.audit: AuditWriter | None = None
        self.telemetry = telemetry or Telemetry()
        self._client_id = ""
        #: for this long after the connection came back, "no responders" is the fabric
        #: settling (agents reconnect after the caller), not the instance's fault
        self.reconnect_settle_sec = reconnect_settle_sec
        self._reconnected_at = -math.inf

    async def __aenter__(self) -> ReachClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def connect(self) -> None:
        self._closing = False
        self._conn, creds = await connect_as(
            self.servers, name=self.name, credentials=self.credentials
        )
        failure: BaseException | None = None
        try:
            await self._join(creds)
        except BaseException as exc:  # no await in here: compiled, it would leak the error
            failure = exc
        if failure is not None:
            # whatever started is stopped (route cache, token session, both connections)
            with contextlib.suppress(Exception):
                await self.close()
            raise failure

    async def _join(self, creds: CredentialsFile | None) -> None:
        """Registry, token session, route cache, audit writer."""
        assert self._conn is not None
        try:
            store = await RegistryStore.open(self._conn, create=False)
        except ConfigurationError:
            raise DiscoveryError(
                f"no registry at {', '.join(self.servers)}: is `reach up` running?"
            ) from None
        self._nats_request = self._conn.raw_request
        self._conn.on_reconnect(self._on_reconnect)
        self._max_body = self._conn.max_payload - REQUEST_FRAMING
        self._security = await FabricSecurity.join(
            self._conn, creds, verify=False, clock=self._clock
        )
        # the audit's caller: the authenticated client id (on an open fabric, the name)
        self._client_id = creds.client_id if creds is not None else self.name
        self._routes = RouteCache(store, self.peers)
        self._routes.on_change(self._instance_changed)
        await self._routes.start(self._sync_timeout)
        if self.audit_enabled:
            # a connection of its own: a batch of events (~100 kB) never queues ahead
            # of calls on theirs (measured: half the audit's cost at 128 in flight)
            self._audit_conn, _ = await connect_as(
                self.servers, name=f"{self.name}.audit", credentials=self.credentials
            )
            self.audit = AuditWriter(self._audit_conn, self._audit_config, servers=self.servers)
            await self.audit.start()
        self.telemetry.watch_breakers(self.breakers.open_count, self.name)

    def _instance_changed(self, agent_id: str, instance: Instance | None) -> None:
        """An instance left the registry: what this client kept of it goes too. Otherwise
        its breaker hears what the registry says of its health."""
        if instance is None:
            self.breakers.forget(agent_id)  # (its peer the route cache forgets)
        else:
            self.breakers.registry_health(agent_id, instance.status == "healthy")

    def _on_reconnect(self) -> None:
        self._reconnected_at = self._clock.monotonic()

    def _settling(self) -> bool:
        """Is the fabric settling after this client's connection came back (or is the
        connection away)? Agents reconnect on their own schedule, often after the caller:
        meanwhile their subjects have nobody listening."""
        conn = self._conn
        if conn is None:
            return False
        return (
            not conn.is_connected
            or self._clock.monotonic() - self._reconnected_at < self.reconnect_settle_sec
        )

    async def close(self) -> None:
        self._closing = True  # calls in flight fail now (Disconnected) and are not retried
        if self.audit is not None:
            # what was recorded is written before the connection goes
            await self.audit.stop()
            self.audit = None
        if self._audit_conn is not None:
            await self._audit_conn.close()
            self._audit_conn = None
        if self._routes is not None:
            await self._routes.stop()
            self._routes = None
        await self._security.close()
        if self._conn is not None:
            await self._conn.close()
            self._conn = None

    @property
    def routes(self) -> RouteCache:
        """The live route cache (fails loudly before ``connect``)."""
        if self._routes is None:
            raise RuntimeError("connect the client first: `async with ReachClient() as client:`")
        return self._routes

    @property
    def connection(self) -> Connection:
        if self._conn is None:
            raise RuntimeError("connect the client first: `async with ReachClient() as client:`")
        return self._conn

    async def discover(
        self,
        capability: str | None = None,
        tags: Iterable[str] = (),
        version: str | None = None,
        include_unhealthy: bool = False,
    ) -> list[Instance]:
        """Instances from the local route cache; no network round trip."""
        return self.routes.find(capability, tags, version, include_unhealthy)

    # -- async jobs ------------------------------------------------------------------

    async def _job_store(self) -> JobStore:
        if self._jobs is None:
            self._jobs = await JobStore.open(self.connection)
        return self._jobs

    async def submit(self, capability: str, payload: Any, **kwargs: Any) -> JobHandle:
        """Call an async-mode capability and return its job at once."""
        known = self.routes.entries(capability, kwargs.get("tags", ()))
        if known and all(entry.instance.manifest.mode != "async" for entry in known):
            # refused before it runs: a sync call made here would do the work for nothing
            raise ConfigurationError(f"{capability} is not an async-mode capability")
        result = await self.call(capability, payload, **kwargs)
        if result.job is None:
            raise ConfigurationError(f"{capability} is not an async-mode capability")
        return result.job

    async def job(self, job_id: str) -> JobHandle:
        """A handle on an earlier job, also from another process or after a restart."""
        store = await self._job_store()
        record = await store.get(job_id)
        if record is None:
            raise NotFound(f"job {job_id} is unknown (or past its retention time)")
        return JobHandle(store, job_id, record.capability, record.agent_id)

    # -- calls -----------------------------------------------------------------------

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
        if isinstance(payload, BaseModel):
            payload = payload.model_dump(mode="json")
        started = time.perf_counter()
        state: _Attempt | None = None
        meta: envelope.RequestMeta | None = None
        # No await inside an except block here: compiled by mypyc, one there leaves the
        # error it handled behind as the "current" exception of whatever runs next.
        failure: ReachError | None = None
        try:
            state, meta, body = self._prepare(
                capability, payload, timeout, tuple(tags), idempotency_key
            )
            first: ReachError | None = None
            try:
                # the first attempt needs no retry machinery: the common case stays cheap
                value = await self._attempt(state, meta, body)
            except ReachError as exc:
                first = exc
            if first is not None and _waits_for_instance(first, state) and self._settling():
                value, first = await self._wait_for_instance(first, state, meta, body)
            if first is not None:
                value = await self._retry(first, state, meta, body)
        except ReachError as exc:
            failure = exc
        if failure is not None:
            if failure.dependency is None and current_call() is not None:
                failure.dependency = capability  # raised inside a handler (see ReachError)
            if fb is None or fb is NO_FALLBACK or not _falls_back(failure):
                self._record(capability, state, meta, started, failure)
                raise failure
            result = await self._fall_back(capability, payload, fb, failure, timeout, started)
            self._record(capability, state, meta, started, failure, result.fallback)
            return result
        assert state is not None
        assert meta is not None
        latency_ms = (time.perf_counter() - started) * 1000
        route = tuple(state.route)  # once, for the result and the audit event
        if state.span is not None or self.telemetry.metrics_on:
            self._record(capability, state, meta, started, None, latency_ms=latency_ms, route=route)
        elif self.audit is not None:  # the common case
            self.audit.record(self._event(capability, state, meta, latency_ms, route))
        if isinstance(value, JobHandle):
            return CallResult(
                value={"job_id": value.job_id},
                capability=capability,
                call_id=meta.call_id,
                agent_id=state.last_target,
                attempts=state.attempts,
                latency_ms=latency_ms,
                job=value,
                route=route,
            )
        if fb is not None and fb.cache_max_age_sec is not None:
            self._results.put(capability, body, value, self._clock.monotonic())
        return CallResult(
            value=value,
            capability=capability,
            call_id=meta.call_id,
            agent_id=state.last_target,
            attempts=state.attempts,
            latency_ms=latency_ms,
            route=route,
        )

    async def _call_token(self, capability: str, instance: str, deadline: float) -> str | None:
        """A token for calls to ``capability`` at ``instance`` (none: its queue group) from
        the issuer, within the call's deadline (ReachTimeout after it; Unavailable if the
        issuer does not answer)."""
        remaining = deadline - self._clock.time()
        fetched: str | None = None
        late = remaining <= 0
        if not late:
            try:
                fetched = await asyncio.wait_for(
                    self._security.fetch_call_token(capability, instance), remaining
                )
            except TimeoutError:  # (the fetch raises no timeout of its own: Unavailable)
                late = True
        if late:
            conn = self._conn
            if conn is not None and conn.link.down:  # why: the login refused, say
                raise Disconnected(f"{capability}: no call token: {conn.link.describe()}")
            raise ReachTimeout(f"{capability}: no call token from the issuer before the deadline")
        return fetched

    def _first_names(
        self, capability: str, tags: tuple[str, ...], candidates: Sequence[RouteEntry]
    ) -> tuple[str, ...]:
        routes = self._routes
        if routes is None:  # the client closed while the call was in flight
            return tuple(e.agent_id for e in candidates[:NAMED_CANDIDATES])
        return routes.first_names(capability, tags, candidates)

    def _event(
        self,
        capability: str,
        state: _Attempt,
        meta: envelope.RequestMeta,
        latency_ms: float,
        route: tuple[tuple[str, float | None, str, float], ...],
        outcome: Outcome = "ok",
        error: ErrorClass | None = None,
        code: str = "",
        description: str = "",
        fallback: FallbackInfo | None = None,
    ) -> CallEvent:
        """The caller's audit event of a call (the writer keeps a plain call, answered at
        the first attempt, as a few column slots)."""
        candidates = state.candidates
        return CallEvent(
            ts=state.started_at,
            capability=capability,
            call_id=meta.call_id,
            trace_id=trace_id_of(meta.traceparent),
            caller=self._client_id,
            caller_agent=meta.caller,  # the agent whose handler made this call, if any
            callee=state.last_target,
            outcome=outcome,
            error=error,
            code=code,
            description=description,
            latency_ms=latency_ms,
            # the first few by name and how many: not a walk over every instance
            candidates=self._first_names(capability, state.tags, candidates),
            n_candidates=len(candidates),
            skipped=tuple(state.skipped),
            attempts=route,
            fallback=fallback.source if fallback is not None else None,
            fallback_reason=fallback.reason if fallback is not None else "",
        )

    def _record(
        self,
        capability: str,
        state: _Attempt | None,
        meta: envelope.RequestMeta | None,
        started: float,
        exc: ReachError | None,
        fallback: FallbackInfo | None = None,
        latency_ms: float | None = None,
        route: tuple[tuple[str, float | None, str, float], ...] | None = None,
    ) -> None:
        """The call's audit event (queued, never waited for), metrics and span end."""
        if latency_ms is None:
            latency_ms = (time.perf_counter() - started) * 1000
        error = error_class(exc) if exc is not None else None
        if state is not None:
            end_span(state.span, error)
        if self.audit is None and not self.telemetry.metrics_on:
            return
        outcome: Outcome = "ok" if exc is None else "error" if fallback is None else "fallback"
        code = (getattr(exc, "code", "") or "") if exc is not None else ""
        description = (exc.description if isinstance(exc, RemoteError) else str(exc)) if exc else ""
        if state is not None and meta is not None:
            event = self._event(
                capability,
                state,
                meta,
                latency_ms,
                route if route is not None else tuple(state.route),
                outcome,
                error,
                code,
                description,
                fallback,
            )
        else:  # it failed before it was sent (its payload broke the contract, say)
            parent = current_call()
            event = CallEvent(
                ts=self._clock.time() - latency_ms / 1000,
                capability=capability,
                caller=self._client_id,
                caller_agent=parent.agent_id if parent is not None else None,
                outcome=outcome,
                error=error,
                code=code,
                description=description,
                latency_ms=latency_ms,
                fallback=fallback.source if fallback is not None else None,
                fallback_reason=fallback.reason if fallback is not None else "",
            )
        if self.audit is not None:
            self.audit.record(event)
        if self.telemetry.metrics_on:
            self.telemetry.record_call(event)

    def _prepare(
        self,
        capability: str,
        payload: Any,
        timeout: float | None,
        tags: tuple[str, ...],
        idempotency_key: str | None,
    ) -> tuple[_Attempt, envelope.RequestMeta, bytes]:
        """Candidates, deadline, contract pre-check and the encoded body of a call."""
        candidates = self.routes.entries(capability, tags)
        if not candidates and not subjects.is_token(capability):
            # known names come from validated manifests; this one would go on the wire
            raise ConfigurationError(
                f"{capability[:80]!r} is not a capability name: 1-128 letters, digits, '_' or '-'"
            )
        if timeout is not None and not 0 <= timeout <= MAX_TIMEOUT_SEC:
            raise ConfigurationError(
                f"timeout must be between 0 and {MAX_TIMEOUT_SEC:g} seconds, got {timeout!r}"
            )
        # every candidate offers the capability: the first one's contract is the contract
        spec = candidates[0].spec if candidates else None
        sla_ms = spec.latency_sla_ms if spec is not None else DEFAULT_SLA_MS
        now = self._clock.time()
        attempt_timeout = 1.5 * sla_ms / 1000.0
        deadline = now + (timeout if timeout is not None else attempt_timeout)
        parent = current_call()
        if parent is not None and parent.deadline_ms is not None:
            deadline = min(deadline, parent.deadline_ms / 1000.0)
        # what cannot travel (too deep, too many elements, a non-string key) is refused
        # first; the contract check then sees a value of bounded nesting
        plain = codec.check_value(payload)
        if self.validate and spec is not None and spec.input_schema:
            self._validator(spec.input_schema).validate(payload, plain=plain)
        body = codec.encode(payload, checked=False, plain=plain)
        if len(body) > self._max_body:
            # it could never be sent: refused here, nothing counted against any instance
            raise ContractError(
                f"{ROOT}: the payload is {len(body)} bytes packed, more than a request to"
                f" {capability} may carry ({self._max_body})",
                path=ROOT,
                rule="max_bytes",
            )
        state = _Attempt(capability, deadline, attempt_timeout, now, candidates, tags)
        state.retry_timeouts = idempotency_key is not None or (spec is not None and spec.idempotent)
        # W3C trace context: the caller's span is the callee's parent, even without an SDK
        traceparent = parent.traceparent if parent is not None else None
        if self.telemetry.tracing_on:
            state.span = self.telemetry.start_client_span(capability, traceparent)
        traceparent = (
            traceparent_of(state.span) if state.span is not None else new_traceparent(traceparent)
        )
        meta = envelope.RequestMeta(
            call_id=self._next_call_id(),
            # the token of the instance each attempt goes to (``_attempt``): the
            # fabric's own never goes to a callee
            token=None,
            deadline_ms=int(deadline * 1000),
            idempotency_key=idempotency_key,
            caller=parent.agent_id if parent is not None else None,
            traceparent=traceparent,
        )
        self.retry_budget.record_call()
        return state, meta, body

    async def _retry(
        self,
        first_error: ReachError,
        state: _Attempt,
        meta: envelope.RequestMeta,
        body: bytes,
    ) -> Any:
        """Attempts after a failed first one: only retryable errors, with backoff."""
        if not self._should_retry(first_error, state):
            raise first_error
        # tenacity runs attempts 2.. after the first backoff (200 ms + jitter); its own
        # waits are then 400 ms, 800 ms (+ jitter): 200 ms × 2^n overall. After "no
        # responders" the first retry goes to another instance at once: the request
        # reached nobody, so waiting spares no one and only adds latency.
        first_wait = wait_backoff(base=_BACKOFF_BASE).delay(1)
        if isinstance(first_error, NoResponders) and _has_other(state):
            first_wait = 0.0
        if self.max_retries == 0 or self._clock.time() + first_wait >= state.deadline:
            raise first_error
        if not self.retry_budget.try_spend():  # taken only for a retry that will be made
            raise first_error
        if first_wait:
            await asyncio.sleep(first_wait)

        # the budget pays for a retry as it starts (the first one was paid above): a retry
        # that tenacity's stop rules (count, deadline) never start costs nothing
        refused = [False]

        def should_retry(exc: BaseException) -> bool:
            return (
                not refused[0]
                and isinstance(exc, ReachError)
                and self._should_retry(exc, state)
                and state.attempts <= self.max_retries  # another one is allowed
            )

        retrying = AsyncRetrying(
            stop=stop_after_attempt(self.max_retries)
            | stop_at_deadline(
                lambda: state.deadline - self._clock.time() + self._clock.monotonic(),
                clock=self._clock,
            ),
            wait=wait_backoff(base=2 * _BACKOFF_BASE),
            retry=retry_if_exception(should_retry),
            reraise=True,
        )
        latest = first_error
        try:
            async for attempt in retrying:
                with attempt:
                    if attempt.retry_state.attempt_number > 1 and not self.retry_budget.try_spend():
                        refused[0] = True
                        raise latest  # the budget is spent: the last error stands
                    try:
                        return await self._attempt(state, meta, body)
                    except ReachError as exc:
                        latest = exc
                        raise
        except ReachError as exc:
            if not exc.retryable:
                # a retry reached an instance that answered: its business, contract or auth
                # error is the call's outcome as it is, not an exhausted retry
                raise
            raise RetriesExhausted(
                f"{state.capability}: {state.attempts} attempts failed,"
                f" last: {type(exc).__name__}: {exc}",
                attempts=state.attempts,
                last=exc,
            ) from exc
        raise AssertionError("unreachable")  # pragma: no cover

    async def _wait_for_instance(
        self, error: ReachError, state: _Attempt, meta: envelope.RequestMeta, body: bytes
    ) -> tuple[Any, ReachError | None]:
        """While the fabric settles after a reconnect (or the connection is away), a call
        that reached nobody, or whose request was lost with the old socket where a retry
        is safe, waits for an instance within its deadline instead of failing: another
        candidate at once, else the same ones again after a short pause (growing to a few
        tenths of a second), as long as the deadline leaves room. Returns the value, or
        the last error (None: served)."""
        pause = _SETTLE_PAUSE
        while _waits_for_instance(error, state) and self._settling() and not self._closing:
            left = state.deadline - self._clock.time()
            if left <= 0:
                break  # the last error says why, not a deadline passed
            if not _has_other(state):
                if left <= pause:
                    break
                await asyncio.sleep(pause)
                pause = min(pause * 2, _SETTLE_PAUSE_MAX)
                state.failed.clear()  # every candidate is worth another try
            try:
                return await self._attempt(state, meta, body), None
            except ReachError as exc:
                error = exc
        return None, error

    def _next_call_id(self) -> str:
        # unique per caller without a syscall: a random prefix per client and a counter
        self._call_seq += 1
        return f"{self._call_prefix}{self._call_seq:x}"

    def _validator(self, schema: dict[str, Any]) -> Validator:
        # by identity: registry records are immutable, and hashing the schema costs µs
        hit = self._validators.get(id(schema))
        if hit is not None and hit[0] is schema:
            return hit[1]
        validator = compile_schema(schema)
        if len(self._validators) > 1024:
            self._validators.clear()
        self._validators[id(schema)] = (schema, validator)
        return validator

    def _should_retry(self, exc: ReachError, state: _Attempt) -> bool:
        """Whether ``exc`` may be retried (the retry budget is asked only once a retry will
        be made, so that retries never made cost nothing)."""
        if not exc.retryable or self._closing or state.issuer_silent:
            return False
        if isinstance(exc, ReachTimeout) and not state.retry_timeouts:
            return False
        return self._clock.time() < state.deadline

    def _choose(self, state: _Attempt) -> RouteEntry | None:
        route, state.score = choose(
            state.candidates,
            state.capability,
            breakers=self.breakers,
            failed=state.failed,
            skipped=state.skipped,
        )
        return route

    async def _attempt(
        self,
        state: _Attempt,
        meta: envelope.RequestMeta,
        body: bytes,
    ) -> Any:
        state.attempts += 1
        meta.attempt = state.attempts
        now = self._clock.time()
        remaining = min(state.deadline - now, state.attempt_timeout)
        # the callee stops working when this attempt's caller stops waiting
        meta.deadline_ms = int((now + remaining) * 1000)
        if remaining <= 0:
            raise ReachTimeout(
                f"{state.capability}: deadline passed before attempt {state.attempts}"
            )
        chosen = self._choose(state)
        if chosen is None:
            if state.tags:  # the queue group would reach instances without them
                raise NotFound(
                    f"no instance of {state.capability} carries tags {', '.join(state.tags)}"
                )
            subject = subjects.capability(state.capability)
            target = ""
            peer = self._anyone
        else:
            target = chosen.agent_id
            subject = subjects.capability_instance(state.capability, target)
            peer = chosen.peer
        state.last_target = target
        breaker = self.breakers.get(target) if target else None
        if self._security.session is not None:
            token = self._security.call_token(state.capability, target)
            if token is None:
                # the first call to this instance: its token from the issuer, once
                try:
                    token = await self._call_token(state.capability, target, state.deadline)
                except BaseException as exc:
                    # not the instance's fault: its breaker only gives its slot back; the
                    # issuer away fails the call at once (a fallback applies), as an
                    # instance away would
                    state.issuer_silent = isinstance(exc, Unavailable)
                    state.failed.add(target)
                    if breaker is not None:
                        breaker.release()
                    raise
                now = self._clock.time()
                remaining = min(state.deadline - now, state.attempt_timeout)
                meta.deadline_ms = int((now + remaining) * 1000)
            meta.token = token
        conn = self._conn
        if conn is not None and not conn.is_connected:
            remaining = await self._until_connected(conn, state, meta)
        peer.outstanding += 1
        reconnects = conn.reconnects if conn is not None else 0
        started = time.perf_counter()
        try:
            try:
                # nats-py directly (one coroutine less per call); errors translated here
                # batched only to an instance known to read batches, never to the queue
                # group, which may hold instances that do not
                data = await self._nats_request(
                    subject,
                    envelope.pack_request(meta, body),
                    remaining,
                    chosen is not None and chosen.instance.batches,
                )
            except Exception as exc:
                raise self._explain(exc, subject, started, reconnects) from exc
            reply = envelope.unpack_reply(data)
        except NoResponders as exc:
            if self._settling():
                # the fabric is settling after a reconnect: the instance has not
                # reconnected yet, which says nothing of its health
                state.failed.add(target)
                if breaker is not None:
                    breaker.release()
            else:
                self._failed(state, target, breaker)
            state.route.append(
                (target, state.score, "connect", (time.perf_counter() - started) * 1000)
            )
            if target:
                raise
            raise NotFound(f"no instance offers {state.capability}") from exc
        except ReachError as exc:
            if isinstance(exc, Disconnected | ConfigurationError | AuthError):
                # this side's trouble (its connection, its payload, its permissions):
                # nothing said about the target, whose breaker only gives its slot back
                state.failed.add(target)
                if breaker is not None:
                    breaker.release()
            else:
                self._failed(state, target, breaker)
            state.route.append(
                (target, state.score, error_class(exc), (time.perf_counter() - started) * 1000)
            )
            raise
        except asyncio.CancelledError:
            if breaker is not None:
                breaker.release()  # a half-open trial slot comes back
            raise
        finally:
            peer.outstanding -= 1
        elapsed_ms = (time.perf_counter() - started) * 1000
        if reply.ok:
            state.route.append((reply.by or target, state.score, "ok", elapsed_ms))
            if breaker is not None:
                breaker.record_success()
                self.peers.fold(peer, elapsed_ms)
            if reply.by and not target:
                state.last_target = reply.by
            if reply.job:
                return JobHandle(await self._job_store(), reply.job, state.capability, reply.by)
            # msgpack's own limits bound the reply; the callee's values need no second walk
            return codec.decode(reply.body, checked=False)
        error = _remote_error(reply, target)
        state.route.append((reply.by or target, state.score, error_class(error), elapsed_ms))
        if error.retryable:
            # an answer (overloaded, unavailable): the target is reachable, if busy
            state.failed.add(target)
            if breaker is not None:
                breaker.record_failure(answered=True)
        elif breaker is not None:
            if isinstance(error, RemoteError):
                # the instance answered: a business or handler error says nothing of reach
                breaker.record_success()
                self.peers.fold(peer, elapsed_ms)
            else:
                breaker.release()
        raise error

    async def _until_connected(
        self, conn: Connection, state: _Attempt, meta: envelope.RequestMeta
    ) -> float:
        """Wait within the call's deadline for the connection to come back (the request is
        not sent yet: waiting is safe for any call); the attempt's time left after it. A
        login the gate refuses (revoked or changed credentials) ends the wait at once."""
        while not conn.is_connected:
            if conn.login_refused is not None:
                raise AuthenticationFailed(
                    f"{state.capability}: NATS refuses this client's login"
                    f" ({conn.login_refused}): its credentials were revoked or changed"
                )
            left = state.deadline - self._clock.time()
            if conn.is_closed or left <= 0:
                raise Disconnected(
                    f"{state.capability}: the client's connection is closed"
                    if conn.is_closed
                    else f"{state.capability}: {conn.link.describe()}"
                )
            # in slices: a refusal arrives as an error, not as a reconnect
            await conn.wait_connected(min(left, _CONNECT_WAIT_SLICE))
        now = self._clock.time()
        remaining = min(state.deadline - now, state.attempt_timeout)
        if remaining <= 0:
            raise ReachTimeout(f"{state.capability}: deadline passed waiting for the connection")
        meta.deadline_ms = int((now + remaining) * 1000)
        return remaining

    def _explain(self, exc: Exception, subject: str, started: float, reconnects: int) -> ReachError:
        """The typed error of a request that failed in transport: a timeout is a refusal
        when NATS refused these credentials the subject, and a lost connection when the
        client was disconnected (or closed, or reconnected) meanwhile: not the target's
        fault."""
        conn = self._conn
        if conn is None:
            return Disconnected(f"the client was closed during the call to {subject}")
        since = time.monotonic() - (time.perf_counter() - started)
        err = conn.denials.explain(exc, subject, since, subject)
        if isinstance(err, ReachTimeout | Disconnected) and (
            not conn.is_connected or conn.reconnects != reconnects
        ):
            if conn.login_refused is not None:
                # a revoked credential: the server closed the connection and refuses to let
                # it back in; no retry helps
                return AuthenticationFailed(
                    f"NATS refuses this client's login ({conn.login_refused}): its"
                    f" credentials were revoked or changed; the call to {subject} failed"
                )
            if conn.link.down:  # says why: the login refused or unanswered, say
                return Disconnected(f"the call to {subject} failed: {conn.link.describe()}")
            return Disconnected(f"connection to NATS lost during the call to {subject}")
        return err

    def _failed(self, state: _Attempt, target: str, breaker: Any) -> None:
        state.failed.add(target)
        if breaker is not None:
            breaker.record_failure()

    async def _fall_back(
        self,
        capability: str,
        payload: Any,
        fb: Fallback,
        exc: ReachError,
        timeout: float | None,
        started: float,
    ) -> CallResult:
        reason = f"{type(exc).__name__}: {exc}"
        body = codec.encode(payload)
        if fb.cache_max_age_sec is not None:
            hit = self._results.get(capability, body, self._clock.monotonic(), fb.cache_max_age_sec)
            if hit is not None:
                age, value = hit
                return self._fallback_result(capability, value, started, "cache", reason, age=age)
        # A timeout the caller gave bounds the whole call: the backup has what is left of
        # it (none left: no backup). Without one the backup has its own SLA's, as a call
        # of its own would (a served call's deadline still bounds it, as it bounds any).
        left = None if timeout is None else timeout - (time.perf_counter() - started)
        if (fb.backup_capability is not None or fb.backup_tags) and (left is None or left > 0):
            backup = fb.backup_capability or capability
            backup_error: ReachError | None = None
            try:
                # the backup's own failure ends it: no fallback of the fallback (the
                # client's default Fallback would call the backup again, for ever)
                result = await self.call(
                    backup, payload, timeout=left, tags=fb.backup_tags, fallback=NO_FALLBACK
                )
            except ReachError as failed:
                backup_error = failed
            if backup_error is not None:
                reason += f"; backup {backup} failed: {type(backup_error).__name__}: {backup_error}"
            else:
                return CallResult(
                    value=result.value,
                    capability=capability,
                    call_id=result.call_id,
                    agent_id=result.agent_id,
                    attempts=result.attempts,
                    latency_ms=(time.perf_counter() - started) * 1000,
                    fallback=FallbackInfo(source="backup", reason=reason, backup=backup),
                )
        if fb.default is not MISSING:
            return self._fallback_result(capability, fb.default, started, "default", reason)
        raise exc

    def _fallback_result(
        self,
        capability: str,
        value: Any,
        started: float,
        source: Any,
        reason: str,
        age: float | None = None,
    ) -> CallResult:
        return CallResult(
            value=value,
            capability=capability,
            call_id="",
            agent_id="",
            attempts=0,
            latency_ms=(time.perf_counter() - started) * 1000,
            fallback=FallbackInfo(source=source, reason=reason, age_sec=age),
        )


def _waits_for_instance(error: ReachError, state: _Attempt) -> bool:
    """Whether a call may wait for an instance while the fabric settles after ``error``:
    it reached nobody, or found every instance unhealthy (probed while they were still
    reconnecting), or it was lost with a connection and is safe to send again (where a
    timeout would be retried)."""
    return isinstance(error, NoResponders | NoHealthyInstance) or (
        isinstance(error, Disconnected) and state.retry_timeouts
    )


def _has_other(state: _Attempt) -> bool:
    """Is there a healthy-looking candidate this call has not failed on yet?"""
    return any(e.agent_id not in state.failed and not e.unhealthy for e in state.candidates)


async def _not_connected(subject: str, data: bytes, timeout: float, batch: bool) -> bytes:
    raise RuntimeError("connect the client first: `async with ReachClient() as client:`")


_BACKOFF_BASE = 0.2
#: how often a call waiting for its connection checks whether the login was refused
_CONNECT_WAIT_SLICE = 0.25
#: the first pause of a call waiting for an instance while the fabric settles, and its cap
_SETTLE_PAUSE = 0.05
_SETTLE_PAUSE_MAX = 0.4
