"""The plain-call columns of an audit batch (reach/audit/columns.py), on their own.

What goes in comes back out: the same events from the columns being filled, the same
events from their packed map, a size estimate that is never below the packed size, and
a clear refusal of what a batch's reader would not take.
"""

from __future__ import annotations

import gc
import math

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reach.audit.batch import event_row
from reach.audit.columns import Columns, expand_plain
from reach.audit.events import CallEvent, attempt

NAMES = st.sampled_from(["echo-1", "echo-2", "report-7", "", "é-ü", "名前"])
TRACE = st.one_of(
    st.text("0123456789abcdef", min_size=32, max_size=32),
    st.text("0123456789abcdefABCDEF", min_size=31, max_size=33),
    st.sampled_from(["", "not-a-trace", "0123456789abcdef0123456789abcdé"]),
)
NUMBER = st.floats(allow_nan=False, width=64)
CANDIDATES = st.sampled_from([(), ("echo-1",), ("echo-1", "echo-2"), ("é-ü", "名前", "")])
#: the map keys and column headers of a packed ``plain`` map, which the estimate leaves out
HEAD_BYTES = 400


@st.composite
def plain_calls(draw: st.DrawFn) -> CallEvent:
    callee = draw(NAMES)
    return CallEvent(
        ts=draw(NUMBER),
        capability="q",
        call_id=draw(st.text(max_size=40)),
        trace_id=draw(TRACE),
        caller=draw(NAMES),
        caller_agent=draw(st.one_of(st.none(), NAMES)),
        actor=draw(st.one_of(st.none(), NAMES)),
        callee=callee,
        outcome="ok",
        latency_ms=draw(NUMBER),
        candidates=draw(CANDIDATES),
        n_candidates=draw(st.integers(0, 2**32 - 1)),
        attempts=(
            attempt(
                agent_id=callee,
                score=draw(st.one_of(st.none(), NUMBER)),
                latency_ms=draw(NUMBER),
            ),
        ),
    )


def rows(events: list[CallEvent]) -> list[str]:
    """The events' rows, comparable when a latency is NaN (their reprs are equal)."""
    return [repr(event_row(e)) for e in events]


@settings(max_examples=200, deadline=None)
@given(calls=st.lists(plain_calls(), max_size=30))
def test_columns_give_back_the_events_they_were_given(calls: list[CallEvent]) -> None:
    columns = Columns()
    for call in calls:
        columns.add(call)
    assert len(columns) == len(calls)
    assert rows(columns.events("q")) == rows(calls)
    packed = msgpack.packb(columns.encode("q"), use_bin_type=True)
    assert len(packed) <= columns.size + HEAD_BYTES
    decoded = expand_plain(msgpack.unpackb(packed, raw=False))
    assert [
        repr(list(map(d.get, ("call_id", "caller", "actor", "callee", "ts")))) for d in decoded
    ] == [repr([c.call_id, c.caller, c.actor, c.callee, c.ts]) for c in calls]


def test_trace_ids_travel_as_raw_bytes_when_they_are_all_hex() -> None:
    columns = Columns()
    for n in range(3):
        columns.add(call(trace_id=f"{n:032x}"))
    assert columns.encode("q")["trace_id"] == bytes(16) + (1).to_bytes(16) + (2).to_bytes(16)
    columns.add(call(trace_id="0AF7651916CD43DD8448EB211C80319C"))  # upper case: as text
    assert columns.encode("q")["trace_id"][3] == "0AF7651916CD43DD8448EB211C80319C"


def call(**changes: object) -> CallEvent:
    fields: dict[str, object] = {
        "ts": 1.0,
        "capability": "q",
        "call_id": "id",
        "trace_id": "t",
        "caller": "me",
        "callee": "echo-1",
        "outcome": "ok",
        "latency_ms": 2.0,
        "candidates": ("echo-1",),
        "n_candidates": 1,
        "attempts": (attempt(agent_id="echo-1", score=0.5, latency_ms=3.0),),
    }
    return CallEvent(**{**fields, **changes})  # type: ignore[arg-type]


@pytest.mark.parametrize("count", [-1, 2**32, 2**70])
def test_a_count_no_reader_takes_is_refused_and_nothing_recorded(count: int) -> None:
    columns = Columns()
    with pytest.raises(ValueError, match="n_candidates must be in"):
        columns.add(call(n_candidates=count))
    assert (len(columns), columns.size) == (0, 0)


def test_columns_are_full_before_an_index_would_need_more_than_two_bytes() -> None:
    columns = Columns()
    n = 0
    while not columns.full:
        columns.add(call(caller=f"caller-{n}"))
        n += 1
    assert 0xFFFF - 3 <= len(columns.values) <= 0xFFFF
    assert columns.events("q")[-1].caller == f"caller-{n - 1}"
    encoded = columns.encode("q")
    assert len(expand_plain(encoded)) == n


def test_the_columns_keep_no_reference_to_the_event_they_were_given() -> None:
    """A recorded event is let go at once: the columns hold its fields, not the record
    (held records would be containers the garbage collector walks)."""
    columns = Columns()
    event = call(call_id="call-" + str(id(columns)), ts=math.pi)
    held = len(gc.get_referrers(event))
    for _ in range(100):
        columns.add(event)
    assert len(gc.get_referrers(event)) == held
    assert event not in gc.get_referents(columns)
