"""Metrics and spans through OpenTelemetry, with the SDK's in-memory readers."""

from __future__ import annotations

from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from reach.caller.client import ReachClient
from reach.errors import BusinessError
from reach.registry import Registrar
from reach.telemetry import Telemetry, new_traceparent, trace_id_of
from reach.testing import NatsServer

from .calls_helpers import capability, make_agent, wait_routable


def points(reader: InMemoryMetricReader, name: str) -> list[Any]:
    data = reader.get_metrics_data()
    assert data is not None
    found = []
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                if metric.name == name:
                    found.extend(metric.data.data_points)
    return found


def test_traceparents_keep_the_trace_and_make_new_spans() -> None:
    root = new_traceparent()
    child = new_traceparent(root)
    assert len(root) == 55
    assert trace_id_of(child) == trace_id_of(root)
    assert child[36:52] != root[36:52]
    assert trace_id_of("garbage") == ""
    assert trace_id_of(new_traceparent("garbage")) != ""


def test_without_an_sdk_nothing_is_recorded() -> None:
    telemetry = Telemetry()
    assert not telemetry.metrics_on
    assert not telemetry.tracing_on


async def test_calls_are_counted_timed_and_traced_across_hops(
    nats_server: NatsServer, registrar: Registrar
) -> None:
    reader = InMemoryMetricReader()
    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    telemetry = Telemetry(
        meter_provider=MeterProvider(metric_readers=[reader]), tracer_provider=tracer_provider
    )
    client = ReachClient(servers=nats_server.url, telemetry=telemetry)
    await client.connect()

    async def report(req: Any) -> Any:
        # a nested call from inside a handler continues the same trace
        inner = await client.call("query", {"q": req["q"]})
        return {"rows": inner.value["echo"]}

    outer, _ = make_agent(
        nats_server.url, "report-1", capability("report"), handler=report, telemetry=telemetry
    )
    inner, behaviour = make_agent(
        nats_server.url, "query-1", capability("query"), telemetry=telemetry
    )
    try:
        async with outer, inner:
            await wait_routable(client, "report", 1)
            await wait_routable(client, "query", 1)
            await client.call("report", {"q": 1})
            behaviour.fail = "business"
            with pytest.raises(BusinessError):
                await client.call("query", {"q": 2})
    finally:
        await client.close()

    calls = {
        (p.attributes["capability"], p.attributes["outcome"], p.attributes["error"]): p.value
        for p in points(reader, "reach.calls")
    }
    assert calls == {
        ("report", "ok", ""): 1,
        ("query", "ok", ""): 1,
        ("query", "error", "business"): 1,
    }
    durations = {p.attributes["capability"]: p.count for p in points(reader, "reach.call.duration")}
    assert durations == {"report": 1, "query": 2}
    served = {
        (p.attributes["capability"], p.attributes["outcome"]): p.value
        for p in points(reader, "reach.served")
    }
    assert served == {("report", "ok"): 1, ("query", "ok"): 1, ("query", "business"): 1}

    spans = exporter.get_finished_spans()
    by_name: dict[str, list[Any]] = {}
    for span in spans:
        by_name.setdefault(span.name, []).append(span)
    (call_report,) = by_name["reach.call report"]
    (serve_report,) = by_name["reach.serve report"]
    first_query_call = min(by_name["reach.call query"], key=lambda s: s.start_time)
    first_query_serve = min(by_name["reach.serve query"], key=lambda s: s.start_time)
    trace_id = call_report.context.trace_id
    # caller → callee → nested caller → nested callee: one trace, each the parent of the next
    assert serve_report.parent.span_id == call_report.context.span_id
    assert first_query_call.parent.span_id == serve_report.context.span_id
    assert first_query_serve.parent.span_id == first_query_call.context.span_id
    for span in (serve_report, first_query_call, first_query_serve):
        assert span.context.trace_id == trace_id
