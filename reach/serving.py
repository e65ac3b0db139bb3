"""The callee side of a call: from request bytes to reply bytes.

Order matters and is part of the contract with callers:

1. unpack the envelope (bad bytes → ``contract``)
2. honour the deadline (already passed → ``timeout``, the handler never runs)
3. answer a repeat of a call id / idempotency key with the first result
4. admission: not ready or over declared capacity → ``unavailable`` at once
5. decode and validate the input (→ ``contract``, naming the field)
6. run the handler under the deadline, with the call in a context variable
7. validate the output (→ ``contract``), encode, reply
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import logging
import time
import typing
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from pydantic import BaseModel, ValidationError

from reach import codec, envelope
from reach.clock import Clock
from reach.context import enter_call, set_current
from reach.contract import Validator, compile_schema
from reach.errors import (
    AuthenticationFailed,
    BusinessError,
    CodecError,
    ConfigurationError,
    ContractError,
    ReachError,
    RemoteError,
)
from reach.jobs import JobRecord, JobStore, new_job_id
from reach.models import Capability, format_validation_error
from reach.security.replay import MAX_AHEAD_SEC, RecentCalls
from reach.security.tokens import TokenVerifier, call_audience
from reach.tasks import DEADLINE_CANCEL, EAGER, PENDING_DEADLINE, DeadlineReaper
from reach.telemetry import Telemetry, end_span, traceparent_of

__all__ = ["REPLY_FRAMING", "CallServer", "Endpoint", "ReplyCache", "endpoint_for"]

#: bytes a reply may need around it on the wire (a batch's framing and reply token)
REPLY_FRAMING = 64

log = logging.getLogger("reach.serving")

Handler = Callable[[Any], Awaitable[Any]]
_RETRYABLE_KINDS = frozenset({"timeout", "unavailable"})


def _model_of(annotation: Any) -> type[BaseModel] | None:
    return (
        annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
    )


@dataclass(frozen=True)
class Endpoint:
    """One capability as served: its handler and compiled contract."""

    capability: Capability
    handler: Handler
    input_validator: Validator
    output_validator: Validator
    input_model: type[BaseModel] | None = None
    output_model: type[BaseModel] | None = None
    #: the audience of the tokens its calls carry (``call_audience``; ``endpoint_for``
    #: sets it)
    audience: str = ""

    @property
    def name(self) -> str:
        return self.capability.name


def endpoint_for(capability: Capability, handler: Handler) -> Endpoint:
    """Compile a capability's contract; pydantic models in the handler's signature win."""
    try:
        hints = typing.get_type_hints(handler)
    except Exception:
        hints = {}
    params = [p for p in inspect.signature(handler).parameters.values()]
    input_model = _model_of(hints.get(params[0].name)) if params else None
    output_model = _model_of(hints.get("return"))
    input_schema = capability.input_schema
    if input_model is not None and not input_schema:
        input_schema = input_model.model_json_schema()
    output_schema = capability.output_schema
    if output_model is not None and not output_schema:
        output_schema = output_model.model_json_schema()
    return Endpoint(
        capability=capability.model_copy(
            update={"input_schema": input_schema, "output_schema": output_schema}
        ),
        handler=handler,
        input_validator=compile_schema(input_schema),
        output_validator=compile_schema(output_schema),
        input_model=input_model,
        output_model=output_model,
        audience=call_audience(capability.name),
    )


class ReplyCache:
    """Recent replies by call id / idempotency key, and the calls still running.

    Bounded by entry count and by total reply bytes; entries expire after ``ttl_sec``.
    A future for a running call is only created when a repeat actually waits on it.
    """

    def __init__(
        self, max_entries: int = 10_000, ttl_sec: float = 300.0, max_bytes: int = 64 << 20
    ) -> None:
        self._done: OrderedDict[str, tuple[float, bytes]] = OrderedDict()
        self._running: dict[str, asyncio.Future[bytes] | None] = {}
        self._max = max_entries
        self._max_bytes = max_bytes
        self._bytes = 0
        self._ttl = ttl_sec

    def get(self, key: str, now: float) -> bytes | asyncio.Future[bytes] | None:
        hit = self._done.get(key)
        if hit is not None:
            if now - hit[0] <= self._ttl:
                return hit[1]
            del self._done[key]
            self._bytes -= len(hit[1])
        if key not in self._running:
            return None
        future = self._running[key]
        if future is None:
            future = self._running[key] = asyncio.get_running_loop().create_future()
        return future

    def start(self, key: str) -> None:
        self._running[key] = None

    def finish(self, key: str, reply: bytes, now: float, *, remember: bool = True) -> None:
        future = self._running.pop(key, None)
        if future is not None and not future.done():
            future.set_result(reply)
        if remember:
            old = self._done.pop(key, None)
            if old is not None:
                self._bytes -= len(old[1])
            self._done[key] = (now, reply)
            self._bytes += len(reply)
            while self._done and (len(self._done) > self._max or self._bytes > self._max_bytes):
                _, (_, evicted) = self._done.popitem(last=False)
                self._bytes -= len(evicted)


class _Admission:
    """Declared capacity: max concurrency for the agent, qps per capability (token bucket)."""

    def __init__(self, qps: float | None, clock: Clock) -> None:
        self._rate = qps
        self._burst = max(1.0, qps or 0.0)
        self._tokens = self._burst
        self._clock = clock
        self._last = clock.monotonic()

    def take(self) -> bool:
        if self._rate is None:
            return True
        now = self._clock.monotonic()
        self._tokens = min(self._burst, self._tokens + (now - self._last) * self._rate)
        self._last = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False


class CallServer:
    """Runs calls for one agent: admission, dedup, validation, deadline, error mapping."""

    def __init__(
        self,
        agent_id: str,
        *,
        max_concurrency: int,
        clock: Clock,
        is_ready: Callable[[], tuple[bool, str]],
        on_done: Callable[[], None] | None = None,
        reply_cache: ReplyCache | None = None,
        jobs: JobStore | None = None,
        job_timeout_sec: float = 3600.0,
    ) -> None:
        self.agent_id = agent_id
        self.max_concurrency = max_concurrency
        self.in_flight = 0
        self.completed = 0
        self.last_completion_at: float | None = None
        self._clock = clock
        self._is_ready = is_ready
        self._on_done = on_done
        self._cache = reply_cache or ReplyCache()
        self._admission: dict[str, _Admission] = {}
        #: set for async-mode agents: calls become jobs stored in REACH_JOBS
        self.jobs = jobs
        self.job_timeout_sec = job_timeout_sec
        self._jobs_running: set[asyncio.Task[None]] = set()
        self._reaper = DeadlineReaper()
        #: set when the fabric issues tokens: every call must carry a valid one
        self.verifier: TokenVerifier | None = None
        self.denials = 0
        #: told of every denial (capability, request meta, code, description, client id):
        #: the agent writes it to the audit stream
        self.on_denied: Callable[[str, envelope.RequestMeta, str, str, str], None] | None = None
        #: set when an OpenTelemetry SDK is configured: SERVER spans and served-call counts
        self.telemetry: Telemetry | None = None
        #: the largest reply the server carries (the agent sets it from the connection's
        #: max_payload): a larger output is answered with a contract error, not dropped
        self.max_reply_bytes: int | None = None
        # (call id, attempt) pairs served, until their deadlines: a byte-for-byte replay
        # is refused, a retry (the next attempt) is not
        self._recent = RecentCalls(clock=clock)

    def _error(self, kind: str, code: str, description: str) -> bytes:
        return envelope.pack_error(kind, code, description, self.agent_id)

    def stopping(self) -> bytes:
        """The reply to a call that arrives while the agent stops: not served, retry
        elsewhere (the handler never ran)."""
        return self._error("unavailable", "shutting_down", f"{self.agent_id} is stopping")

    def refuse_batch(self, description: str) -> bytes:
        """The reply to a batch that cannot be read: it answers each of its calls."""
        log.warning("refused a batch of calls to %s: %s", self.agent_id, description)
        return self._error("contract", "bad_batch", description)

    async def handle(self, endpoint: Endpoint, data: bytes) -> bytes:
        """Serve one request; always returns reply bytes, never raises (but CancelledError)."""
        try:
            meta, body = envelope.unpack_request(data)
        except CodecError as exc:
            return self._error("contract", "bad_envelope", str(exc))
        client = ""
        if self.verifier is not None:
            # before anything else is decoded: no token, no work
            denied, client = self._check_token(endpoint, meta)
            if denied is not None:
                return denied
        now = self._clock.time()
        if meta.deadline_ms is not None and meta.deadline_ms <= now * 1000:
            return self._error("timeout", "deadline_passed", "the caller's deadline had passed")
        # a repeat is the same capability from the same client: keys never leak across them
        key = f"{endpoint.name}/{client}/{meta.idempotency_key or meta.call_id}"
        seen = self._cache.get(key, now)
        if seen is not None:
            return seen if isinstance(seen, bytes) else await asyncio.shield(seen)
        ready, why = self._is_ready()
        if not ready:
            return self._error("unavailable", "not_ready", f"{self.agent_id} not ready: {why}")
        if self.in_flight >= self.max_concurrency:
            return self._error(
                "unavailable",
                "over_capacity",
                f"{self.agent_id} is at its max concurrency ({self.max_concurrency})",
            )
        admission = self._admission.get(endpoint.name)
        if admission is None:
            admission = self._admission[endpoint.name] = _Admission(
                endpoint.capability.qps, self._clock
            )
        if not admission.take():
            return self._error(
                "unavailable",
                "over_qps",
                f"{endpoint.name} at {self.agent_id} is over its declared"
                f" {endpoint.capability.qps} qps",
            )
        cache = self._cache
        cache.start(key)
        self.in_flight += 1
        reply = b""
        remember = True
        kind = "ok"
        tel = self.telemetry
        span = (
            tel.start_server_span(endpoint.name, self.agent_id, meta.traceparent)
            if tel is not None
            else None
        )
        try:
            arg = _decode_input(endpoint, body)
            if isinstance(arg, _Failure):
                kind = arg.kind
                reply, remember = self._fail(*arg)
            elif self.jobs is not None:
                reply = await self._accept_job(endpoint, meta, arg, client)
            else:
                outcome = await self._invoke(
                    endpoint,
                    meta,
                    arg,
                    meta.deadline_ms,
                    meta.traceparent if span is None else traceparent_of(span),
                )
                if isinstance(outcome, _Failure):
                    kind = outcome.kind
                    reply, remember = self._fail(*outcome)
                else:
                    reply = envelope.pack_ok(outcome[0], self.agent_id)
                    limit = self.max_reply_bytes
                    if limit is not None and len(reply) > limit:
                        kind = "contract"
                        reply, remember = self._fail(
                            "contract",
                            "output_too_large",
                            f"output of {endpoint.name} is {len(reply)} bytes packed, more than"
                            f" a message may carry ({limit})",
                        )
        except asyncio.CancelledError:
            remember = False
            reply = self.stopping()
            raise
        except Exception as exc:  # a bug on this side: the caller hears of it, not silence
            log.exception("serving a call to %s failed", endpoint.name)
            kind, remember = "internal", False
            reply = self._error("internal", type(exc).__name__, f"{endpoint.name}: {exc}")
        finally:
            self.in_flight -= 1
            self.completed += 1
            self.last_completion_at = done_at = self._clock.time()
            cache.finish(key, reply, done_at, remember=remember)
            if self._on_done is not None:
                self._on_done()
            if tel is not None:
                tel.record_served(endpoint.name, kind)
                end_span(span, None if kind == "ok" else kind)
        return reply

    def _check_token(
        self, endpoint: Endpoint, meta: envelope.RequestMeta
    ) -> tuple[bytes | None, str]:
        """(None, client id) if the call may proceed, else the ``denied`` reply (counted)."""
        assert self.verifier is not None
        if meta.token is None:
            return self._deny(endpoint, meta, "no_token", f"{endpoint.name} requires a token"), ""
        try:
            # a token for this capability's calls: no other (a fabric token, another
            # capability's) is accepted, so no callee can use what callers sent it elsewhere
            claims = self.verifier.verify(meta.token, endpoint.audience)
        except AuthenticationFailed as exc:
            return self._deny(endpoint, meta, "authentication_failed", str(exc)), ""
        required = endpoint.capability.security_level
        if claims.level < required:
            return self._deny(
                endpoint,
                meta,
                f"insufficient_level:{required}:{claims.level}",
                f"{endpoint.name} requires clearance level {required};"
                f" client {claims.client_id} holds {claims.level}",
                claims.client_id,
            ), ""
        # every call has a deadline not too far ahead (none: the callee's own), and is
        # served once while it lives: a copy is refused here, and late once it passed
        now = self._clock.time()
        if meta.deadline_ms is None:
            sla_sec = endpoint.capability.latency_sla_ms / 1000.0
            meta.deadline_ms = int((now + 1.5 * sla_sec) * 1000)
        elif meta.deadline_ms > (now + MAX_AHEAD_SEC) * 1000:
            denied = self._deny(
                endpoint,
                meta,
                "deadline_too_far",
                f"call {meta.call_id}: its deadline lies more than {MAX_AHEAD_SEC:g} s ahead",
                claims.client_id,
            )
            return denied, ""
        if not self._recent.first_time(meta.call_id, meta.attempt, meta.deadline_ms / 1000.0):
            denied = self._deny(
                endpoint,
                meta,
                "replayed",
                f"call {meta.call_id} attempt {meta.attempt} replayed",
                claims.client_id,
            )
            return denied, ""
        return None, claims.client_id

    def _deny(
        self,
        endpoint: Endpoint,
        meta: envelope.RequestMeta,
        code: str,
        description: str,
        client: str = "",
    ) -> bytes:
        self.denials += 1
        log.warning("denied a call to %s: %s (%s)", self.agent_id, description, code)
        if self.on_denied is not None:
            self.on_denied(endpoint.name, meta, code, description, client)
        return self._error("denied", code, description)

    def watch_deadline(self, when: float) -> None:
        """Cancel the running call at loop time ``when`` (its task may not exist yet)."""
        if EAGER.get():
            PENDING_DEADLINE.set(when)  # run_eagerly hands it over with the task it creates
            return
        task = asyncio.current_task()
        if task is not None:
            self._reaper.watch(task, when)

    def watch_task(self, task: asyncio.Task[None], when: float | None) -> None:
        if when is not None:
            self._reaper.watch(task, when)

    def _fail(self, kind: str, code: str, description: str) -> tuple[bytes, bool]:
        # a timed-out or refused attempt may be retried with the same call id: not remembered
        return self._error(kind, code, description), kind not in _RETRYABLE_KINDS

    async def _invoke(
        self,
        endpoint: Endpoint,
        meta: envelope.RequestMeta,
        arg: Any,
        deadline_ms: int | None,
        traceparent: str | None = None,
    ) -> tuple[bytes, Any] | _Failure:
        """Run the handler under the deadline: the encoded and plain result, or a failure.
        ``traceparent`` is what calls made by the handler continue (its SERVER span)."""
        enter_call(
            meta.call_id,
            endpoint.name,
            self.agent_id,
            deadline_ms,
            meta.attempt,
            meta.caller,
            traceparent or meta.traceparent,
        )
        try:
            if deadline_ms is not None:
                when = asyncio.get_running_loop().time() + (deadline_ms / 1000.0 - time.time())
                if EAGER.get():
                    PENDING_DEADLINE.set(when)  # run_eagerly hands it over with its task
                else:
                    self.watch_deadline(when)
            result = await endpoint.handler(arg)
        except asyncio.CancelledError as exc:
            task = asyncio.current_task()
            if task is None or exc.args != (DEADLINE_CANCEL,):
                raise
            task.uncancel()
            return _Failure(
                "timeout", "deadline_passed", f"{endpoint.name} stopped at the caller's deadline"
            )
        except ReachError as exc:
            return _failure_of(endpoint.name, exc)
        except Exception as exc:
            log.exception("handler of %s crashed", endpoint.name)
            return _Failure("internal", type(exc).__name__, str(exc) or type(exc).__name__)
        finally:
            set_current(None)
        try:
            if isinstance(result, BaseModel):
                result = result.model_dump(mode="json")
            plain = codec.check_value(result)  # what cannot travel, first (a CodecError)
            endpoint.output_validator.validate(result, plain=plain)
            return codec.encode(result, checked=False, plain=plain), result
        except ContractError as exc:
            return _Failure("contract", "output", f"output of {endpoint.name}: {exc}")

    async def _accept_job(
        self, endpoint: Endpoint, meta: envelope.RequestMeta, arg: Any, client: str
    ) -> bytes:
        """Async mode: record the job durably, reply with its id, run it in the background."""
        assert self.jobs is not None
        job_id = new_job_id(client, self.agent_id)
        record = JobRecord(
            job_id=job_id,
            capability=endpoint.name,
            agent_id=self.agent_id,
            status="accepted",
            accepted_at=self._clock.time(),
            call_id=meta.call_id,
        )
        await self.jobs.put(record)
        # a context of its own: the job must not inherit an eager step's state
        context = contextvars.copy_context()
        context.run(EAGER.set, False)
        task = asyncio.create_task(self._run_job(endpoint, meta, arg, record), context=context)
        self._jobs_running.add(task)
        task.add_done_callback(self._jobs_running.discard)
        body = codec.encode({"job_id": job_id}, checked=False)
        return envelope.pack_ok(body, self.agent_id, job=job_id)

    async def _run_job(
        self, endpoint: Endpoint, meta: envelope.RequestMeta, arg: Any, record: JobRecord
    ) -> None:
        limit = max(self.job_timeout_sec, 10 * endpoint.capability.latency_sla_ms / 1000)
        deadline_ms = int((self._clock.time() + limit) * 1000)
        outcome = await self._invoke(endpoint, meta, arg, deadline_ms)
        finished = self._clock.time()
        if isinstance(outcome, _Failure):
            done = record.model_copy(
                update={
                    "status": "failed",
                    "finished_at": finished,
                    "error_kind": outcome.kind,
                    "error_code": outcome.code,
                    "error": outcome.description,
                }
            )
        else:
            done = record.model_copy(
                update={"status": "succeeded", "finished_at": finished, "result": outcome[1]}
            )
        try:
            await self.jobs.put(done)  # type: ignore[union-attr]
            return
        except (CodecError, ConfigurationError) as exc:  # a result too large to be kept
            log.error("the result of job %s cannot be stored: %s", record.job_id, exc)
            kind, code, why = "contract", "output", f"the result cannot be stored: {exc}"
        except ReachError as exc:
            log.error("could not store the result of job %s: %s", record.job_id, exc)
            return
        except Exception as exc:  # a bug: said in the record, not left "accepted" for ever
            log.exception("could not store the result of job %s", record.job_id)
            kind, code, why = "internal", type(exc).__name__, f"the result cannot be stored: {exc}"
        failed = record.model_copy(
            update={
                "status": "failed",
                "finished_at": finished,
                "error_kind": kind,
                "error_code": code,
                "error": why,
            }
        )
        try:
            await self.jobs.put(failed)  # type: ignore[union-attr]
        except ReachError as exc:
            log.error("could not store the failure of job %s: %s", record.job_id, exc)


class _Failure(NamedTuple):
    kind: str
    code: str
    description: str


def _failure_of(capability: str, exc: ReachError) -> _Failure:
    """What the caller hears of a ReachError the handler of ``capability`` raised: its own
    (an Unavailable, a BusinessError it chose) as it is; one of a call it made and did not
    handle as an internal error of this handler, whatever its kind (``ReachError.dependency``),
    except a business refusal, which it passes on."""
    if exc.dependency is not None and not isinstance(exc, BusinessError):
        return _Failure(
            "internal",
            "dependency_failed",
            f"{capability}: its call to {exc.dependency} failed: {type(exc).__name__}: {exc}",
        )
    if isinstance(exc, RemoteError):
        return _Failure(exc.kind, exc.code, exc.description)
    if isinstance(exc, ContractError) and exc.rule:
        return _Failure(exc.kind, exc.rule, str(exc))  # the rule it names, as the caller's own
    return _Failure(exc.kind, type(exc).__name__, str(exc))


def _decode_input(endpoint: Endpoint, body: bytes) -> Any:
    """The handler's argument from the request body, or a contract _Failure."""
    try:
        payload = codec.decode(body, checked=False)
        plain = codec.check_value(payload)  # within the default limits, or a CodecError
        endpoint.input_validator.validate(payload, plain=plain)
        if endpoint.input_model is not None:
            return endpoint.input_model.model_validate(payload)
        return payload
    except ContractError as exc:
        return _Failure("contract", exc.rule or "input", str(exc))
    except ValidationError as exc:
        return _Failure("contract", "input", "; ".join(format_validation_error(exc)))
