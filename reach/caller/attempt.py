"""One attempt of a call: an instance chosen, its call token, one request and its reply.

An attempt chooses the best instance the call has not failed on (breakers and latency
decide, ``reach.caller.routing``), gets the call token for it (once per instance; the token
issuer's answer), waits within the call's deadline for a connection that is away, sends
the request and reads the reply. What happened is told to the instance's breaker and
latency estimate, and kept in the call's route for its audit event. A failure raises the
one documented error tree (``reach.errors``), naming whose fault it was: the instance's
(its breaker counts it), or this side's (its connection, its payload, its credentials:
the instance's breaker only gives its slot back). An instance that answers, but with
its handler failing or far slower than its peers, is told to the outlier detection
(``reach.resilience.outliers``), which may set it aside for a while.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

from reach.agent.jobs import ClientJobs, JobHandle
from reach.audit.events import error_class
from reach.caller.callstate import CallState
from reach.caller.remote import remote_error
from reach.caller.routing import Peer, Peers, RouteEntry, choose
from reach.clock import Clock
from reach.deadline import Deadline
from reach.errors import (
    AuthenticationFailed,
    AuthError,
    BusinessError,
    ConfigurationError,
    Disconnected,
    InternalError,
    NoResponders,
    NotFound,
    ReachError,
    ReachTimeout,
    RemoteError,
    Unavailable,
)
from reach.resilience import BreakerBoard, CircuitBreaker
from reach.resilience.outliers import OutlierDetector, OutlierState
from reach.security.membership import FabricSecurity
from reach.transport import Connection, RawRequest
from reach.wire import codec, envelope, subjects

__all__ = ["AttemptRunner", "remote_error"]

#: how often a call waiting for its connection checks whether the login was refused
_CONNECT_WAIT_SLICE = 0.25

_NOT_CONNECTED = "connect the client first: `async with ReachClient() as client:`"


def _outliers(state: CallState) -> Iterator[OutlierState]:
    """The outlier states of the call's candidates (the capability's instances)."""
    return (entry.peer.outlier for entry in state.candidates)


async def _not_connected(subject: str, data: bytes, timeout: float, batch: bool) -> bytes:
    raise RuntimeError(_NOT_CONNECTED)


class AttemptRunner:
    """Runs one attempt of a call at a time for a client, over its connection.

    ``conn``, ``security`` and ``request`` are the client's once it is connected;
    ``closing`` is set when the client closes (calls in flight fail, and are not
    retried). ``reconnected_at`` and ``settle_sec`` say whether the fabric is settling
    after this client's connection came up or back (``settling``)."""

    def __init__(
        self, clock: Clock, breakers: BreakerBoard, peers: Peers, jobs: ClientJobs
    ) -> None:
        self.breakers = breakers
        #: what this client observed of each instance (latency) and its calls in flight
        self.peers = peers
        #: sets aside instances that answer badly (their handler fails, or far too slowly)
        self.outliers = OutlierDetector(clock=clock)
        self.jobs = jobs
        self.conn: Connection | None = None
        self.security = FabricSecurity()
        #: request/reply on the call path (``Connection.raw_request``)
        self.request: RawRequest = _not_connected
        self.closing = False
        #: this client records its calls in REACH_AUDIT: each request says so, and its
        #: callee records nothing
        self.audits = False
        self.reconnected_at = -float("inf")
        self.settle_sec = 10.0
        self._clock = clock
        #: calls in flight to the capability's queue subject (no instance known)
        self._anyone = Peer("")

    def on_reconnect(self) -> None:
        self.reconnected_at = self._clock.monotonic()

    def settling(self) -> bool:
        """Is the fabric settling after this client's connection came up or back (or is
        the connection away)? Agents reconnect on their own schedule, often after the
        caller: meanwhile their subjects have nobody listening."""
        conn = self.conn
        if conn is None:
            return False
        return (
            not conn.is_connected or self._clock.monotonic() - self.reconnected_at < self.settle_sec
        )

    async def attempt(self, state: CallState, meta: envelope.RequestMeta, body: bytes) -> Any:
        """One attempt of the call: its value, a JobHandle for an accepted job, or the
        error of the documented tree."""
        state.attempts += 1
        meta.attempt = state.attempts
        remaining = self._time_left(state, meta)
        if remaining <= 0:
            raise ReachTimeout(
                f"{state.capability}: deadline passed before attempt {state.attempts}"
            )
        chosen, subject, peer = self._target(state)
        meta.audit = self.audits
        target = state.last_target
        breaker = self.breakers.get(target) if target else None
        security = self.security
        if security.session is not None:
            token = security.call_token(state.capability, target)
            if token is None:
                # the first call to this instance: its token from the issuer, once
                token = await self._first_token(state, target, breaker)
                remaining = self._time_left(state, meta)
            meta.token = token
        conn = self.conn
        if conn is not None and not conn.is_connected:
            remaining = await self._until_connected(conn, state, meta)
        # batched only to an instance known to read batches, never to the queue group,
        # which may hold instances that do not
        batch = chosen is not None and chosen.instance.batches
        clock = self._clock
        peer.outstanding += 1
        reconnects = conn.reconnects if conn is not None else 0
        started = clock.perf_counter()
        try:
            try:
                # nats-py directly (one coroutine less per call); errors translated here
                raw = await self.request(
                    subject, envelope.pack_request(meta, body), remaining, batch
                )
            except Exception as exc:
                raise self._explain(exc, subject, started, reconnects) from exc
            reply = envelope.unpack_reply(raw)
        except ReachError as exc:
            elapsed_ms = (clock.perf_counter() - started) * 1000
            self._unanswered(state, exc, chosen, breaker, elapsed_ms)
            if isinstance(exc, NoResponders) and not target:
                raise NotFound(f"no instance offers {state.capability}") from exc
            raise
        except asyncio.CancelledError:
            if breaker is not None:
                breaker.release()  # a half-open trial slot comes back
            raise
        finally:
            peer.outstanding -= 1
        elapsed_ms = (clock.perf_counter() - started) * 1000
        if reply.ok and reply.job:
            self._answered(state, reply, chosen, peer, breaker, elapsed_ms)
            return JobHandle(await self.jobs.store(), reply.job, state.capability, reply.by)
        return self._answered(state, reply, chosen, peer, breaker, elapsed_ms)

    def _target(self, state: CallState) -> tuple[RouteEntry | None, str, Peer]:
        """The instance this attempt goes to (None: the capability's queue group), its
        subject and what this client observes of it."""
        chosen = self._choose(state)
        if chosen is None:
            if state.tags:  # the queue group would reach instances without them
                raise NotFound(
                    f"no instance of {state.capability} carries tags {', '.join(state.tags)}"
                )
            state.last_target = ""
            return None, subjects.capability(state.capability), self._anyone
        target = chosen.agent_id
        state.last_target = target
        return chosen, subjects.capability_instance(state.capability, target), chosen.peer

    def _time_left(self, state: CallState, meta: envelope.RequestMeta) -> float:
        """The attempt's time: the call's time left, at most its attempt timeout; the
        callee stops working when this attempt's caller stops waiting."""
        deadline = state.deadline
        remaining = deadline.remaining()
        limit = state.attempt_timeout
        if remaining <= limit:
            meta.deadline_ms = deadline.to_wire()
            return remaining
        meta.deadline_ms = deadline.to_wire_within(limit)
        return limit

    def _choose(self, state: CallState) -> RouteEntry | None:
        route, state.score = choose(
            state.candidates,
            state.capability,
            breakers=self.breakers,
            failed=state.failed,
            skipped=state.skipped,
            aperture=state.aperture,
        )
        return route

    async def _first_token(
        self, state: CallState, target: str, breaker: CircuitBreaker | None
    ) -> str | None:
        try:
            return await self.call_token(state.capability, target, state.deadline)
        except BaseException as exc:
            # not the instance's fault: its breaker only gives its slot back; the issuer
            # away fails the call at once (a fallback applies), as an instance away would
            state.issuer_silent = isinstance(exc, Unavailable)
            state.failed.add(target)
            if breaker is not None:
                breaker.release()
            raise

    async def call_token(self, capability: str, instance: str, deadline: Deadline) -> str | None:
        """A token for calls to ``capability`` at ``instance`` (none: its queue group) from
        the issuer, within the call's deadline (ReachTimeout after it; Unavailable if the
        issuer does not answer)."""
        remaining = deadline.remaining()
        fetched: str | None = None
        late = remaining <= 0
        if not late:
            try:
                fetched = await asyncio.wait_for(
                    self.security.fetch_call_token(capability, instance), remaining
                )
            except TimeoutError:  # (the fetch raises no timeout of its own: Unavailable)
                late = True
        if late:
            conn = self.conn
            if conn is not None and conn.link.down:  # why: the login refused, say
                raise Disconnected(f"{capability}: no call token: {conn.link.describe()}")
            raise ReachTimeout(f"{capability}: no call token from the issuer before the deadline")
        return fetched

    def _unanswered(
        self,
        state: CallState,
        exc: ReachError,
        chosen: RouteEntry | None,
        breaker: CircuitBreaker | None,
        elapsed_ms: float,
    ) -> None:
        """A request that got no reply: whose fault it was decides what its breaker hears
        (and a timeout, the outlier detection)."""
        target = state.last_target
        if isinstance(exc, NoResponders):
            # while the fabric settles after a reconnect the instance has not reconnected
            # yet, which says nothing of its health
            this_side = self.settling()
        else:
            # this side's trouble (its connection, its payload, its permissions): nothing
            # said about the target
            this_side = isinstance(exc, Disconnected | ConfigurationError | AuthError)
        state.failed.add(target)
        if breaker is not None:
            if this_side:
                breaker.release()  # only its slot back
            else:
                breaker.record_failure()
        if chosen is not None and isinstance(exc, ReachTimeout):
            self._slow(state, chosen, elapsed_ms)
        state.route.append((target, state.score, error_class(exc), elapsed_ms))

    def _answered(
        self,
        state: CallState,
        reply: envelope.Reply,
        chosen: RouteEntry | None,
        peer: Peer,
        breaker: CircuitBreaker | None,
        elapsed_ms: float,
    ) -> Any:
        """The value of a reply (an accepted job: its id), or its error raised; the
        breaker, the latency estimate and the outlier detection told of it."""
        target = state.last_target
        if reply.ok:
            state.route.append((reply.by or target, state.score, "ok", elapsed_ms))
            if breaker is not None:
                breaker.record_success()
                self.peers.fold(peer, elapsed_ms)
            if chosen is not None:
                if elapsed_ms * chosen.per_sla_ms > 1.0:
                    self._slow(state, chosen, elapsed_ms)
                else:
                    outlier = peer.outlier
                    if outlier.errors or outlier.slow or outlier.ejections:
                        self.outliers.good(outlier)
            if reply.by and not target:
                state.last_target = reply.by
            if reply.job:
                return reply.job
            # msgpack's own limits bound the reply; the callee's values need no second walk
            return codec.decode(reply.body, checked=False)
        error = remote_error(reply, target)
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
        if chosen is not None:
            # a handler that fails is an outlier's sign; a business error is an answer
            if isinstance(error, InternalError):
                sent = self._clock.monotonic() - elapsed_ms / 1000.0
                self.outliers.error(peer.outlier, chosen.agent_id, sent, _outliers(state))
            elif isinstance(error, BusinessError):
                outlier = peer.outlier
                if outlier.errors or outlier.slow or outlier.ejections:
                    self.outliers.good(outlier)
        raise error

    def _slow(self, state: CallState, chosen: RouteEntry, elapsed_ms: float) -> None:
        """An attempt over the capability's SLA (answered late, or timed out): the outlier
        detection compares it with the best average among the peers that answered since
        the instance's run of slow attempts began."""
        now = self._clock.monotonic()
        sent = now - elapsed_ms / 1000.0
        outlier = chosen.peer.outlier
        if not outlier.slow:
            outlier.run_started = sent
        since = outlier.run_started
        best = -1.0
        for entry in state.candidates:
            other = entry.peer
            if (
                entry is chosen
                or not other.measured
                or other.seen < since
                or other.outlier.until > now
                or entry.unhealthy
            ):
                continue
            if best < 0.0 or other.latency_ms < best:
                best = other.latency_ms
        self.outliers.slow(
            outlier,
            chosen.agent_id,
            sent,
            elapsed_ms,
            None if best < 0.0 else best,
            _outliers(state),
        )

    async def _until_connected(
        self, conn: Connection, state: CallState, meta: envelope.RequestMeta
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
            left = state.deadline.remaining()
            if conn.is_closed or left <= 0:
                raise Disconnected(
                    f"{state.capability}: the client's connection is closed"
                    if conn.is_closed
                    else f"{state.capability}: {conn.link.describe()}"
                )
            # in slices: a refusal arrives as an error, not as a reconnect
            await conn.wait_connected(min(left, _CONNECT_WAIT_SLICE))
        remaining = self._time_left(state, meta)
        if remaining <= 0:
            raise ReachTimeout(f"{state.capability}: deadline passed waiting for the connection")
        return remaining

    def _explain(self, exc: Exception, subject: str, started: float, reconnects: int) -> ReachError:
        """The typed error of a request that failed in transport: a timeout is a refusal
        when NATS refused these credentials the subject, and a lost connection when the
        client was disconnected (or closed, or reconnected) meanwhile: not the target's
        fault. (The connection stamps refusals on the monotonic clock: the client's
        clock's, when it is the system's.)"""
        conn = self.conn
        if conn is None:
            return Disconnected(f"the client was closed during the call to {subject}")
        clock = self._clock
        since = clock.monotonic() - (clock.perf_counter() - started)
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
