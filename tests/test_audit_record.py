"""The audit record: one typed shape from the call path to the writer, and the same
fields as the event readers decode."""

from __future__ import annotations

import math
from typing import cast

import pytest

from reach.audit.batch import encode_batch, event_row
from reach.audit.eventmodels import AuditAttempt, AuditEvent, decode_batch
from reach.audit.events import (
    ATTEMPT_FIELDS,
    EVENT_FIELDS,
    AttemptRow,
    CallEvent,
    attempt,
    denial_event,
)
from reach.audit.recording import CallRecorder, CallTrail
from reach.audit.writer import AuditWriter, WriterConfig
from reach.clock import SystemClock
from reach.telemetry import Telemetry, new_traceparent
from reach.transport import Connection
from reach.wire.envelope import RequestMeta


def test_the_record_has_the_fields_of_a_row_and_of_the_readers_event() -> None:
    event = CallEvent(ts=1.0, capability="q", outcome="ok", call_id="c", callee="q-1")
    assert {name for name in dir(event) if not name.startswith("_")} == set(EVENT_FIELDS)
    assert set(AuditEvent.model_fields) == {"v", *EVENT_FIELDS}
    assert tuple(AuditAttempt.model_fields) == ATTEMPT_FIELDS
    assert event_row(event) == tuple(getattr(event, name) for name in EVENT_FIELDS)


def test_the_record_is_built_by_field_name_only() -> None:
    """No two fields of the same type can trade places at a call site: there are no
    positions to trade."""
    with pytest.raises(TypeError):
        CallEvent(1.0, "q", "ok")  # type: ignore[misc]
    with pytest.raises(TypeError, match="colour"):
        CallEvent(ts=1.0, capability="q", outcome="ok", colour="red")  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        attempt("q-1", 0.5)  # type: ignore[misc]
    assert attempt(agent_id="q-1", latency_ms=2.0) == ("q-1", None, "ok", 2.0)


def test_each_field_reads_back_under_its_own_name() -> None:
    """Every field given a value no other field has: a field written under another's
    name would show up in the wrong place."""
    plain = CallEvent(
        ts=1.5,
        capability="q",
        call_id="call",
        trace_id="trace",
        caller="caller",
        caller_agent="caller-agent",
        actor="actor",
        callee="q-1",
        outcome="ok",
        latency_ms=2.5,
        candidates=("q-1", "q-2"),
        n_candidates=7,
        attempts=(attempt(agent_id="q-1", score=0.25, latency_ms=3.5),),
    )
    full = CallEvent(
        side="caller",
        ts=4.5,
        capability="q",
        call_id="call-2",
        trace_id="trace-2",
        caller="caller-2",
        caller_agent=None,
        actor="actor-2",
        callee="q-2",
        outcome="fallback",
        error="timeout",
        code="code",
        description="description",
        latency_ms=5.5,
        candidates=("q-2",),
        n_candidates=9,
        skipped=("q-3",),
        attempts=(attempt(agent_id="q-2", score=0.75, outcome="timeout", latency_ms=6.5),),
        fallback="cache",
        fallback_reason="reason",
    )
    # the first is kept as columns, the second as a row
    (first, second), bad = decode_batch(encode_batch([plain, full]))
    assert bad == 0
    for event, decoded in ((plain, first), (full, second)):
        got = decoded.model_dump(exclude={"v", "attempts"})
        want = {name: getattr(event, name) for name in EVENT_FIELDS if name != "attempts"}
        assert got == {**want, "candidates": list(event.candidates), "skipped": list(event.skipped)}
        assert [tuple(a.model_dump().values()) for a in decoded.attempts] == list(event.attempts)


def test_a_denial_is_a_record_of_the_side_that_refused() -> None:
    event = denial_event(
        side="callee", ts=1.0, capability="q", callee="q-1", call_id="c", code="expired",
        description="token expired",
    )  # fmt: skip
    ((decoded,), bad) = decode_batch(encode_batch([event]))
    assert bad == 0
    assert (decoded.side, decoded.outcome, decoded.error) == ("callee", "denied", "denied")
    assert (decoded.code, decoded.description) == ("expired", "token expired")


def _recorded(route: tuple[AttemptRow, ...], skipped: tuple[str, ...]) -> tuple[str, str, int]:
    """What a caller's recorder writes of one served call, and what the event it builds
    of the same call writes, both decoded (as the JSON of the readers' events); and how
    many calls the writer keeps as columns."""
    writer = AuditWriter(cast(Connection, None), WriterConfig(spool="off"))
    recorder = CallRecorder(Telemetry(), SystemClock(), lambda _c, _t, _e: ("q-1", "q-2"))
    recorder.caller = "caller"
    recorder.audit = writer
    trail = CallTrail("q", 1.5, [])
    trail.last_target = "q-1"
    trail.skipped.extend(skipped)
    meta = RequestMeta("call-1", caller="agent-7", traceparent=new_traceparent())
    recorder.served(trail, meta, 2.5, route)
    (batch,) = (at.batch for at in writer._open.values())
    (got,), bad = decode_batch(batch.encode()[0])
    (want,), _ = decode_batch(encode_batch([recorder.event(trail, meta, 2.5, route)]))
    assert bad == 0
    return got.model_dump_json(), want.model_dump_json(), len(batch.columns)


@pytest.mark.parametrize(
    ("route", "skipped", "plain"),
    [
        ((attempt(agent_id="q-1", score=0.25, latency_ms=2.0),), (), 1),
        ((attempt(agent_id="q-1", latency_ms=2.0),), (), 1),  # the only candidate: no score
        ((attempt(agent_id="q-1", score=math.nan, latency_ms=2.0),), (), 0),
        ((attempt(agent_id="q-2", latency_ms=2.0),), (), 0),  # answered by another
        ((attempt(agent_id="q-1", latency_ms=2.0),), ("q-3",), 0),
        (
            (
                attempt(agent_id="q-2", outcome="timeout", latency_ms=1.0),
                attempt(agent_id="q-1", latency_ms=2.0),
            ),
            (),
            0,
        ),
    ],
)
def test_a_served_call_reads_back_as_the_event_its_recorder_builds(
    route: tuple[AttemptRow, ...], skipped: tuple[str, ...], plain: int
) -> None:
    """A plain call goes to the writer's columns by its fields, no event built; any
    other as its event: both read back as the event the recorder builds of the call."""
    got, want, columns = _recorded(route, skipped)
    assert got == want
    assert columns == plain
