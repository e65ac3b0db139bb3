"""The plain-call columns in C (reach/audit/_columns.c) against the same in Python.

Both must say the same thing: the same map to pack, the same events read back, the same
size estimate, and the same answer to a wrong argument (a TypeError, nothing recorded).
Skipped where ``make build`` did not build the C columns (a pure install).
"""

from __future__ import annotations

import math
import sys
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reach.audit.columns import NATIVE_COLUMNS, Columns, PlainColumns, expand_plain, plain_events

pytestmark = pytest.mark.skipif(NATIVE_COLUMNS is None, reason="the C columns are not built")

NAMES = st.sampled_from(["echo-1", "echo-2", "report-7", "", "é-ü", "名前"])
TRACE = st.one_of(
    st.text("0123456789abcdef", min_size=32, max_size=32),
    st.text("0123456789abcdefABCDEF", min_size=31, max_size=33),
    st.sampled_from(["", "not-a-trace", "0123456789abcdef0123456789abcdé"]),
)
NUMBER = st.floats(allow_nan=False, width=64)
CANDIDATES = st.sampled_from([(), ("echo-1",), ("echo-1", "echo-2"), ("é-ü", "名前", "")])

call_args = st.tuples(
    NUMBER,
    st.text(max_size=40),
    TRACE,
    NAMES,
    st.one_of(st.none(), NAMES),
    NAMES,
    NUMBER,
    CANDIDATES,
    st.integers(0, 2**32 - 1),
    st.one_of(st.none(), NUMBER),
    NUMBER,
)


def native() -> PlainColumns:
    assert NATIVE_COLUMNS is not None
    return NATIVE_COLUMNS()


def same_events(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    """Equal, a NaN where the other has a NaN (a call's latency may be one)."""

    def key(event: dict[str, Any]) -> str:
        return repr(event)  # nan == nan is False; their reprs are equal

    return [key(e) for e in a] == [key(e) for e in b]


def add_all(columns: PlainColumns, calls: list[tuple[Any, ...]]) -> None:
    for call in calls:
        columns.add(*call)


@settings(max_examples=200, deadline=None)
@given(calls=st.lists(call_args, max_size=30))
def test_c_columns_pack_and_read_back_what_python_columns_do(calls: list[tuple[Any, ...]]) -> None:
    c, py = native(), Columns()
    add_all(c, calls)
    add_all(py, calls)
    assert (len(c), c.size, c.full) == (len(py), py.size, py.full)
    assert same_events(plain_events(c, "query"), plain_events(py, "query"))
    mine, theirs = c.encode("query"), py.encode("query")
    assert mine.keys() == theirs.keys()
    assert same_events(expand_plain(mine), expand_plain(theirs))
    assert same_events(expand_plain(mine), plain_events(py, "query"))


def test_c_columns_grow_past_their_first_arrays() -> None:
    """Thousands of calls (past the arrays' first room and the text's first 16 KiB)."""
    calls = [
        (float(n), f"call-{n}-" + "x" * (n % 50), f"{n:032x}", "me", None, f"echo-{n % 3}",
         n / 7, ("echo-0", "echo-1"), 3, None if n % 2 else 0.5, n / 9)
        for n in range(20_000)
    ]  # fmt: skip
    c, py = native(), Columns()
    add_all(c, calls)
    add_all(py, calls)
    assert c.encode("q") == py.encode("q")  # the trace ids as raw bytes, no NaN here...
    assert same_events(plain_events(c, "q"), plain_events(py, "q"))


def test_an_id_that_is_not_utf8_is_kept_and_the_columns_refuse_to_pack() -> None:
    c = native()
    c.add(1.0, "a", "t" * 32, "me", None, "echo-1", 1.0, (), 0, None, 1.0)
    c.add(2.0, "b\udcff", "\udcff", "me", None, "echo-1", 1.0, (), 0, None, 1.0)
    with pytest.raises(ValueError, match="not UTF-8"):
        c.encode("q")
    assert [(e["call_id"], e["trace_id"]) for e in plain_events(c, "q")] == [
        ("a", "t" * 32),
        ("b\udcff", "\udcff"),
    ]


GOOD: tuple[Any, ...] = (1.0, "id", "t", "me", None, "echo-1", 2.0, ("echo-1",), 1, 0.5, 3.0)


@pytest.mark.parametrize(
    ("at", "value", "named"),
    [
        (0, "now", "must be real number"),
        (1, b"id", "call_id must be a str"),
        (2, None, "trace_id must be a str"),
        (3, 7, "caller must be a str"),
        (4, 7, "caller_agent must be a str or None"),
        (5, None, "callee must be a str"),
        (7, ["echo-1"], "candidates must be a tuple of str"),
        (7, ("echo-1", 2), "a candidate must be a str"),
        (8, "1", "n_candidates must be an int"),
        (8, True, "n_candidates must be an int"),
        (3, type("Name", (str,), {})("me"), "caller must be a str"),  # not a subclass
        (9, "high", "must be real number"),
    ],
)
def test_a_wrong_argument_is_a_type_error_and_records_nothing(
    at: int, value: Any, named: str
) -> None:
    c = native()
    c.add(*GOOD)
    size = c.size
    bad = list(GOOD)
    bad[at] = value
    with pytest.raises(TypeError, match=named):
        c.add(*bad)
    assert (len(c), c.size) == (1, size)
    with pytest.raises(TypeError, match="takes 11 arguments"):
        c.add(*GOOD[:10])
    assert [e["call_id"] for e in plain_events(c, "q")] == ["id"]


@pytest.mark.parametrize("count", [-1, 2**32, 2**70])
def test_a_count_no_reader_takes_is_refused(count: int) -> None:
    c = native()
    with pytest.raises(ValueError, match="n_candidates must be in"):
        c.add(*GOOD[:8], count, *GOOD[9:])
    assert len(c) == 0


def test_full_columns_refuse_another_call() -> None:
    """Indexes are two bytes: past 65,532 names a call is refused, not cut short."""
    c = native()
    n = 0
    while not c.full:
        c.add(1.0, "id", "t", f"caller-{n}", None, "echo-1", 1.0, (), 0, None, 1.0)
        n += 1
    with pytest.raises(ValueError, match="full"):
        c.add(*GOOD)
    assert len(c) == n
    assert plain_events(c, "q")[-1]["caller"] == f"caller-{n - 1}"


def test_c_columns_keep_no_reference_to_a_calls_ids_or_numbers() -> None:
    """What a call hands over is let go at once (the point of the C columns): only the
    last caller, callee and candidate tuple are held, to compare the next call's with."""
    c = native()
    call_id, trace, ts = "call-" + str(id(c)), "f" * 32, math.pi * 1e9
    before = [sys.getrefcount(x) for x in (call_id, trace, ts)]
    for _ in range(100):
        c.add(ts, call_id, trace, "me", None, "echo-1", ts, ("echo-1",), 1, ts, ts)
    assert [sys.getrefcount(x) for x in (call_id, trace, ts)] == before
