"""Alert rules on their own (the engine is pure; time is a manual clock), their memory
bounded however many names the events carry."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reach.audit.alerts import AlertEngine, AlertRules, decode_alert, encode_alert
from reach.audit.batch import RowSummary, encode_batch
from reach.audit.decode import read_counts
from reach.audit.events import CallEvent
from reach.clock import ManualClock
from reach.errors import ConfigurationError
from reach.wire.models import Instance
from tests.audit_helpers import MAX_TRACKED, make_event
from tests.routing_helpers import instance


def retried_call(
    caller: str = "sched", failed: str = "dq-1", served: str = "dq-2"
) -> dict[str, Any]:
    """A call whose first attempt (on ``failed``) failed and was retried on ``served``."""
    return {
        "side": "caller",
        "capability": "query",
        "caller": caller,
        "caller_agent": None,
        "outcome": "ok",
        "error": None,
        "attempts": [
            {"agent_id": failed, "outcome": "timeout"},
            {"agent_id": served, "outcome": "ok"},
        ],
    }


def test_the_retry_alert_fires_at_eleven_retries_within_a_minute_not_at_ten() -> None:
    clock = ManualClock()
    engine = AlertEngine(clock=clock)
    for _ in range(10):
        assert engine.observe(retried_call()) == []
        clock.advance(5.0)  # 10 retries over 50 s
    (alert,) = engine.observe(retried_call())
    assert alert.rule == "retry_storm"
    assert alert.key == "sched→dq-1"
    assert alert.details["retries"] == 11
    assert "sched retried dq-1 11 times" in alert.summary


def test_retries_older_than_the_window_do_not_count() -> None:
    clock = ManualClock()
    engine = AlertEngine(clock=clock)
    for _ in range(30):
        assert engine.observe(retried_call()) == []
        clock.advance(6.1)  # never more than 10 within 60 s


def test_retries_count_per_caller_and_callee() -> None:
    clock = ManualClock()
    engine = AlertEngine(clock=clock)
    for n in range(11):
        assert engine.observe(retried_call(caller=f"caller-{n % 2}")) == []
        assert engine.observe(retried_call(failed=f"dq-{n % 3}")) == []


def test_a_storm_alerts_once_per_repeat_interval() -> None:
    clock = ManualClock()
    engine = AlertEngine(AlertRules(repeat_after_sec=60), clock=clock)
    fired = []
    for _ in range(40):
        fired += engine.observe(retried_call())
        clock.advance(1.0)
    assert len(fired) == 1
    clock.advance(60)
    for _ in range(11):
        fired += engine.observe(retried_call())
    assert len(fired) == 2


def test_a_failed_call_counts_the_retries_it_made() -> None:
    engine = AlertEngine(AlertRules(retry_threshold=2), clock=ManualClock())
    event = {
        "capability": "query",
        "caller": "sched",
        "outcome": "error",
        "error": "timeout",
        "attempts": [{"agent_id": "dq-1", "outcome": "timeout"}] * 4,
    }
    (alert,) = engine.observe(event)  # 3 retries of dq-1 (the 4th attempt was the last)
    assert alert.details["retries"] == 3


def test_breaker_rejections_above_the_share_alert() -> None:
    clock = ManualClock()
    engine = AlertEngine(clock=clock)
    ok = {"capability": "query", "caller": "c", "outcome": "ok", "attempts": [{}]}
    rejected = {
        "capability": "query",
        "caller": "c",
        "outcome": "error",
        "error": "breaker",
        "attempts": [],
    }
    for _ in range(18):
        assert engine.observe(ok) == []
    assert engine.observe(rejected) == []  # 1 of 19: under 20 calls and 10 %
    assert engine.observe(rejected) == []  # 2 of 20 = 10 %: not above
    (alert,) = engine.observe(rejected)  # 3 of 21
    assert alert.rule == "breaker_rejections"
    assert alert.details == {"capability": "query", "rejected": 3, "calls": 21}


def test_an_instance_turning_unhealthy_alerts_once() -> None:
    clock = ManualClock()
    engine = AlertEngine(clock=clock)
    healthy = instance("dq-1")
    assert engine.registry_change(healthy) == []
    down = healthy.model_copy(
        update={"status": "unhealthy", "status_reason": "missed 2 heartbeats"}
    )
    (alert,) = engine.registry_change(down)
    assert alert.rule == "unhealthy"
    assert alert.severity == "critical"
    assert "missed 2 heartbeats" in alert.summary
    assert engine.registry_change(down) == []


def test_a_new_agent_failing_a_probe_alerts_and_an_old_one_does_not() -> None:
    clock = ManualClock(wall=1_700_000_000.0)
    engine = AlertEngine(clock=clock)

    def aged(agent_id: str, age: float, failures: int) -> Instance:
        return instance(agent_id).model_copy(
            update={"registered_at": clock.time() - age, "consecutive_failures": failures}
        )

    engine.registry_change(aged("young", 3600, 0))
    engine.registry_change(aged("old", 3 * 86400, 0))
    (alert,) = engine.registry_change(aged("young", 3600, 1))
    assert alert.rule == "new_agent_probe_failed"
    assert alert.key == "young"
    assert engine.registry_change(aged("old", 3 * 86400, 1)) == []


def test_alerts_survive_the_wire_and_garbage_is_ignored() -> None:
    clock = ManualClock()
    engine = AlertEngine(AlertRules(retry_threshold=0), clock=clock)
    (alert,) = engine.observe(retried_call())
    assert decode_alert(encode_alert(alert)) == alert
    assert decode_alert(b"\xc1garbage") is None
    assert engine.observe({"attempts": "nonsense"}) == []
    assert engine.observe({"attempts": [1, 2, 3]}) == []
    assert engine.observe({"capability": "q", "attempts": [1, 2, 3]}) == []


def test_bad_rules_are_refused() -> None:
    with pytest.raises(ConfigurationError, match="breaker_share"):
        AlertRules(breaker_share=0)


def test_batches_from_the_stream_count_like_single_events() -> None:
    import msgpack

    from reach.audit.batch import encode_batch
    from reach.audit.events import ATTEMPT_FIELDS, EVENT_FIELDS
    from tests.audit_helpers import make_event

    def row(retried: bool, error: str | None = None) -> CallEvent:
        attempts = [{"agent_id": "dq-1", "outcome": "timeout"}] if retried else []
        return make_event(
            ts=0.0,
            capability="query",
            caller="sched",
            outcome="ok" if error is None else "error",
            error=error,
            attempts=[*attempts, {"agent_id": "dq-2", "outcome": "ok"}],
        )

    engine = AlertEngine(clock=ManualClock())
    assert engine.observe_batch(encode_batch([row(True)] * 10 + [row(False)] * 50)) == []
    (storm,) = engine.observe_batch(encode_batch([row(True)]))
    assert storm.details["retries"] == 11
    # 62 calls so far; 7 breaker rejections are above 10 %
    alerts = engine.observe_batch(encode_batch([row(False, "breaker")] * 7))
    assert [a.rule for a in alerts] == ["breaker_rejections"]
    assert engine.observe_batch(b"\xc1") == []
    short = {"v": 4, "fields": EVENT_FIELDS, "attempt_fields": ATTEMPT_FIELDS, "events": [["x"]]}
    assert engine.observe_batch(msgpack.packb(short)) == []


def test_batches_without_notable_rows_are_counted_from_their_summary() -> None:
    import msgpack

    from reach.audit.batch import (
        CALLS_HEADER,
        NOTABLE_HEADER,
        RowSummary,
        encode_batch,
        event_row,
        summary_headers,
    )
    from reach.audit.decode import read_counts, read_header_counts
    from reach.audit.events import ATTEMPT_FIELDS, EVENT_FIELDS
    from tests.audit_helpers import make_event

    def row(error: str | None = None, capability: str = "query") -> CallEvent:
        return make_event(ts=0.0, capability=capability, caller="sched", error=error,
                          outcome="ok" if error is None else "error")  # fmt: skip

    plain = encode_batch([row()] * 30 + [row(capability="other")] * 2)
    assert read_counts(plain) == {"query": 30, "other": 2}
    assert read_counts(encode_batch([row("breaker")])) is None  # its rows must be read
    rows_only = msgpack.packb(
        {"v": 4, "fields": EVENT_FIELDS, "attempt_fields": ATTEMPT_FIELDS,
         "events": [event_row(row())] * 30}
    )  # fmt: skip
    assert read_counts(rows_only) is None  # a writer that sends no summary
    assert read_counts(b"\xc1") is None
    # the same summary as headers, for readers that ask the server for headers only
    summary = RowSummary()
    for event in [row()] * 30 + [row(capability="other")] * 2:
        summary.add(event)
    assert read_header_counts(summary_headers(summary)) == {"query": 30, "other": 2}
    summary.add(row("breaker"))
    assert read_header_counts(summary_headers(summary)) is None
    assert read_header_counts({}) is None  # a writer that sends no headers
    assert read_header_counts({CALLS_HEADER: "[1]", NOTABLE_HEADER: "0"}) is None
    assert read_header_counts({CALLS_HEADER: "{", NOTABLE_HEADER: "0"}) is None
    assert read_header_counts({CALLS_HEADER: '{"q": 1}', NOTABLE_HEADER: "x"}) is None
    for first in (plain, rows_only):  # 30 calls counted either way ...
        engine = AlertEngine(clock=ManualClock())
        assert engine.observe_batch(first) == []
        # ... so 3 breaker rejections of 33 calls stay below 10 %, a 4th is above
        assert engine.observe_batch(encode_batch([row("breaker")] * 3)) == []
        assert [a.rule for a in engine.observe_batch(encode_batch([row("breaker")]))] == [
            "breaker_rejections"
        ]


_SUMMARY_ROWS = st.lists(
    st.tuples(
        st.sampled_from(["caller", "callee", "registrar"]),
        st.sampled_from(["query", "other"]),
        st.sampled_from([None, "breaker", "timeout", "denied"]),
        st.integers(0, 3),
    ),
    max_size=30,
)


@settings(max_examples=200, deadline=None)
@given(rows=_SUMMARY_ROWS)
def test_a_batch_counts_calls_and_notable_rows_whether_kept_as_rows_or_columns(
    rows: list[Any],
) -> None:
    """Plain calls become columns, the rest rows; the batch's summary counts them all."""
    from reach.audit.batch import BatchBuilder
    from reach.audit.decode import read_counts
    from tests.audit_helpers import make_event

    events = [
        make_event(
            ts=0.0,
            side=side,
            capability=cap,
            outcome="ok",
            error=error,
            attempts=[{"agent_id": "", "latency_ms": 1.0} for n in range(attempts)],
        )
        for side, cap, error, attempts in rows
    ]
    builder = BatchBuilder("query")
    for event in events:
        builder.add(event)
    data, summary, _ = builder.encode()
    expected_calls: dict[str, int] = {}
    for side, cap, _, _ in rows:
        if side in ("caller", "callee"):  # a callee's event is primary unless a denial
            expected_calls[cap] = expected_calls.get(cap, 0) + 1
    notable = sum(1 for s, _, e, a in rows if s == "caller" and (a > 1 or e == "breaker"))
    assert summary.calls == expected_calls
    assert summary.notable == notable
    assert read_counts(data) == (expected_calls if notable == 0 else None)
    plain = sum(1 for s, c, e, a in rows if (s, c, e, a) == ("caller", "query", None, 1))
    served = sum(1 for s, c, e, a in rows if (s, c, e, a) == ("callee", "query", None, 0))
    assert builder.count - len(builder.positions) == plain + served


