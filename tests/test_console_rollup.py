"""The console's call figures (reach.console.rollup): the same counts as reach top's
(reach.audit.stats) for the same events, whether read as models or as maps; bounded."""

from __future__ import annotations

import math

import pytest

from reach.audit.eventmodels import AuditEvent
from reach.audit.stats import CallStats
from reach.console import rollup as rollup_module
from reach.console.rollup import SAMPLES, Rollup


def events(now: float) -> list[AuditEvent]:
    out = []
    for i in range(300):
        retried = i % 10 == 0
        attempts = [{"agent_id": f"a-{i % 3}", "outcome": "timeout", "latency_ms": 50.0}] * retried
        attempts.append({"agent_id": f"a-{(i + 1) % 3}", "outcome": "ok", "latency_ms": i / 10})
        failed = i % 7 == 0
        out.append(
            AuditEvent.model_validate(
                {
                    "ts": now - 50 + i / 10,
                    "capability": f"cap{i % 2}",
                    "call_id": f"c-{i}",
                    "outcome": "error" if failed else "ok",
                    "error": "business" if failed else None,
                    "callee": f"a-{(i + 1) % 3}",
                    "latency_ms": i / 10 + 1,
                    "attempts": attempts if not failed else [],
                    "skipped": ["a-2"] if i == 299 else [],
                }
            )
        )
    return out


def test_the_same_calls_give_reach_tops_figures_as_models_or_as_maps() -> None:
    now = 1_000_000.0
    stats = CallStats(window_sec=60)
    by_model, by_map = Rollup(), Rollup()
    for event in events(now):
        stats.add(event)
        by_model.add(event)
        assert by_map.add_map(event.model_dump(mode="json"))
    for capability, tally in stats.by_capability().items():
        for rollup in (by_model, by_map):
            got = rollup.capability(capability, now, seconds=60)
            assert (got.calls, got.ok, got.errors) == (tally.calls, tally.ok, tally.errors)
            assert got.p50 == tally.p(0.5)
            assert got.p99 == tally.p(0.99)
    for agent_id, tally in stats.by_instance().items():
        got = by_map.instance(agent_id, now, seconds=60)
        assert (got.calls, got.ok, got.errors) == (tally.calls, tally.ok, tally.errors)
    assert set(by_map.breaker_skips) == set(stats.open_breakers(now))


@pytest.mark.parametrize(
    "bad",
    [
        {"ts": math.nan}, {"ts": "1"}, {"ts": True}, {"capability": 3}, {"outcome": None},
        {"latency_ms": math.inf}, {"attempts": "x"}, {"attempts": [["a", "ok", 1.0]]},
        {"attempts": [{"agent_id": 1}]}, {"skipped": "a-1"}, {"skipped": [1]}, {"side": []},
    ],
)  # fmt: skip
def test_a_malformed_event_is_refused_and_counts_nothing(bad: dict[str, object]) -> None:
    rollup = Rollup()
    good = {"ts": 100.0, "capability": "c", "outcome": "ok", "callee": "a-1", "latency_ms": 1.0}
    assert not rollup.add_map({**good, **bad})
    assert rollup.capability("c", 100.0).calls == 0
    assert rollup.add_map(good)
    assert rollup.capability("c", 100.0).calls == 1


def test_memory_is_bounded_by_names_not_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rollup_module, "MAX_KEYS", 10)
    rollup = Rollup()
    for i in range(5000):
        item = {"ts": 100.0 + i / 1000, "capability": f"c{i % 20}", "outcome": "ok",
                "callee": "a-1", "latency_ms": float(i)}  # fmt: skip
        assert rollup.add_map(item)
    assert len(rollup.capabilities()) == 10
    assert rollup.overflow == 2500  # the calls of the 10 names beyond the bound
    assert rollup.instance("a-1", 106.0).calls == 5000
    kept = sum(len(b.latencies) for _, b in rollup.series("c0", 106.0))
    assert kept <= SAMPLES * 2  # 250 calls of c0 in one or two buckets, sampled
    rollup.trim(100.0 + 1000)
    assert rollup.capabilities() == []
