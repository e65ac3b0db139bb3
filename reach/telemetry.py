"""Metrics and traces through opentelemetry-api: no-ops until the user configures an SDK.

Metrics (meter ``reach``):

* ``reach.calls`` — calls by ``capability``, ``callee``, ``outcome`` (ok/error/fallback)
  and ``error`` class (connect, timeout, business, breaker, denied, contract, ...);
* ``reach.call.duration`` — latency histogram in ms (read P90/P99 from it);
* ``reach.call.retries`` — retries by capability and callee;
* ``reach.served`` — calls handled on the callee side, by capability and outcome;
* ``reach.breakers.open`` — instances whose breaker is open, per caller.

Traces: a CLIENT span per call on the caller, a SERVER span per handled call on the
callee, joined by the W3C ``traceparent`` carried in the envelope. Every call carries a
traceparent even without an SDK, so audit events of nested calls share a trace id.

Configure the SDK *before* creating agents and clients: whether anything is recorded is
decided once, when they start (so an unconfigured process pays nothing per call).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sized
from typing import Any, Protocol

from opentelemetry import metrics, trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

__all__ = ["Span", "Telemetry", "end_span", "new_traceparent", "trace_id_of", "traceparent_of"]


class CallFacts(Protocol):
    """What the call metrics read from a call's audit event
    (``reach.audit.events.CallEvent``)."""

    @property
    def capability(self) -> str: ...
    @property
    def callee(self) -> str: ...
    @property
    def outcome(self) -> str: ...
    @property
    def error(self) -> str | None: ...
    @property
    def latency_ms(self) -> float: ...
    @property
    def attempts(self) -> Sized: ...


_PROPAGATOR = TraceContextTextMapPropagator()
_rand = random.Random()


_ZERO_TRACE = "0" * 32
_ZERO_SPAN = "0" * 16


def new_traceparent(parent: str | None = None) -> str:
    """A W3C traceparent for a new span: the parent's trace id, or a new trace."""
    # a trace id (32 hex digits), then a span id (16): 192 random bits, as hex
    ids = f"{_rand.getrandbits(192):048x}"
    while ids[:32] == _ZERO_TRACE or ids[32:] == _ZERO_SPAN:  # all zeros is invalid
        ids = f"{_rand.getrandbits(192):048x}"
    if parent is not None and len(parent) == 55 and parent[2] == "-":
        return f"{parent[:36]}{ids[32:]}-{parent[53:]}"
    return f"00-{ids[:32]}-{ids[32:]}-01"


def trace_id_of(traceparent: str | None) -> str:
    if traceparent is None or len(traceparent) != 55:
        return ""
    return traceparent[3:35]


def _configured(provider: object) -> bool:
    # the API's defaults are proxies/no-ops until an SDK provider is set globally
    return type(provider).__name__ not in {
        "_ProxyMeterProvider",
        "NoOpMeterProvider",
        "ProxyTracerProvider",
        "NoOpTracerProvider",
    }


class Telemetry:
    """One participant's instruments; ``metrics_on``/``tracing_on`` say what is recorded."""

    def __init__(
        self,
        *,
        meter_provider: metrics.MeterProvider | None = None,
        tracer_provider: trace.TracerProvider | None = None,
    ) -> None:
        """Use the given providers, else the global ones (``set_meter_provider`` etc.)."""
        mp = meter_provider or metrics.get_meter_provider()
        tp = tracer_provider or trace.get_tracer_provider()
        self.metrics_on = _configured(mp)
        self.tracing_on = _configured(tp)
        meter = mp.get_meter("reach")
        self._meter = meter
        self._calls = meter.create_counter(
            "reach.calls", unit="{call}", description="calls by capability, callee and outcome"
        )
        self._duration = meter.create_histogram(
            "reach.call.duration", unit="ms", description="call latency seen by the caller"
        )
        self._retries = meter.create_counter(
            "reach.call.retries", unit="{retry}", description="retries by capability and callee"
        )
        self._served = meter.create_counter(
            "reach.served", unit="{call}", description="calls handled, by capability and outcome"
        )
        self._tracer = tp.get_tracer("reach")

    def watch_breakers(self, open_count: Callable[[], int], caller: str) -> None:
        """Report how many breakers of this caller are open (an observable gauge)."""
        if not self.metrics_on:
            return

        def observe(_options: Any) -> Iterable[metrics.Observation]:
            return [metrics.Observation(open_count(), {"caller": caller})]

        self._meter.create_observable_gauge(
            "reach.breakers.open",
            callbacks=[observe],
            unit="{breaker}",
            description="instances whose breaker is open, per caller",
        )

    # -- caller ------------------------------------------------------------------------

    def record_call(self, event: CallFacts) -> None:
        """Metrics of one finished call, from its audit event."""
        capability, callee = event.capability, event.callee
        self._calls.add(
            1,
            {
                "capability": capability,
                "callee": callee,
                "outcome": event.outcome,
                "error": event.error or "",
            },
        )
        self._duration.record(event.latency_ms, {"capability": capability})
        retries = len(event.attempts) - 1
        if retries > 0:
            self._retries.add(retries, {"capability": capability, "callee": callee})

    def start_client_span(self, capability: str, traceparent: str | None) -> Span | None:
        if not self.tracing_on:
            return None
        return self._tracer.start_span(
            f"reach.call {capability}",
            context=_context_of(traceparent),
            kind=SpanKind.CLIENT,
            attributes={"reach.capability": capability},
        )

    # -- callee ------------------------------------------------------------------------

    def record_served(self, capability: str, outcome: str) -> None:
        self._served.add(1, {"capability": capability, "outcome": outcome})

    def start_server_span(
        self, capability: str, agent_id: str, traceparent: str | None
    ) -> Span | None:
        if not self.tracing_on:
            return None
        return self._tracer.start_span(
            f"reach.serve {capability}",
            context=_context_of(traceparent),
            kind=SpanKind.SERVER,
            attributes={"reach.capability": capability, "reach.agent_id": agent_id},
        )


def traceparent_of(span: Span) -> str | None:
    """The traceparent that makes ``span`` the parent on the next hop."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get("traceparent")


def end_span(span: Span | None, error: str | None = None) -> None:
    if span is None:
        return
    if error:
        span.set_status(Status(StatusCode.ERROR, error))
    span.end()


def _context_of(traceparent: str | None) -> Context | None:
    if traceparent is None:
        return None
    return _PROPAGATOR.extract({"traceparent": traceparent})