# -- the engine's memory under many names ----------------------------------------------


def _breaker_rejection(capability: str) -> dict[str, Any]:
    return {"side": "caller", "capability": capability, "caller": "c", "error": "breaker"}


def _retried(caller: str, callee: str, capability: str = "query") -> dict[str, Any]:
    return {
        "side": "caller",
        "capability": capability,
        "caller": caller,
        "attempts": [{"agent_id": callee, "outcome": "timeout"}, {"agent_id": "ok-1"}],
    }


def test_the_alert_engine_tracks_a_bounded_number_of_names_and_forgets_empty_windows() -> None:
    clock = ManualClock()
    engine = AlertEngine(clock=clock)
    # a few names over the limit each (each of those costs the engine a pass over all)
    engine.count_calls({f"cap-{i}": 1 for i in range(MAX_TRACKED + 20)})
    for i in range(MAX_TRACKED + 20):
        engine.observe(_breaker_rejection(f"cap-{i}"))
    for i in range(MAX_TRACKED + 20):
        engine.observe(_retried("sched", f"callee-{i}", capability="cap-0"))
    assert len(engine._calls) <= MAX_TRACKED
    assert len(engine._rejections) <= MAX_TRACKED
    assert len(engine._retries) <= MAX_TRACKED
    # windows that emptied are forgotten
    clock.advance(max(engine.rules.breaker_window_sec, engine.rules.retry_window_sec) + 1)
    engine.prune(clock.time())
    assert (len(engine._calls), len(engine._rejections), len(engine._retries)) == (0, 0, 0)
    # full again: once its windows emptied, a new name is counted (room made by pruning)
    engine.count_calls({f"again-{i}": 1 for i in range(MAX_TRACKED)})
    assert len(engine._calls) == MAX_TRACKED
    engine.count_calls({"late": 1})
    assert "late" not in engine._calls
    clock.advance(engine.rules.breaker_window_sec + 1)
    engine.count_calls({"later": 1})
    assert list(engine._calls) == ["later"]


