"""One active probe of an instance (``reach.v1.probe.<agent_id>``): the registrar's health
check and ``reach doctor``'s connectivity step."""

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

__all__ = ["ProbeResult", "probe"]


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
    request = envelope.pack_request(envelope.RequestMeta(call_id=uuid.uuid4().hex), b"")
    started = clock.monotonic()
    try:
        data = await conn.request(
            subjects.probe(inst.agent_id),
            request,
            timeout=inst.manifest.health.timeout_sec if timeout is None else timeout,
        )
        elapsed = (clock.monotonic() - started) * 1000
        reply = envelope.unpack_reply(data)
        if not reply.ok:
            return ProbeResult(None, elapsed, f"probe refused: {reply.kind}: {reply.description}")
        answer = decode_model(ProbeReply, reply.body, limits or Limits())
    except ReachError as exc:
        elapsed = (clock.monotonic() - started) * 1000
        return ProbeResult(None, elapsed, f"{type(exc).__name__}: {exc}", exc)
    if answer.instance_id != inst.instance_id:
        return ProbeResult(
            None, elapsed, f"probe answered by another instance ({answer.instance_id})"
        )
    return ProbeResult(answer, elapsed)
