"""Hypothesis strategies of audit events for the batch format's tests: half of them
plain calls (the columns' case), the rest anything a writer may record."""

from __future__ import annotations

from hypothesis import strategies as st

from reach.audit.events import CallEvent
from tests.audit_helpers import make_event

NAMES = st.sampled_from(["echo-1", "echo-2", "report-7", "", "é-ü"])
TRACE = st.one_of(
    st.text("0123456789abcdef", min_size=32, max_size=32),
    st.text("0123456789ABCDEF", min_size=32, max_size=32),
    st.text("0123456789abcdef \t\n", min_size=32, max_size=32),  # fromhex skips blanks
    st.sampled_from(["", "not-a-trace", "0123456789abcdef0123456789abcdé"]),
)
FLOAT = st.floats(allow_nan=False, allow_infinity=False, width=64)


@st.composite
def events(draw: st.DrawFn) -> CallEvent:
    callee = draw(NAMES)
    plain = draw(st.booleans())  # half of them built to be plain calls, the rest anything
    attempt = st.tuples(
        NAMES, st.one_of(st.none(), FLOAT), st.sampled_from(["ok", "timeout"]), FLOAT
    )
    return make_event(
        side="caller" if plain else draw(st.sampled_from(["caller", "callee"])),
        ts=draw(FLOAT),
        capability=draw(st.sampled_from(["query", "query", "other"])),
        call_id=draw(st.text(max_size=40)),
        trace_id=draw(TRACE),
        caller=draw(NAMES),
        caller_agent=draw(st.one_of(st.none(), NAMES)),
        actor=draw(st.one_of(st.none(), NAMES)),
        callee=callee,
        outcome="ok" if plain else draw(st.sampled_from(["ok", "error"])),
        error=None if plain else draw(st.sampled_from([None, "timeout", "breaker"])),
        code="" if plain else draw(st.sampled_from(["", "E1"])),
        latency_ms=draw(FLOAT),
        candidates=tuple(draw(st.lists(NAMES, max_size=4))),
        n_candidates=draw(st.integers(0, 2**40)),
        skipped=() if plain else tuple(draw(st.lists(NAMES, max_size=1))),
        attempts=(
            ((callee, draw(st.one_of(st.none(), FLOAT)), "ok", draw(FLOAT)),)
            if plain
            else tuple(draw(st.lists(attempt, max_size=2)))
        ),
        fallback=None if plain else draw(st.sampled_from([None, "cache"])),
    )
