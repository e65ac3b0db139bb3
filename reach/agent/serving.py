"""The callee side of a call: from request bytes to reply bytes.

Order matters and is part of the contract with callers:

1. unpack the envelope (bad bytes → ``contract``)
2. honour the deadline (already passed → ``timeout``, the handler never runs)
3. answer a repeat of a call id / idempotency key with the first result
4. admission: not ready or over the declared qps → ``unavailable`` at once; at max
   concurrency → a brief wait for a slot, first come first served, if one can be expected
   in time, else ``unavailable``/``over_capacity`` at once
5. decode and validate the input (→ ``contract``, naming the field)
6. run the handler under the deadline, with the call in a context variable
7. validate the output (→ ``contract``), encode, reply

A capability as served (handler, contract) is ``reach.agent.endpoint``; repeats are answered
from ``reach.agent.replycache``; async-mode calls become jobs run by ``reach.agent.jobs.JobRunner``.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel

from reach.agent.admission import QpsBucket
from reach.agent.context import enter_call, set_current
from reach.agent.endpoint import Endpoint, Failure, decode_input, endpoint_for, failure_of
from reach.agent.jobs import JobRunner, JobStore
from reach.agent.replycache import ReplyCache
from reach.audit.events import served_event
from reach.audit.writer import AuditWriter
from reach.clock import Clock
from reach.deadline import Deadline
from reach.errors import AuthenticationFailed, CodecError, ContractError, ReachError
from reach.security.claims import JOB_READERS, ROLE_JOBS, Claims
from reach.security.refusals import RefusalLog
from reach.security.replay import MAX_AHEAD_SEC, RecentCalls
from reach.security.tokens import TokenVerifier
from reach.tasks import DEADLINE_CANCEL, EAGER, PENDING_DEADLINE, DeadlineReaper, run_eagerly
from reach.telemetry import Span, Telemetry, end_span, trace_id_of, traceparent_of
from reach.transport import Connection, Message, ReplyBatch
from reach.wire import codec, envelope

__all__ = ["REPLY_FRAMING", "CallServer", "Endpoint", "ReplyCache", "endpoint_for"]

#: bytes a reply may need around it on the wire (a batch's framing and reply token)
REPLY_FRAMING = 64

log = logging.getLogger("reach.agent.serving")

_RETRYABLE_KINDS = frozenset({"timeout", "unavailable"})

#: what ``_admit`` says of a call that arrives at max concurrency (no reply is empty): it
#: may wait for a slot
_FULL = b""
#: the weight of the latest call in the moving average of how long a call holds its slot
_HOLD_WEIGHT = 0.2
#: calls waiting for a slot, at most, as a multiple of max_concurrency: whatever the
#: average promises (calls that suddenly take longer must not pile up unbounded)
_MAX_WAITING_PER_SLOT = 16


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
        #: calls holding a slot (running, or handed one and about to run)
        self.in_flight = 0
        #: calls waiting for a slot (``_wait_for_slot``)
        self.waiting = 0
        # the waiting calls' futures, first come first served (those given up stay
        # until they reach the front, done); one is handed a slot with True
        self._waiters: deque[asyncio.Future[bool]] = deque()
        # moving average of how long a call holds its slot, seconds (0: none done yet)
        self._hold_sec = 0.0
        self.completed = 0
        self.last_completion_at: float | None = None
        #: calls are served (False while the agent stops: each is told so at once)
        self.accepting = True
        self._clock = clock
        self._is_ready = is_ready
        self._on_done = on_done
        self._cache = reply_cache or ReplyCache()
        self._admission: dict[str, QpsBucket] = {}
        #: set for async-mode agents: calls become jobs stored in REACH_JOBS
        self.jobs = jobs
        self.job_timeout_sec = job_timeout_sec
        self._job_runner = JobRunner(agent_id, clock, self._invoke)
        self._reaper = DeadlineReaper()
        #: set when the fabric issues tokens: every call must carry a valid one
        self.verifier: TokenVerifier | None = None
        self.denials = 0
        #: the denials' log lines: the first few of each interval, then a summary (a
        #: flood of forged calls must not write the log as fast as it comes)
        self._denied_log = RefusalLog(log, f"calls to {agent_id}", clock=clock)
        #: told of every denial (capability, request meta, code, description, the token's
        #: claims if it was valid): the agent writes it to the audit stream
        self.on_denied: (
            Callable[[str, envelope.RequestMeta, str, str, Claims | None], None] | None
        ) = None
        #: set while the agent writes audit events: a call whose caller does not record
        #: it (its request does not say ``au``) is recorded there, and its ok reply says
        #: so (``aud``)
        self.audit: AuditWriter | None = None
        #: set when an OpenTelemetry SDK is configured: SERVER spans and served-call counts
        self.telemetry: Telemetry | None = None
        #: the largest reply the server carries (the agent sets it from the connection's
        #: max_payload): a larger output is answered with a contract error, not dropped
        self.max_reply_bytes: int | None = None
        # (call id, attempt) pairs served, until their deadlines: a byte-for-byte replay
        # is refused, a retry (the next attempt) is not
        self._recent = RecentCalls(clock=clock)

    def _error(self, kind: str, code: str, description: str, path: str = "") -> bytes:
        return envelope.pack_error(kind, code, description, self.agent_id, path)

    def stop_accepting(self) -> None:
        """Calls are served no more: each that arrives is told so at once (``stopping``),
        and so is each call waiting for a slot; the calls running finish."""
        self.accepting = False
        waiters = self._waiters
        while waiters:
            slot = waiters.popleft()
            if not slot.done():
                self.waiting -= 1
                slot.set_result(False)

    def stopping(self, endpoint: Endpoint) -> bytes:
        """The reply to a call that arrives while the agent stops: not served, retry
        elsewhere (the handler never ran)."""
        return self._refuse(
            endpoint, "unavailable", "shutting_down", f"{self.agent_id} is stopping"
        )

    def _refuse(
        self, endpoint: Endpoint, kind: str, code: str, description: str, path: str = ""
    ) -> bytes:
        """The error reply to a call of ``endpoint``, counted as one of its errors."""
        stats = endpoint.stats
        stats.errors += 1
        stats.last_code = code
        stats.last_description = description
        return self._error(kind, code, description, path)

    def refuse_batch(self, endpoint: Endpoint, description: str) -> bytes:
        """The reply to a batch that cannot be read: it answers each of its calls."""
        log.warning("refused a batch of calls to %s: %s", self.agent_id, description)
        endpoint.stats.requests += 1
        return self._refuse(endpoint, "contract", "bad_batch", description)

    def message_handler(
        self, endpoint: Endpoint, conn: Connection, tasks: set[asyncio.Task[None]]
    ) -> Callable[[Message], None]:
        """What serves the calls to ``endpoint`` as their messages arrive on ``conn``
        (``Connection.subscribe_inline``); calls that outlive their message join ``tasks``.

        A call runs right there, as its message is read, until it has to wait; only then
        does it get a task of its own, so a handler that waits never holds up the next
        message. A message may hold a batch of calls: each is served as if it came alone,
        and the replies ready together go back together."""
        respond = conn.replier()

        async def serve(msg: Message) -> None:
            respond(msg.reply, await self.handle(endpoint, msg.data))

        async def serve_one_of(batch: ReplyBatch, token: str, request: bytes) -> None:
            batch.add(token, await self.handle(endpoint, request))

        def continued(task: asyncio.Task[None], deadline: float | None) -> None:
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            self.watch_task(task, deadline)

        def on_call(msg: Message) -> None:
            if not self.accepting:
                # stopping (subscriptions drain one by one): said at once, so the caller
                # goes to another instance now rather than after its timeout
                endpoint.stats.requests += 1
                respond(msg.reply, self.stopping(endpoint))
                return
            if not envelope.is_batch(msg.data):
                run_eagerly(serve(msg), on_task=continued)
                set_current(None)
                return
            try:
                requests = envelope.unpack_batch(msg.data)
            except CodecError as exc:
                respond(msg.reply, self.refuse_batch(endpoint, str(exc)))
                return
            batch = conn.reply_batch(msg)
            for token, request in requests:
                run_eagerly(serve_one_of(batch, token, request), on_task=continued)
                set_current(None)
            batch.flush()

        return on_call

    async def handle(self, endpoint: Endpoint, data: bytes) -> bytes:
        """Serve one request; always returns reply bytes, never raises (but CancelledError)."""
        endpoint.stats.requests += 1
        try:
            meta, body = envelope.unpack_request(data)
        except CodecError as exc:
            return self._refuse(endpoint, "contract", "bad_envelope", str(exc), exc.path)
        client = ""
        actor: str | None = None  # the gateway calling for ``client``, if one is
        if self.verifier is not None:
            # before anything else is decoded: no token, no work
            checked = self._check_token(endpoint, meta)
            if isinstance(checked, bytes):
                return checked  # denied
            client, actor = checked.client_id, checked.actor
        # a repeat is the same capability from the same client: keys never leak across them
        key = f"{endpoint.name}/{client}/{meta.idempotency_key or meta.call_id}"
        started = self._clock.time()
        dl = meta.deadline_ms  # on this agent's clock from here: handler, nested calls, reaper
        deadline = None if dl is None else Deadline.from_wire(dl, self._clock)
        if deadline is not None and deadline.expired():
            return self._refuse(
                endpoint, "timeout", "deadline_passed", "the caller's deadline had passed"
            )
        seen = self._cache.get(key, started)
        if seen is not None:
            reply = seen if isinstance(seen, bytes) else await asyncio.shield(seen)
            if self.audit is not None and not meta.audit:  # answered: recorded too
                self._record(endpoint, meta, client, actor, reply, started, self._clock.time())
            return reply
        admitted = started
        refused = self._admit(endpoint)  # None: admitted, its slot counted
        if refused is not None:  # refused, or at max concurrency (``_FULL``): it may wait
            refused = refused or await self._wait_for_slot(endpoint, deadline)
            if refused is not None:
                return refused
            admitted = self._clock.time()  # it waited: the slot it was handed is counted
        self._cache.start(key)
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
            arg = decode_input(endpoint, body)
            if isinstance(arg, Failure):
                kind = arg.kind
                reply, remember = self._fail(endpoint, *arg)
            elif endpoint.job and self.jobs is not None:
                # the job's record is read by whoever holds the connection that called: a
                # gateway calling for a client (``actor``), else the client
                reply = await self._job_runner.accept(
                    self.jobs, endpoint, meta, arg, actor or client, self.job_timeout_sec
                )
            else:
                traceparent = meta.traceparent if span is None else traceparent_of(span)
                outcome = await self._invoke(endpoint, meta, arg, deadline, traceparent)
                audited = self.audit is not None and not meta.audit
                reply, remember, kind = self._reply_of(endpoint, outcome, audited)
        except asyncio.CancelledError:
            remember = False
            reply = self.stopping(endpoint)
            raise
        except Exception as exc:  # a bug on this side: the caller hears of it, not silence
            log.exception("serving a call to %s failed", endpoint.name)
            kind, remember = "internal", False
            reply = self._refuse(
                endpoint, "internal", type(exc).__name__, f"{endpoint.name}: {exc}"
            )
        finally:
            done_at = self._finished(endpoint, key, reply, remember, kind, span, admitted)
            if self.audit is not None and not meta.audit and reply:
                self._record(endpoint, meta, client, actor, reply, started, done_at, kind)
        return reply

    def _record(
        self,
        endpoint: Endpoint,
        meta: envelope.RequestMeta,
        client: str,
        actor: str | None,
        reply: bytes,
        started: float,
        done_at: float,
        kind: str = "",
    ) -> None:
        """The callee's audit event of a call it answered with ``reply`` (``kind``: "ok"
        or its error kind; "": read from the reply), by ``client`` or its gateway ``actor``."""
        assert self.audit is not None
        code = description = ""
        if kind != "ok":
            try:
                answer = envelope.unpack_reply(reply)
            except CodecError:
                answer = envelope.Reply(ok=False, kind="internal", code="bad_reply")
            kind = "ok" if answer.ok else answer.kind
            code, description = answer.code, answer.description
        self.audit.record(
            served_event(
                ts=started,
                capability=endpoint.name,
                callee=self.agent_id,
                call_id=meta.call_id,
                caller=client,
                caller_agent=meta.caller,
                trace_id=trace_id_of(meta.traceparent),
                latency_ms=(done_at - started) * 1000,
                kind=kind,
                code=code,
                description=description,
                actor=actor,
            )
        )

    def _admit(self, endpoint: Endpoint) -> bytes | None:
        """None if the call is admitted (its slot counted), ``_FULL`` if the instance is at
        its max concurrency (the call may wait for a slot), else the ``unavailable``
        reply: not ready, or over the capability's declared qps. Nothing is made or
        awaited while there is room: this runs on every call."""
        ready, why = self._is_ready()
        if not ready:
            return self._refuse(
                endpoint, "unavailable", "not_ready", f"{self.agent_id} not ready: {why}"
            )
        if self.in_flight >= self.max_concurrency:
            return _FULL
        refused = self._take_qps(endpoint)
        if refused is None:
            self.in_flight += 1
        return refused

    def _take_qps(self, endpoint: Endpoint) -> bytes | None:
        """None if the capability's declared qps admits one more call, else ``over_qps``."""
        admission = self._admission.get(endpoint.name)
        if admission is None:
            admission = self._admission[endpoint.name] = QpsBucket(
                endpoint.capability.qps, self._clock
            )
        if not admission.take():
            return self._refuse(
                endpoint,
                "unavailable",
                "over_qps",
                f"{endpoint.name} at {self.agent_id} is over its declared"
                f" {endpoint.capability.qps} qps",
            )
        return None

    def _wait_bound(self, endpoint: Endpoint, deadline: Deadline | None) -> float:
        """How long a call at max concurrency may wait for a slot: at most its
        capability's latency SLA, and only as long as its deadline still leaves it the
        SLA to run (no deadline: the fabric's default, 1.5 × the SLA from now). Zero or
        less: no wait."""
        sla = endpoint.capability.latency_sla_ms / 1000.0
        left = deadline.remaining() if deadline is not None else 1.5 * sla
        return min(sla, left - sla)

    async def _wait_for_slot(self, endpoint: Endpoint, deadline: Deadline | None) -> bytes | None:
        """A call arrived at max concurrency: None once it holds a slot (handed over by a
        call that finished, first come first served), else the ``unavailable`` reply.

        It waits only if the calls ahead of it can be expected to leave it a slot within
        its wait bound (``_wait_bound``), by how long calls have held their slots lately
        (the SLA until one finished): a burst is absorbed, while under a sustained
        overload the queue stays full and the excess is refused at once, so that the
        calls admitted keep their latency and their callers go elsewhere now."""
        if not self.accepting:
            return self.stopping(endpoint)
        limit = self.max_concurrency
        bound = self._wait_bound(endpoint, deadline)
        hold = self._hold_sec or endpoint.capability.latency_sla_ms / 1000.0
        # slots come free at ``limit`` per ``hold`` seconds: this call's turn comes after
        # the calls waiting ahead of it
        expected = (self.waiting + 1) * hold / limit
        if bound <= 0 or expected > bound or self.waiting >= _MAX_WAITING_PER_SLOT * limit:
            return self._over_capacity(endpoint)
        loop = asyncio.get_running_loop()
        slot: asyncio.Future[bool] = loop.create_future()
        self._waiters.append(slot)
        self.waiting += 1
        timer = loop.call_later(bound, self._give_up, slot)
        # no await inside the except block: compiled by mypyc, an await there loses
        # track of which exception is being handled
        try:
            granted = await slot
        except asyncio.CancelledError:
            timer.cancel()
            self._abandon(slot)
            raise
        timer.cancel()
        if not self.accepting:
            if granted:
                self._release()
            return self.stopping(endpoint)
        if not granted:
            return self._refuse(
                endpoint,
                "unavailable",
                "over_capacity",
                f"{self.agent_id} is at its max concurrency ({limit}): waited"
                f" {bound * 1000:.0f} ms for a slot, none came free",
            )
        refused = self._take_qps(endpoint)
        if refused is not None:
            self._release()
        return refused

    def _over_capacity(self, endpoint: Endpoint) -> bytes:
        return self._refuse(
            endpoint,
            "unavailable",
            "over_capacity",
            f"{self.agent_id} is at its max concurrency ({self.max_concurrency})"
            f" with {self.waiting} calls waiting",
        )

    def _give_up(self, slot: asyncio.Future[bool]) -> None:
        """A waiting call's wait bound passed with no slot for it."""
        if not slot.done():
            slot.set_result(False)
            self.waiting -= 1

    def _abandon(self, slot: asyncio.Future[bool]) -> None:
        """A waiting call was cancelled: it leaves the queue, or passes on the slot it was
        just handed."""
        if not slot.done():
            slot.cancel()
            self.waiting -= 1
        elif slot.cancelled():
            self.waiting -= 1
        elif slot.result():
            self._release()

    def _release(self) -> None:
        """A call gives its slot back: to the first call still waiting for one, else the
        slot is free."""
        waiters = self._waiters
        while waiters:
            slot = waiters.popleft()
            if not slot.done():
                self.waiting -= 1
                slot.set_result(True)  # in_flight unchanged: the slot passes on
                return
        self.in_flight -= 1

    def _reply_of(
        self, endpoint: Endpoint, outcome: tuple[bytes, Any] | Failure, audited: bool = False
    ) -> tuple[bytes, bool, str]:
        """The reply to a handler's outcome, whether a repeat may be answered with it, and
        its kind ("ok" or the error's). ``audited``: this side records the call."""
        if isinstance(outcome, Failure):
            reply, remember = self._fail(endpoint, *outcome)
            return reply, remember, outcome.kind
        reply = envelope.pack_ok(outcome[0], self.agent_id, audited=audited)
        limit = self.max_reply_bytes
        if limit is not None and len(reply) > limit:
            reply, remember = self._fail(
                endpoint,
                "contract",
                "output_too_large",
                f"output of {endpoint.name} is {len(reply)} bytes packed, more than"
                f" a message may carry ({limit})",
            )
            return reply, remember, "contract"
        return reply, True, "ok"

    def _finished(
        self,
        endpoint: Endpoint,
        key: str,
        reply: bytes,
        remember: bool,
        kind: str,
        span: Span | None,
        admitted: float,
    ) -> float:
        """A call that ran is done (it held its slot since ``admitted``): counted, its
        slot given back, its reply kept for repeats (if it may be). Returns when it was
        done (the clock's wall time)."""
        self._release()
        self.completed += 1
        self.last_completion_at = done_at = self._clock.time()
        if done_at > admitted:  # (the wall clock may have been set back meanwhile)
            held = done_at - admitted
            endpoint.stats.busy_sec += held
            average = self._hold_sec
            self._hold_sec = held if average == 0.0 else average + _HOLD_WEIGHT * (held - average)
        self._cache.finish(key, reply, done_at, remember=remember)
        if self._on_done is not None:
            self._on_done()
        tel = self.telemetry
        if tel is not None:
            tel.record_served(endpoint.name, kind)
            end_span(span, None if kind == "ok" else kind)
        return done_at

    def _check_token(self, endpoint: Endpoint, meta: envelope.RequestMeta) -> bytes | Claims:
        """The token's claims if the call may proceed (its client, and the gateway that
        calls for it if any), else the ``denied`` reply (counted)."""
        assert self.verifier is not None
        if meta.token is None:
            return self._deny(endpoint, meta, "no_token", f"{endpoint.name} requires a token")
        try:
            # a token for this capability's calls: no other (a fabric token, another
            # capability's) is accepted, so no callee can use what callers sent it elsewhere
            claims = self.verifier.verify(meta.token, endpoint.audience)
        except AuthenticationFailed as exc:
            return self._deny(endpoint, meta, "authentication_failed", str(exc))
        required = endpoint.capability.security_level
        if claims.level < required:
            return self._deny(
                endpoint,
                meta,
                f"insufficient_level:{required}:{claims.level}",
                f"{endpoint.name} requires clearance level {required};"
                f" client {claims.client_id} holds {claims.level}",
                claims,
            )
        if endpoint.job and claims.actor is None and not claims.roles & JOB_READERS:
            # the job's result is in REACH_JOBS, which this client may not read: refused
            # before it runs, not after, when the caller could only fail to fetch it
            return self._deny(
                endpoint,
                meta,
                "no_jobs_role",
                f"{endpoint.name} runs as a job, whose result client {claims.client_id} may"
                f" not read: it lacks the {ROLE_JOBS!r} role"
                f" (reach creds add {claims.client_id} ... --role {ROLE_JOBS})",
                claims,
            )
        # every call has a deadline not too far ahead (none: the callee's own), and is
        # served once while it lives: a copy is refused here, and late once it passed
        now = self._clock.time()
        if meta.deadline_ms is None:
            sla_sec = endpoint.capability.latency_sla_ms / 1000.0
            meta.deadline_ms = int((now + 1.5 * sla_sec) * 1000)
        elif meta.deadline_ms > (now + MAX_AHEAD_SEC) * 1000:
            return self._deny(
                endpoint,
                meta,
                "deadline_too_far",
                f"call {meta.call_id}: its deadline lies more than {MAX_AHEAD_SEC:g} s ahead",
                claims,
            )
        if not self._recent.first_time(
            claims.client_id, meta.call_id, meta.attempt, meta.deadline_ms / 1000.0
        ):
            return self._deny(
                endpoint,
                meta,
                "replayed",
                f"call {meta.call_id} attempt {meta.attempt} replayed",
                claims,
            )
        return claims

    def _deny(
        self,
        endpoint: Endpoint,
        meta: envelope.RequestMeta,
        code: str,
        description: str,
        claims: Claims | None = None,
    ) -> bytes:
        self.denials += 1
        endpoint.stats.denied += 1
        caller = claims.client_id if claims is not None else "(no valid token)"
        self._denied_log.refused(caller, f"{description} ({code})")
        if self.on_denied is not None:
            self.on_denied(endpoint.name, meta, code, description, claims)
        return self._refuse(endpoint, "denied", code, description)

    def watch_deadline(self, deadline: Deadline) -> None:
        """Cancel the running call at its deadline (its task may not exist yet), by the
        reaper's timer: on the event loop's clock, the time left from now."""
        when = asyncio.get_running_loop().time() + deadline.remaining()
        if EAGER.get():
            PENDING_DEADLINE.set(when)  # run_eagerly hands it over with the task it creates
            return
        task = asyncio.current_task()
        if task is not None:
            self._reaper.watch(task, when)

    def watch_task(self, task: asyncio.Task[None], when: float | None) -> None:
        if when is not None:
            self._reaper.watch(task, when)

    def _fail(
        self, endpoint: Endpoint, kind: str, code: str, description: str, path: str = ""
    ) -> tuple[bytes, bool]:
        # a timed-out or refused attempt may be retried with the same call id: not remembered
        return self._refuse(endpoint, kind, code, description, path), kind not in _RETRYABLE_KINDS

    async def _invoke(
        self,
        endpoint: Endpoint,
        meta: envelope.RequestMeta,
        arg: Any,
        deadline: Deadline | None,
        traceparent: str | None = None,
    ) -> tuple[bytes, Any] | Failure:
        """Run the handler under the deadline: the encoded and plain result, or a failure.
        ``traceparent`` is what calls made by the handler continue (its SERVER span)."""
        enter_call(
            meta.call_id,
            endpoint.name,
            self.agent_id,
            deadline,
            meta.attempt,
            meta.caller,
            traceparent or meta.traceparent,
        )
        try:
            if deadline is not None:
                self.watch_deadline(deadline)
            result = await endpoint.handler(arg)
        except asyncio.CancelledError as exc:
            task = asyncio.current_task()
            if task is None or exc.args != (DEADLINE_CANCEL,):
                raise
            task.uncancel()
            return Failure(
                "timeout", "deadline_passed", f"{endpoint.name} stopped at the caller's deadline"
            )
        except ReachError as exc:
            return failure_of(endpoint.name, exc)
        except Exception as exc:
            log.exception("handler of %s crashed", endpoint.name)
            return Failure("internal", type(exc).__name__, str(exc) or type(exc).__name__)
        finally:
            set_current(None)
        try:
            # a dict, the common case, skips the check against BaseModel (an ABC: slow to say no)
            if type(result) is not dict and isinstance(result, BaseModel):
                result = result.model_dump(mode="json")
            plain = codec.check_value(result)  # what cannot travel, first (a CodecError)
            endpoint.output_validator.validate(result, plain=plain)
            return codec.encode(result, checked=False, plain=plain), result
        except ContractError as exc:
            return Failure("contract", "output", f"output of {endpoint.name}: {exc}", exc.path)
