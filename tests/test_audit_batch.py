"""The audit batch format: plain calls as columns beside full rows, read back exactly.

The oracle is a batch of rows alone, the simplest layout of the format: a batch made by
``encode_batch`` (columns where it can) must decode to the very events that the same
events, written as plain rows, decode to. A batch of another version is refused whole.
"""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reach.audit.alerts import AlertEngine
from reach.audit.batch import BATCH_VERSION, BatchBuilder, encode_batch, event_row
from reach.audit.decode import BatchVersionError, decode_events, decode_raw, read_counts
from reach.audit.eventmodels import AuditBatch, decode_batch
from reach.audit.events import ATTEMPT_FIELDS, EVENT_FIELDS, CallEvent
from reach.audit.split import split_batch
from reach.clock import ManualClock
from reach.errors import CodecError
from tests.audit_batch_helpers import events
from tests.audit_helpers import make_event


def rows_only(events: list[CallEvent]) -> bytes:
    """The same events as a batch of rows alone."""
    rows = [event_row(e) for e in events]
    return msgpack.packb(
        {"v": BATCH_VERSION, "fields": EVENT_FIELDS, "attempt_fields": ATTEMPT_FIELDS,
         "events": rows},
        use_bin_type=True,
    )  # fmt: skip


def changed(event: CallEvent, **changes: Any) -> CallEvent:
    """``event`` with some of its fields changed."""
    return CallEvent(**{**{name: getattr(event, name) for name in EVENT_FIELDS}, **changes})


@settings(max_examples=300, deadline=None)
@given(batch=st.lists(events(), max_size=40))
def test_columns_and_rows_read_back_as_the_same_events_in_the_same_order(
    batch: list[CallEvent],
) -> None:
    data = encode_batch(batch)
    assert decode_batch(data) == decode_batch(rows_only(batch))
    assert decode_events(data).events == decode_events(rows_only(batch)).events
    if batch:
        AuditBatch.model_validate(msgpack.unpackb(data, raw=False))  # the documented shape


def plain(n: int, capability: str = "query") -> CallEvent:
    return make_event(
        ts=1_764_000_000.0 + n / 1000,
        capability=capability,
        call_id=f"4f1c9a2be07d{n:x}",
        trace_id=f"{n:032x}",
        caller="scheduler-7f3e",
        callee=f"query-{n % 3}",
        outcome="ok",
        latency_ms=0.8 + n / 1e4,
        candidates=("query-0", "query-1", "query-2"),
        n_candidates=3,
        attempts=((f"query-{n % 3}", 0.91, "ok", 0.75 + n / 1e4),),
    )


def test_plain_calls_take_well_under_half_the_bytes_of_rows() -> None:
    batch = [plain(n) for n in range(1000)]
    data = encode_batch(batch)
    assert len(msgpack.unpackb(data)["events"]) == 0  # every one of them in the columns
    assert len(data) < 0.45 * len(rows_only(batch))
    assert [e.call_id for e in decode_batch(data)[0]] == [plain(n).call_id for n in range(1000)]


def test_rows_fall_in_their_place_among_plain_calls() -> None:
    retried = make_event(
        ts=1.0, capability="query", call_id="r", outcome="ok",
        attempts=[{"agent_id": "query-1", "outcome": "timeout"}, {"agent_id": "query-2"}],
    )  # fmt: skip
    other = plain(99, capability="other")  # plain, but not of the batch's capability
    batch = [retried, plain(1), plain(2), other, plain(3), retried]
    ids = [e.call_id for e in decode_batch(encode_batch(batch))[0]]
    assert ids == ["r", plain(1).call_id, plain(2).call_id, other.call_id, plain(3).call_id, "r"]


def corrupt(**changes: Any) -> bytes:
    batch = msgpack.unpackb(encode_batch([plain(n) for n in range(4)]), raw=False)
    for key, value in changes.items():
        if key == "positions":
            batch["positions"] = value
        else:
            batch["plain"][key] = value
    return msgpack.packb(batch, use_bin_type=True)


@pytest.mark.parametrize(
    "changes",
    [
        {"ts": b"\x00" * 7},  # a column of the wrong size
        {"latency_ms": [1.0, 2.0, 3.0, 4.0]},  # of the wrong type
        {"callee": b"\xff\xff" * 4},  # an index past the table of values
        {"candidates": b"\x05\x00" * 4},  # past the candidate sets
        {"candidate_sets": [["query-0"]]},  # a set without its count
        {"call_id": ["a", "b", 3, "d"]},
        {"trace_id": b"\x00" * 15},
        {"values": [1, 2]},
        {"n": -1},
        {"capability": None},
    ],
    ids=lambda changes: ",".join(changes),
)
def test_a_damaged_column_loses_its_events_and_says_so_without_raising(
    changes: dict[str, Any],
) -> None:
    events, bad = decode_batch(corrupt(**changes))
    assert events == []
    assert bad >= 1


