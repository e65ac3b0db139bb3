"""Active probes of an instance (``reach.v1.probe.<agent_id>``): one at a time
(:func:`probe`, ``reach doctor``'s connectivity step), and the registrar's, in flight by
the thousand with none a coroutine of its own (:class:`ProbeDispatcher`).

Every instance a registrar owns is probed every health interval, so probes are most of
its messages. Each goes out with a reply subject carrying an unguessable token on a reply
subscription of the registrar's own (:class:`~reach.transport.replies.ReplyInbox`); a
table maps the tokens of the probes in flight to the instance probed, the reply is
matched in the subscription's callback, and one timer ends the probes whose timeout
passed, in deadline order. What a reply means is read by
:func:`read_reply`, for both.

A reply to a token not in the table (unknown, already answered, expired, or forged by
someone who saw a reply subject) is counted in ``strays`` and dropped; a reply that does
not decode, or one from another instance, is that probe's failure. At most
``max_in_flight`` probes are out at once; the rest wait their turn in order.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from reach.clock import Clock, system_clock
from reach.errors import ReachError
from reach.transport import Connection
from reach.transport.replies import ReplyInbox
from reach.wire import envelope, subjects
from reach.wire.codec import Limits
from reach.wire.modelcodec import decode_model
from reach.wire.models import Instance, ProbeReply

__all__ = [
    "STALL_SEC",
    "ProbeDispatcher",
    "ProbeResult",
    "Recorder",
    "failed",
    "probe",
    "probe_request",
    "read_reply",
]

_DEFAULT_LIMITS = Limits()


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """The instance's reply, or why there was none (``error`` keeps the typed error)."""

    reply: ProbeReply | None
    latency_ms: float
    reason: str = ""
    error: ReachError | None = None

    @property
    def ok(self) -> bool:
        return self.reply is not None


def probe_request(call_id: str) -> bytes:
    """A probe's request: an envelope with an empty body."""
    return envelope.pack_request(envelope.RequestMeta(call_id=call_id), b"")


def failed(exc: ReachError, latency_ms: float) -> ProbeResult:
    """A probe that got no answer, for ``exc``."""
    return ProbeResult(None, latency_ms, f"{type(exc).__name__}: {exc}", exc)


def read_reply(
    data: bytes,
    instance_id: str,
    latency_ms: float,
    limits: Limits = _DEFAULT_LIMITS,
    known: tuple[bytes, ProbeReply] | None = None,
) -> ProbeResult:
    """The probe's outcome from the reply ``data`` of instance ``instance_id``: a refusal,
    a reply that does not decode (CodecError, ContractError) or one from another instance
    with the same agent id are failures. ``known``: a reply already read (its bytes and
    what they decoded to), not decoded again if ``data`` is the same bytes."""
    if known is not None and known[0] == data:
        answer = known[1]
    else:
        try:
            reply = envelope.unpack_reply(data)
            if not reply.ok:
                return ProbeResult(
                    None, latency_ms, f"probe refused: {reply.kind}: {reply.description}"
                )
            answer = decode_model(ProbeReply, reply.body, limits)
        except ReachError as exc:
            return failed(exc, latency_ms)
    if answer.instance_id != instance_id:
        return ProbeResult(
            None, latency_ms, f"probe answered by another instance ({answer.instance_id})"
        )
    return ProbeResult(answer, latency_ms)


async def probe(
    conn: Connection,
    inst: Instance,
    *,
    limits: Limits | None = None,
    timeout: float | None = None,
    clock: Clock = system_clock,
) -> ProbeResult:
    """Probe ``inst``; a reply from another instance with the same agent id is a failure.
    The latency is measured on ``clock``'s monotonic time."""
    request = probe_request(uuid.uuid4().hex)
    started = clock.monotonic()
    try:
        data = await conn.request(
            subjects.probe(inst.agent_id),
            request,
            timeout=inst.manifest.health.timeout_sec if timeout is None else timeout,
        )
    except ReachError as exc:
        return failed(exc, (clock.monotonic() - started) * 1000)
    elapsed = (clock.monotonic() - started) * 1000
    return read_reply(data, inst.instance_id, elapsed, limits or _DEFAULT_LIMITS)


log = logging.getLogger("reach.registrar")

#: told each probe's outcome (the instance as it was when probed)
Recorder = Callable[[Instance, ProbeResult], None]


#: a probe in flight: the instance, the subject, ``clock.monotonic()`` at sending (for
#: its latency) and ``ReplyInbox.now()`` at sending (what a timeout is explained against)
_InFlight = tuple[Instance, str, float, float]

#: a timer of the registrar's that fires this many seconds late means that the process
#: did not run meanwhile (stopped, starved): what came for it then waits unread in its
#: socket, so no verdict is drawn from that time (a probe's timeout, a silence)
STALL_SEC = 1.0

#: a probe's request with a token of 16 characters for its call id, in two parts
_HEAD, _, _TAIL = probe_request("T" * 16).partition(b"T" * 16)


def _request(token: str) -> bytes:
    """:func:`~reach.registry.probes.probe_request` for ``token``, without a map packed."""
    if len(token) == 16 and token.isascii():
        return _HEAD + token.encode() + _TAIL
    return probe_request(token)


