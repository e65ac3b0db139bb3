"""Call planning: what a call is before its first attempt.

Its candidates (from the local route cache), its deadline (the caller's timeout, else
1.5 × the capability's latency SLA, never past the deadline of the call being served),
its payload checked against the capability's input contract and encoded, and the
request's envelope (call id, deadline, trace context). What cannot be sent is refused
here, before anything counts against an instance.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import Any

from reach.agent.context import CallContext, current_call
from reach.caller.callstate import CallState
from reach.caller.routecache import RouteCache
from reach.caller.routing import APERTURE_ABOVE, RouteEntry
from reach.clock import Clock
from reach.deadline import Deadline
from reach.errors import ConfigurationError, ContractError
from reach.security.replay import MAX_AHEAD_SEC
from reach.telemetry import Telemetry, new_traceparent, traceparent_of
from reach.wire import codec, subjects
from reach.wire.contract import ROOT, Validator, compile_schema
from reach.wire.envelope import RequestMeta
from reach.wire.models import Capability

__all__ = ["DEFAULT_SLA_MS", "MAX_TIMEOUT_SEC", "REQUEST_FRAMING", "CallPlanner"]

#: latency SLA assumed when no instance of the capability is known (queue-subject calls)
DEFAULT_SLA_MS = 1000.0
#: bytes of a request's envelope beside its payload, at most (token, trace context, ids)
REQUEST_FRAMING = 4096
#: a call's timeout at most: its deadline lies at most this far ahead (callees refuse one
#: further); NaN and infinities are refused with it
MAX_TIMEOUT_SEC = MAX_AHEAD_SEC

_NOT_CONNECTED = "connect the client first: `async with ReachClient() as client:`"


class CallPlanner:
    """Plans a client's calls. ``routes`` and ``max_body`` are set once connected."""

    def __init__(self, clock: Clock, telemetry: Telemetry, *, validate: bool = True) -> None:
        #: the live route cache the candidates come from (None: not connected)
        self.routes: RouteCache | None = None
        #: check payloads against the capability's input contract before sending them
        self.validate = validate
        #: the largest payload a request can carry (the server's max_payload, less room
        #: for the envelope: token, trace context, deadline)
        self.max_body = 1 << 62
        self._clock = clock
        self._telemetry = telemetry
        #: compiled input contracts by the identity of their schema
        self._validators: dict[int, tuple[dict[str, Any], Validator]] = {}
        # call ids unique per caller without a syscall: a random prefix and a counter
        self.call_prefix = secrets.token_hex(8) + "-"
        self.call_seq = 0

    def plan(
        self,
        capability: str,
        payload: Any,
        timeout: float | None,
        tags: tuple[str, ...],
        idempotency_key: str | None,
    ) -> tuple[CallState, RequestMeta, bytes]:
        """Candidates, deadline, contract pre-check and the encoded body of a call."""
        routes = self.routes
        if routes is None:
            raise RuntimeError(_NOT_CONNECTED)
        candidates = routes.entries(capability, tags)
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
        parent = current_call()
        state = self._state(capability, spec, timeout, parent, candidates, tags)
        if len(candidates) > APERTURE_ABOVE:
            index = routes.index_of(capability, tags, candidates)
            state.aperture = index.aperture if index is not None else None
        body = self._body(capability, spec, payload)
        state.retry_timeouts = idempotency_key is not None or (spec is not None and spec.idempotent)
        return state, self._meta(state, parent, idempotency_key), body

    def _state(
        self,
        capability: str,
        spec: Capability | None,
        timeout: float | None,
        parent: CallContext | None,
        candidates: Sequence[RouteEntry],
        tags: tuple[str, ...],
    ) -> CallState:
        """The call's deadline: the timeout, else 1.5 × SLA, within the served call's."""
        sla_ms = spec.latency_sla_ms if spec is not None else DEFAULT_SLA_MS
        clock = self._clock
        attempt_timeout = 1.5 * sla_ms / 1000.0
        seconds = timeout if timeout is not None else attempt_timeout
        if parent is not None and parent.deadline is not None:
            # the served call's time left: its deadline may be on another clock than ours
            seconds = min(seconds, parent.deadline.remaining())
        deadline = Deadline.after(seconds, clock)
        return CallState(capability, deadline, attempt_timeout, clock.time(), candidates, tags)

    def _body(self, capability: str, spec: Capability | None, payload: Any) -> bytes:
        """The payload checked and encoded; a ContractError for one that cannot go."""
        # what cannot travel (too deep, too many elements, a non-string key) is refused
        # first; the contract check then sees a value of bounded nesting
        plain = codec.check_value(payload)
        if self.validate and spec is not None and spec.input_schema:
            self.validator(spec.input_schema).validate(payload, plain=plain)
        body = codec.encode(payload, checked=False, plain=plain)
        if len(body) > self.max_body:
            # it could never be sent: refused here, nothing counted against any instance
            raise ContractError(
                f"{ROOT}: the payload is {len(body)} bytes packed, more than a request to"
                f" {capability} may carry ({self.max_body})",
                path=ROOT,
                rule="max_bytes",
            )
        return body

    def _meta(
        self, state: CallState, parent: CallContext | None, idempotency_key: str | None
    ) -> RequestMeta:
        """The request's envelope; the call's span starts here when tracing is on."""
        # W3C trace context: the caller's span is the callee's parent, even without an SDK
        traceparent = parent.traceparent if parent is not None else None
        if self._telemetry.tracing_on:
            state.span = self._telemetry.start_client_span(state.capability, traceparent)
        traceparent = (
            traceparent_of(state.span) if state.span is not None else new_traceparent(traceparent)
        )
        return RequestMeta(
            call_id=self.next_call_id(),
            # the token of the instance each attempt goes to (``reach.caller.attempt``):
            # the fabric's own never goes to a callee
            token=None,
            deadline_ms=state.deadline.to_wire(),
            idempotency_key=idempotency_key,
            caller=parent.agent_id if parent is not None else None,
            traceparent=traceparent,
        )

    def next_call_id(self) -> str:
        self.call_seq += 1
        return f"{self.call_prefix}{self.call_seq:x}"

    def validator(self, schema: dict[str, Any]) -> Validator:
        """The compiled contract of ``schema``, kept by identity (registry records are
        immutable): hashing a schema on every call would cost more than it saves."""
        hit = self._validators.get(id(schema))
        if hit is not None and hit[0] is schema:
            return hit[1]
        validator = compile_schema(schema)
        if len(self._validators) > 1024:
            self._validators.clear()
        self._validators[id(schema)] = (schema, validator)
        return validator