def test_a_window_that_still_counts_is_kept_by_prune() -> None:
    clock = ManualClock()
    engine = AlertEngine(clock=clock)
    engine.count_calls({"old": 1})
    clock.advance(engine.rules.breaker_window_sec / 2)
    engine.count_calls({"recent": 1})
    clock.advance(engine.rules.breaker_window_sec / 2 + 1)
    engine.prune(clock.time())
    assert list(engine._calls) == ["recent"]


# -- calls that passed an open breaker over --------------------------------------------


def skipped_row(n: int, capability: str = "query") -> CallEvent:
    return make_event(
        ts=0.0,
        capability=capability,
        call_id=f"c-{n}",
        caller="sched",
        callee="dq-2",
        outcome="ok",
        skipped=("dq-1",),
        attempts=[{"agent_id": "dq-2", "outcome": "ok", "latency_ms": 1.0}],
    )


def plain_row(n: int, capability: str = "query") -> CallEvent:
    return make_event(
        ts=0.0,
        capability=capability,
        call_id=f"p-{n}",
        caller="sched",
        callee="dq-2",
        outcome="ok",
        candidates=("dq-2",),
        n_candidates=1,
        attempts=[{"agent_id": "dq-2", "outcome": "ok", "latency_ms": 1.0}],
    )