class ProbeDispatcher:
    """Sends probes and hands each outcome to ``record`` (in the event loop's thread)."""

    def __init__(
        self,
        conn: Connection,
        *,
        limits: Limits,
        clock: Clock,
        record: Recorder,
        max_in_flight: int,
    ) -> None:
        self._conn = conn
        self._limits = limits
        self._clock = clock
        self._record = record
        self._max_in_flight = max(1, max_in_flight)
        self._inbox: ReplyInbox | None = None
        #: token → the probe it was sent with
        self._pending: dict[str, _InFlight] = {}
        #: (loop time of its deadline, token) of every probe sent; answered ones are
        #: dropped when they reach the top
        self._deadlines: list[tuple[float, str]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = float("inf")
        #: probes waiting for one in flight to end
        self._waiting: deque[Instance] = deque()
        #: agent id → its latest good reply (bytes and decoded): the same bytes again are
        #: not decoded again
        self._known: dict[str, tuple[bytes, ProbeReply]] = {}
        #: agent id → its probe subject
        self._subjects: dict[str, str] = {}
        #: replies to no probe in flight (unknown, answered, expired or forged tokens)
        self.strays = 0
        #: probes whose timeout passed while the registrar stalled, given a new one
        self._rearmed: set[str] = set()

    @property
    def in_flight(self) -> int:
        """Probes sent and not yet ended, and those waiting to be sent."""
        return len(self._pending) + len(self._waiting)

    async def start(self) -> None:
        inbox = self._conn.reply_inbox()
        await inbox.open(self._on_reply)
        self._inbox = inbox

    async def stop(self) -> None:
        """Stop: probes in flight are dropped, not recorded."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_at = float("inf")
        self._pending.clear()
        self._deadlines.clear()
        self._rearmed.clear()
        self._waiting.clear()
        inbox, self._inbox = self._inbox, None
        if inbox is not None:
            try:
                await inbox.close()
            except ReachError as exc:
                log.debug("closing the probe inbox: %s", exc)

    def forget(self, agent_id: str) -> None:
        """The record is gone: drop the reply kept for it."""
        self._known.pop(agent_id, None)
        self._subjects.pop(agent_id, None)

    def send(self, inst: Instance) -> None:
        """Probe ``inst`` now, or once fewer than ``max_in_flight`` probes are out."""
        if len(self._pending) >= self._max_in_flight:
            self._waiting.append(inst)
            return
        self._send(inst)

    def _send(self, inst: Instance) -> None:
        inbox = self._inbox
        if inbox is None:  # stopped
            return
        agent_id = inst.agent_id
        subject = self._subjects.get(agent_id)
        if subject is None:
            subject = self._subjects[agent_id] = subjects.probe(agent_id)
        started = self._clock.monotonic()
        token = inbox.token()
        try:
            inbox.publish(subject, _request(token), token)
        except ReachError as exc:  # NATS away: a failure, as a request would have ended
            self._tell(inst, failed(exc, (self._clock.monotonic() - started) * 1000))
            return
        self._pending[token] = (inst, subject, started, inbox.now())
        loop = asyncio.get_running_loop()
        when = loop.time() + inst.manifest.health.timeout_sec
        heapq.heappush(self._deadlines, (when, token))
        if when < self._timer_at:
            if self._timer is not None:
                self._timer.cancel()
            self._timer_at = when
            self._timer = loop.call_at(when, self._expire)

    def _on_reply(self, token: str, data: bytes | None) -> None:
        self._rearmed.discard(token)
        probe = self._pending.pop(token, None)
        if probe is None:
            self.strays += 1
            return
        inst, subject, started, _ = probe
        latency_ms = (self._clock.monotonic() - started) * 1000
        if data is None:
            result = failed(ReplyInbox.no_responders(subject), latency_ms)
        else:
            agent_id = inst.agent_id
            known = self._known.get(agent_id)
            result = read_reply(data, inst.instance_id, latency_ms, self._limits, known)
            if result.reply is not None and (known is None or known[0] != data):
                self._known[agent_id] = (data, result.reply)
        self._tell(inst, result)
        self._next()

    def _expire(self) -> None:
        self._timer = None
        self._timer_at = float("inf")
        loop = asyncio.get_running_loop()
        now = loop.time()
        deadlines, pending = self._deadlines, self._pending
        inbox = self._inbox
        rearmed: list[tuple[float, str]] = []
        while deadlines and (deadlines[0][0] <= now or deadlines[0][1] not in pending):
            when, token = heapq.heappop(deadlines)
            probe = pending.get(token)
            if probe is None or inbox is None:
                continue
            if now - when > STALL_SEC and token not in self._rearmed:
                # the registrar stalled past this probe's timeout: its reply may be
                # waiting unread, so it gets its timeout again from now
                self._rearmed.add(token)
                rearmed.append((now + probe[0].manifest.health.timeout_sec, token))
                continue
            del pending[token]
            self._rearmed.discard(token)
            inst, subject, started, sent_at = probe
            latency_ms = (self._clock.monotonic() - started) * 1000
            self._tell(inst, failed(inbox.timeout_error(subject, sent_at), latency_ms))
            self._next()
        for entry in rearmed:
            heapq.heappush(deadlines, entry)
        if deadlines:
            self._timer_at = deadlines[0][0]
            self._timer = loop.call_at(self._timer_at, self._expire)

    def _next(self) -> None:
        while self._waiting and len(self._pending) < self._max_in_flight:
            self._send(self._waiting.popleft())

    def _tell(self, inst: Instance, result: ProbeResult) -> None:
        try:
            self._record(inst, result)
        except Exception:  # one bad record must not stop the others' probes
            log.exception("recording the probe of %s failed", inst.agent_id)
