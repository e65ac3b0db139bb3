"""One active probe of an instance (``reach.v1.probe.<agent_id>``): the registrar's health
check and ``reach doctor``'s connectivity step.

:func:`probe` sends one and waits for it; the registrar sends its probes by the thousand
through :mod:`reach.registry.probes`, without a coroutine per probe. Both read the reply
with :func:`read_reply`, so what counts as an answer is decided here once.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from reach import envelope, subjects
from reach.clock import Clock, system_clock
from reach.codec import Limits
from reach.errors import ReachError
from reach.modelcodec import decode_model
from reach.models import Instance, ProbeReply
from reach.transport import Connection

__all__ = ["ProbeResult", "failed", "probe", "probe_request", "read_reply"]

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