def test_a_call_served_after_skipping_an_open_breaker_counts_as_a_rejection() -> None:
    engine = AlertEngine(clock=ManualClock())
    ok: dict[str, Any] = {"capability": "query", "caller": "c", "outcome": "ok", "attempts": [{}]}
    skipped = {**ok, "skipped": ["dq-1"], "attempts": [{"agent_id": "dq-2", "outcome": "ok"}]}
    for _ in range(18):
        assert engine.observe(ok) == []
    assert engine.observe(skipped) == []  # 1 of 19: under 20 calls
    assert engine.observe(skipped) == []  # 2 of 20 = 10 %: not above
    (alert,) = engine.observe(skipped)  # 3 of 21, though every call succeeded
    assert alert.rule == "breaker_rejections"
    assert alert.details == {"capability": "query", "rejected": 3, "calls": 21}


def test_a_batch_with_skipped_rows_is_notable_and_raises_the_alert() -> None:
    summary = RowSummary()
    summary.add(plain_row(0))
    assert summary.notable == 0
    summary.add(skipped_row(1))
    assert summary.notable == 1
    assert summary.calls == {"query": 2}
    plain = encode_batch([plain_row(n) for n in range(30)])
    assert read_counts(plain) == {"query": 30}
    mixed = encode_batch([plain_row(n) for n in range(30)] + [skipped_row(n) for n in range(3)])
    assert read_counts(mixed) is None  # its rows must be read
    engine = AlertEngine(clock=ManualClock())
    assert engine.observe_batch(mixed) == []  # 3 of 33: below 10 %
    (alert,) = engine.observe_batch(encode_batch([skipped_row(3)]))  # 4 of 34
    assert alert.rule == "breaker_rejections"
    assert alert.details == {"capability": "query", "rejected": 4, "calls": 34}


def crashed_row(n: int, callee: str = "dq-1", capability: str = "query") -> CallEvent:
    """A call whose handler failed at ``callee``."""
    return make_event(
        ts=0.0,
        capability=capability,
        call_id=f"x-{n}",
        caller="sched",
        callee=callee,
        outcome="error",
        error="InternalError",
        attempts=[{"agent_id": callee, "outcome": "InternalError", "latency_ms": 1.0}],
    )


def test_an_instance_whose_handler_fails_eleven_calls_in_a_minute_alerts() -> None:
    """Its probes pass: the audit's failed handlers are what tells the operator."""
    summary = RowSummary()
    summary.add(crashed_row(0))
    assert summary.notable == 1  # the writer's summary says its rows need a look
    clock = ManualClock()
    engine = AlertEngine(clock=clock)
    for n in range(10):
        assert engine.observe_batch(encode_batch([plain_row(n), crashed_row(n)])) == []
        assert engine.observe_batch(encode_batch([crashed_row(n, callee="dq-2")])) == []
        clock.advance(5.0)
    (alert,) = engine.observe_batch(encode_batch([crashed_row(10)]))
    assert alert.rule == "instance_errors"
    assert alert.key == "dq-1"
    assert alert.severity == "critical"
    assert alert.details == {"agent_id": "dq-1", "capability": "query", "failures": 11}
    assert engine.observe_batch(encode_batch([crashed_row(11)])) == []  # once a minute
    # failures spread over more than the window never add up to an alert
    clock.advance(120.0)
    for n in range(30):
        assert engine.observe_batch(encode_batch([crashed_row(n, callee="dq-3")])) == []
        clock.advance(6.1)
