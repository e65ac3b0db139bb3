"""The console's count of a batch's plain calls from their columns (reach.audit.split,
FabricView's ``_plain_calls``, ``Rollup.add_plain``): the same figures, the same calls
refused, as every event read as a map (decode_events, ``_forged``, ``Rollup.add_map``)."""

from __future__ import annotations

import math
import struct
from typing import Any

import msgpack
from hypothesis import given, settings
from hypothesis import strategies as st

from reach.audit.batch import encode_batch
from reach.audit.decode import decode_events
from reach.audit.events import CallEvent
from reach.audit.split import split_batch
from reach.console.rollup import Rollup
from reach.console.state import _forged, _plain_calls
from tests.audit_batch_helpers import events

WRITERS = st.sampled_from(["anonymous", "", "echo-1", "report-7", "mallory"])


def by_maps(data: bytes, writer: str, window_start: float) -> tuple[Rollup, int]:
    rollup, bad = Rollup(), 0
    decoded = decode_events(data)
    bad += decoded.bad
    for item in decoded.events:
        ts = item.get("ts")
        if isinstance(ts, int | float) and ts < window_start:
            continue
        if _forged(item, writer) or not rollup.add_map(item):
            bad += 1
    return rollup, bad


def by_columns(data: bytes, writer: str, window_start: float) -> tuple[Rollup, int]:
    rollup = Rollup()
    split = split_batch(data)
    bad = split.bad
    for item in split.rows:
        ts = item.get("ts")
        if isinstance(ts, int | float) and ts < window_start:
            continue
        if _forged(item, writer) or not rollup.add_map(item):
            bad += 1
    for part in split.columns:
        calls, not_counted = _plain_calls(part, writer, window_start)
        rollup.add_plain(part.capability, calls)
        bad += not_counted
    return rollup, bad


def figures(rollup: Rollup) -> dict[str, Any]:
    """Every count the pages show, over all time (percentiles of samples that are whole:
    the batches here hold fewer latencies than a bucket samples)."""
    out: dict[str, Any] = {}
    for kind, table in (("cap", rollup._caps), ("inst", rollup._insts)):
        for key, slots in table.items():
            for index, bucket in slots.items():
                out[f"{kind} {key} {index}"] = (
                    bucket.calls, bucket.ok, bucket.errors, sorted(bucket.latencies),
                )  # fmt: skip
    out["skips"] = rollup.breaker_skips
    out["denials"] = sorted(rollup.denials)
    out["overflow"] = rollup.overflow
    return out


@settings(max_examples=300, deadline=None)
@given(
    batch=st.lists(events(), max_size=40),
    writer=WRITERS,
    window_start=st.sampled_from([-math.inf, 0.0]),
)
def test_columns_counted_as_maps_are(
    batch: list[CallEvent], writer: str, window_start: float
) -> None:
    data = encode_batch(batch)
    want, want_bad = by_maps(data, writer, window_start)
    got, got_bad = by_columns(data, writer, window_start)
    assert figures(got) == figures(want)
    assert got_bad == want_bad
    assert got.newest == want.newest


def plain_part(count: int, **changes: Any) -> dict[str, Any]:
    """A caller's plain columns written by hand, as the documented format has them."""
    n = count
    part: dict[str, Any] = {
        "n": n,
        "capability": "query",
        "ts": struct.pack(f"<{n}d", *[1000.0 + i for i in range(n)]),
        "call_id": [f"c-{i}" for i in range(n)],
        "trace_id": bytes(16 * n),
        "caller": struct.pack(f"<{n}H", *[0] * n),
        "caller_agent": struct.pack(f"<{n}H", *[2] * n),
        "callee": struct.pack(f"<{n}H", *[1] * n),
        "latency_ms": struct.pack(f"<{n}d", *[2.0] * n),
        "candidates": struct.pack(f"<{n}H", *[0] * n),
        "score": struct.pack(f"<{n}d", *[math.nan] * n),
        "attempt_latency_ms": struct.pack(f"<{n}d", *[1.0] * n),
        "values": ["scheduler", "query-1", None],
        "candidate_sets": [[["query-1"], 1]],
    }
    return {**part, **changes}


def hand_batch(part: Any) -> bytes:
    return msgpack.packb(
        {"v": 4, "fields": ["ts"], "attempt_fields": ["agent_id"], "events": [], "plain": part},
        use_bin_type=True,
    )


def test_hand_written_columns_that_do_not_fit_are_refused_whole() -> None:
    broken = [
        plain_part(3, n=4),  # a count the columns do not have
        plain_part(3, callee=struct.pack("<3H", 1, 1, 9)),  # an index past the names
        plain_part(3, call_id=["c-0", "c-1", 2]),
        plain_part(3, values="scheduler"),
        plain_part(3, side="registrar"),
        plain_part(3, candidate_sets=[[["query-1"], -1]]),
        "not a map",
    ]
    for part in broken:
        data = hand_batch(part)
        assert by_columns(data, "scheduler", 0.0)[1] == by_maps(data, "scheduler", 0.0)[1] >= 1
        assert figures(by_columns(data, "scheduler", 0.0)[0]) == figures(Rollup())


def test_hand_written_columns_with_numbers_that_are_no_numbers_count_only_the_rest() -> None:
    ts = struct.pack("<4d", 1000.0, math.nan, 1002.0, math.inf)
    latency = struct.pack("<4d", 1.0, 1.0, -math.inf, 1.0)
    data = hand_batch(plain_part(4, ts=ts, attempt_latency_ms=latency))
    got, bad = by_columns(data, "scheduler", 0.0)
    want, want_bad = by_maps(data, "scheduler", 0.0)
    assert (bad, figures(got)) == (want_bad, figures(want))
    assert bad == 3
    assert got.capability("query", 1001.0, seconds=10).calls == 1