def test_damaged_positions_keep_every_event() -> None:
    retried = make_event(
        ts=1.0, capability="query", call_id="r", outcome="error", error="timeout",
        attempts=[{"agent_id": "query-1", "outcome": "timeout"}] * 2,
    )  # fmt: skip
    batch = msgpack.unpackb(encode_batch([plain(0), retried, plain(1)]), raw=False)
    for positions in ([7], [0, 1], ["1"], None):
        batch["positions"] = positions
        events, bad = decode_batch(msgpack.packb(batch, use_bin_type=True))
        ids = sorted(e.call_id for e in events)
        assert ids == sorted([plain(0).call_id, plain(1).call_id, "r"])
        assert bad == 0


def test_alerts_count_plain_calls_beside_the_rows_they_read() -> None:
    def breaker() -> CallEvent:
        return make_event(ts=0.0, capability="query", outcome="error", error="breaker")

    engine = AlertEngine(clock=ManualClock())
    mixed = encode_batch([plain(n) for n in range(30)] + [breaker()] * 3)
    assert read_counts(mixed) is None  # notable rows: the engine reads the batch
    assert engine.observe_batch(mixed) == []  # 3 rejections of 33 calls: below 10 %
    assert [a.rule for a in engine.observe_batch(encode_batch([breaker()]))] == [
        "breaker_rejections"
    ]


def test_a_builder_refuses_nothing_it_cannot_pack_silently() -> None:
    builder = BatchBuilder("query")
    with pytest.raises(ValueError, match="surrogates"):
        builder.add(make_event(ts=0.0, capability="query", outcome="ok", code="x\udcff"))
    assert builder.count == 0
    builder.add(plain(1))
    assert (builder.count, len(builder.positions)) == (1, 0)


def test_a_name_that_cannot_be_packed_costs_only_its_own_event() -> None:
    """Columns are packed when the batch is sealed: one of them that cannot be (a lone
    surrogate is not UTF-8) turns the batch into rows, and only that event is lost."""
    builder = BatchBuilder("query")
    bad = changed(plain(2), caller_agent="x\udcff")
    retried = make_event(
        ts=1.0, capability="query", call_id="r", outcome="ok",
        attempts=[{"agent_id": "query-1", "outcome": "timeout"}, {"agent_id": "query-2"}],
    )  # fmt: skip
    for event in (plain(1), retried, bad, plain(3)):
        builder.add(event)
    data, summary, lost = builder.encode()
    assert lost == 1
    events, bad_count = decode_batch(data)
    assert bad_count == 0
    assert sorted(e.call_id for e in events) == sorted([plain(1).call_id, "r", plain(3).call_id])
    assert summary.calls == {"query": 3}
    assert decode_batch(data) == decode_batch(rows_only([retried, plain(1), plain(3)]))


@pytest.mark.parametrize("field", ["call_id", "trace_id"])
def test_an_id_that_cannot_be_packed_costs_only_its_own_event(field: str) -> None:
    builder = BatchBuilder("query")
    for event in (plain(1), changed(plain(2), **{field: "x\udcff"}), plain(3)):
        builder.add(event)
    data, summary, lost = builder.encode()
    assert lost == 1
    assert [e.call_id for e in decode_batch(data)[0]] == [plain(1).call_id, plain(3).call_id]
    assert summary.calls == {"query": 2}


def test_field_names_that_are_not_names_make_a_bad_batch_not_a_crash() -> None:
    batch = msgpack.unpackb(encode_batch([plain(1)]), raw=False)
    for key, value in (("fields", [[1]]), ("attempt_fields", [{"a": 1}])):
        damaged = msgpack.packb({**batch, key: value}, use_bin_type=True)
        assert decode_batch(damaged) == ([], 1)
        assert AlertEngine(clock=ManualClock()).observe_batch(damaged) == []


def test_a_builder_with_its_tables_full_keeps_the_rest_as_rows() -> None:
    builder = BatchBuilder("query")
    for n in range(70_000):
        builder.add(make_event(ts=0.0, capability="query", caller=f"c{n}", outcome="ok",
                                   attempts=[{"agent_id": ""}]))  # fmt: skip
    assert len(builder.columns) < 0xFFFF < builder.count
    events, bad = decode_batch(builder.encode()[0])
    assert (len(events), bad) == (70_000, 0)
    assert {e.caller for e in events} == {f"c{n}" for n in range(70_000)}


@pytest.mark.parametrize("version", [1, 2, 3, 5, None, "4", 4.5, True])
def test_a_batch_of_another_version_is_refused_whole_by_name(version: Any) -> None:
    batch = msgpack.unpackb(encode_batch([plain(n) for n in range(3)]), raw=False)
    if version is None:
        del batch["v"]
    else:
        batch["v"] = version
    data = msgpack.packb(batch, use_bin_type=True)
    for read in (decode_events, decode_batch, decode_raw, split_batch):
        with pytest.raises(BatchVersionError, match="this reader reads version 4") as caught:
            read(data)
        assert isinstance(caught.value, CodecError)
        assert (caught.value.version, caught.value.path) == (version, "v")
    assert read_counts(data) is None  # not counted from its summary either
    with pytest.raises(BatchVersionError):
        AlertEngine(clock=ManualClock()).observe_batch(data)
