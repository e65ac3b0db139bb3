"""Choosing the instance a call goes to (reach.caller.routing): the score formula of
docs/architecture.md, the latency average, ranking, and the choice among candidates
(ties, samples of many, open breakers, stale averages)."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest

from reach.caller.routing import Peers, rank, score_instance
from reach.errors import ConfigurationError
from reach.wire.models import Instance

from .routing_helpers import instance

# -- the formula -------------------------------------------------------------------------


def test_score_matches_the_design_formula_by_hand() -> None:
    # 0.4·1 + 0.3·(1 − 250/500) + 0.2·(1 − 0.25) + 0.1·1 = 0.4 + 0.15 + 0.15 + 0.1
    inst = instance("a")
    assert score_instance(inst, sla_ms=500, avg_latency_ms=250, load=0.25) == pytest.approx(0.8)
    # 0.4·0.5 + 0.3·max(0, 1 − 2) + 0.2·(1 − 1) + 0.1·0.7
    worst = instance("b", status="degraded", version="2.0.0-rc.1")
    assert score_instance(worst, sla_ms=500, avg_latency_ms=1000, load=1.0) == pytest.approx(0.27)
    # a perfect instance: healthy, instant, idle, stable
    assert score_instance(inst, sla_ms=500, avg_latency_ms=0, load=0.0) == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("status", "health"), [("healthy", 1.0), ("degraded", 0.5), ("unhealthy", 0.0)]
)
def test_health_term(status: str, health: float) -> None:
    score = score_instance(instance("a", status=status), sla_ms=100, avg_latency_ms=100, load=1.0)
    assert score == pytest.approx(0.4 * health + 0.1)


def test_pre_release_versions_score_lower() -> None:
    stable = score_instance(instance("a", version="1.2.0"), sla_ms=100, avg_latency_ms=50, load=0)
    pre = score_instance(
        instance("b", version="1.3.0-beta.2"), sla_ms=100, avg_latency_ms=50, load=0
    )
    build = score_instance(
        instance("c", version="1.2.0+build.7"), sla_ms=100, avg_latency_ms=50, load=0
    )
    assert stable - pre == pytest.approx(0.03)
    assert build == stable  # build metadata is not a pre-release


def test_unknown_latency_counts_as_half_the_sla() -> None:
    inst = instance("a")
    unknown = score_instance(inst, sla_ms=800, avg_latency_ms=None, load=0)
    assert unknown == score_instance(inst, sla_ms=800, avg_latency_ms=400, load=0)
    assert unknown == pytest.approx(0.4 + 0.15 + 0.2 + 0.1)


def test_latency_and_load_terms_are_clamped() -> None:
    inst = instance("a")
    assert score_instance(inst, sla_ms=100, avg_latency_ms=10_000, load=5.0) == pytest.approx(0.5)
    assert score_instance(inst, sla_ms=100, avg_latency_ms=-5, load=-1.0) == pytest.approx(1.0)


def test_slower_and_busier_instances_score_lower() -> None:
    inst = instance("a")
    fast = score_instance(inst, sla_ms=1000, avg_latency_ms=100, load=0.5)
    slow = score_instance(inst, sla_ms=1000, avg_latency_ms=600, load=0.5)
    busy = score_instance(inst, sla_ms=1000, avg_latency_ms=100, load=0.9)
    assert fast - slow == pytest.approx(0.15)
    assert fast - busy == pytest.approx(0.08)


# -- peers: latency average ---------------------------------------------------------------------


def test_peer_latency_is_an_ewma() -> None:
    tracker = Peers(alpha=0.2)
    assert tracker.latency("a") is None
    tracker.observe("a", 100)
    assert tracker.latency("a") == 100
    tracker.observe("a", 200)
    assert tracker.latency("a") == pytest.approx(120)
    tracker.observe("a", 200)
    assert tracker.latency("a") == pytest.approx(136)
    tracker.observe("b", -3)
    assert tracker.latency("b") == 0
    tracker.forget("a")
    tracker.forget("never-seen")
    assert tracker.latency("a") is None
    assert len(tracker) == 1


@pytest.mark.parametrize("alpha", [0, -0.1, 1.5])
def test_peers_refuse_bad_alpha(alpha: float) -> None:
    with pytest.raises(ConfigurationError):
        Peers(alpha=alpha)


# -- rank --------------------------------------------------------------------------------


def ids(ranked: list[tuple[float, Instance]]) -> list[str]:
    return [inst.agent_id for _, inst in ranked]


def test_rank_orders_best_first_and_drops_what_cannot_take_the_call() -> None:
    tracker = Peers()
    tracker.observe("fast", 50)
    tracker.observe("slow", 450)
    instances = [
        instance("slow"),
        instance("sick", status="unhealthy"),
        instance("fast"),
        instance("other-cap", capabilities=("translate",)),
        instance("degraded", status="degraded"),
        instance("beta", version="1.1.0-beta.1"),
    ]
    ranked = rank(instances, "echo", peers=tracker)
    # beta and degraded are unmeasured: scored with the best latency seen (fast's 50 ms)
    assert ids(ranked) == ["fast", "beta", "degraded", "slow"]
    scores = [score for score, _ in ranked]
    assert scores == sorted(scores, reverse=True)
    # fast: 0.4 + 0.3·0.9 + 0.2 + 0.1
    assert scores[0] == pytest.approx(0.97)


def test_rank_uses_the_capabilitys_own_sla() -> None:
    tracker = Peers()
    tracker.observe("a", 400)
    inst = instance("a", capabilities=("echo", "slow_echo"), sla_ms=800)
    [(score, _)] = rank([inst], "slow_echo", peers=tracker)
    assert score == pytest.approx(0.4 + 0.3 * 0.5 + 0.2 + 0.1)


def test_rank_honours_exclude() -> None:
    instances = [instance("a"), instance("b"), instance("c")]
    ranked = rank(instances, "echo", peers=Peers(), exclude={"a", "c"})
    assert ids(ranked) == ["b"]
    assert rank(instances, "echo", peers=Peers(), exclude=["a", "b", "c"]) == []


def test_load_is_the_larger_of_heartbeat_and_own_calls_in_flight() -> None:
    instances = [
        instance("reported-busy", in_flight=8, max_concurrency=10),
        instance("busy-with-me", in_flight=0, max_concurrency=10),
        instance("idle", max_concurrency=10),
    ]
    peers = Peers()
    peers.peer("busy-with-me").outstanding = 5
    ranked = rank(instances, "echo", peers=peers)
    assert ids(ranked) == ["idle", "busy-with-me", "reported-busy"]
    by_id = {inst.agent_id: score for score, inst in ranked}
    assert by_id["idle"] - by_id["busy-with-me"] == pytest.approx(0.2 * 0.5)
    assert by_id["idle"] - by_id["reported-busy"] == pytest.approx(0.2 * 0.8)


def test_overloaded_degraded_instance_still_ranks_but_last() -> None:
    instances = [instance("d", status="degraded", in_flight=100, max_concurrency=10), instance("h")]
    assert ids(rank(instances, "echo", peers=Peers())) == ["h", "d"]


def test_equal_scores_are_spread_across_instances() -> None:
    instances = [instance(f"echo-{i}") for i in range(3)]
    rng = random.Random(7).random
    first = Counter(ids(rank(instances, "echo", peers=Peers(), rng=rng))[0] for _ in range(600))
    assert set(first) == {"echo-0", "echo-1", "echo-2"}
    assert min(first.values()) > 120


def test_a_better_score_always_wins_over_the_random_tie_break() -> None:
    instances = [instance(f"echo-{i}") for i in range(5)]
    peers = Peers()
    peers.peer("echo-1").outstanding = 10
    for _ in range(50):
        ranked = rank(instances, "echo", peers=peers)
        assert ids(ranked)[-1] == "echo-1"


def test_near_equal_instances_share_the_traffic() -> None:
    tracker = Peers()
    for name, ms in (("a", 1.0), ("b", 1.3), ("c", 0.9)):
        tracker.observe(name, ms)
    instances = [instance("a"), instance("b"), instance("c")]
    firsts = [ids(rank(instances, "echo", peers=tracker))[0] for _ in range(300)]
    assert all(firsts.count(n) > 50 for n in "abc")


def test_an_unmeasured_instance_is_tried_rather_than_starved() -> None:
    tracker = Peers()
    tracker.observe("old", 2.0)
    instances = [instance("old"), instance("new")]
    firsts = [ids(rank(instances, "echo", peers=tracker))[0] for _ in range(200)]
    assert firsts.count("new") > 40


def test_rank_handles_a_thousand_instances() -> None:
    instances = [instance(f"echo-{i}", in_flight=i % 64) for i in range(1000)]
    ranked = rank(instances, "echo", peers=Peers())
    assert len(ranked) == 1000
    # in-flight counts a few apart are within the tie band; the busiest always come last
    assert ranked[0][1].in_flight <= 8
    assert ranked[-1][1].in_flight == 63


# -- the choice ----------------------------------------------------------------------------


def test_choice_among_many_samples_but_never_misses_the_one_healthy_instance() -> None:
    from reach.caller.routing import RANK_ALL, choose, route_entries
    from reach.resilience import BreakerBoard

    many = [instance(f"a-{n}", status="unhealthy") for n in range(10 * RANK_ALL)]
    many[37] = instance("a-37")
    routes = route_entries(many, "echo", Peers())
    for _ in range(20):
        chosen, score = choose(routes, "echo", breakers=BreakerBoard())
        assert chosen is not None
        assert chosen.agent_id == "a-37"
        assert score is not None


def test_choice_spreads_over_many_equal_instances() -> None:
    from reach.caller.routing import choose, route_entries
    from reach.resilience import BreakerBoard

    many = route_entries([instance(f"a-{n}") for n in range(1000)], "echo", Peers())
    board = BreakerBoard()
    picked = Counter(
        choose(many, "echo", breakers=board)[0].agent_id  # type: ignore[union-attr]
        for _ in range(2000)
    )
    assert len(picked) > 500  # a sample each time, not always the same few


def test_a_copied_record_is_routed_on_its_own_facts() -> None:
    """Routing facts are computed once per record; a copy with other fields (as the
    registrar makes them) gets its own, never the original's."""
    inst = instance("a", in_flight=2)
    assert inst.routing_facts.status == "healthy"
    assert not inst.batches
    copy = inst.model_copy(update={"status": "unhealthy", "in_flight": 9, "features": ["batch"]})
    assert copy.routing_facts.status == "unhealthy"
    assert copy.routing_facts.in_flight == 9
    assert copy.batches
    assert rank([copy], "echo", peers=Peers()) == []
    assert inst.routing_facts.status == "healthy"  # the original keeps its own


def _open(board: Any, agent_id: str) -> None:
    """Fail calls to ``agent_id`` until its breaker opens (by the failures in a row, or
    the window's ratio, whichever comes first)."""
    breaker = board.get(agent_id)
    for _ in range(board.config.min_calls):
        if not breaker.allow():
            break
        breaker.record_failure()
    assert not breaker.allow()


def test_choice_passes_over_open_breakers_and_says_which() -> None:
    from reach.caller.routing import choose, route_entries
    from reach.errors import CircuitOpen
    from reach.resilience import BreakerBoard

    tracker = Peers()
    for agent_id, ms in (("best", 10.0), ("next", 200.0), ("last", 400.0)):
        tracker.observe(agent_id, ms)
    routes = route_entries([instance(a) for a in ("last", "best", "next")], "echo", tracker)
    board = BreakerBoard()
    _open(board, "best")
    skipped: list[str] = []
    chosen, score = choose(routes, "echo", breakers=board, skipped=skipped)
    assert chosen is not None
    assert chosen.agent_id == "next"
    assert score == pytest.approx(0.4 + 0.3 * (1 - 200 / 500) + 0.2 + 0.1)
    assert skipped == ["best"]
    _open(board, "next")
    _open(board, "last")
    with pytest.raises(CircuitOpen):
        choose(routes, "echo", breakers=board)


def test_choice_goes_back_to_a_failed_instance_only_when_nothing_else_is_left() -> None:
    from reach.caller.routing import choose, route_entries
    from reach.resilience import BreakerBoard

    routes = route_entries([instance("a"), instance("b")], "echo", Peers())
    board = BreakerBoard()
    for _ in range(50):
        chosen, _ = choose(routes, "echo", breakers=board, failed={"a"})
        assert chosen is not None
        assert chosen.agent_id == "b"
    chosen, _ = choose(routes, "echo", breakers=board, failed={"a", "b"})
    assert chosen is not None
    assert choose([], "echo", breakers=board) == (
        None,
        None,
    )


def test_an_open_breaker_passed_over_is_always_said_even_among_ties() -> None:
    """Two instances in one tie band, one breaker open: when the pick falls on the open one
    and another serves, the open one was passed over and is said so. The ranking after a
    refusal reshuffles the tie band, and the refused one was recorded only when the
    reshuffle happened to put it first (about half as often as it was passed over)."""
    import random

    from reach.caller.routing import choose, route_entries
    from reach.resilience import BreakerBoard

    tracker = Peers()
    for agent_id in ("a", "b"):
        tracker.observe(agent_id, 50.0)
    routes = route_entries([instance(a) for a in ("a", "b")], "echo", tracker)
    board = BreakerBoard()
    _open(board, "a")
    said = 0
    state = random.getstate()
    try:
        for seed in range(200):
            random.seed(seed)
            skipped: list[str] = []
            chosen, _ = choose(routes, "echo", breakers=board, skipped=skipped)
            assert chosen is not None
            assert chosen.agent_id == "b"
            assert skipped in ([], ["a"])
            said += skipped == ["a"]
    finally:
        random.setstate(state)
    # the pick falls on "a" about half the time (100 of 200 expected; 50 before)
    assert said > 70


# -- no starving instance ------------------------------------------------------------------


def test_an_instance_outside_the_band_after_a_spike_gets_its_share_again() -> None:
    """Three instances at 2 ms; "b" answered four calls in 150 ms (a pause), which puts its
    average ≈ 0.07 below the others, far outside the tie band. A choice every ms, each
    call answered in 2 ms before the next."""
    from reach.caller.routing import LATENCY_STALE_SEC, choose, route_entries
    from reach.clock import ManualClock
    from reach.resilience import BreakerBoard

    clock = ManualClock()
    peers = Peers(clock=clock)
    for name in "abc":
        peers.observe(name, 2.0)
    for _ in range(4):
        peers.observe("b", 150.0)
    routes = route_entries([instance(n) for n in "abc"], "echo", peers)
    board = BreakerBoard(clock=clock)
    picks: list[str] = []
    for _ in range(4000):
        chosen, _ = choose(routes, "echo", breakers=board)
        assert chosen is not None
        picks.append(chosen.agent_id)
        peers.fold(chosen.peer, 2.0)
        clock.advance(0.001)
    stale_ms = int(LATENCY_STALE_SEC * 1000)
    # while its average is fresh it gets nothing (so it cannot show that it recovered) ...
    assert "b" not in picks[: stale_ms - 10]
    # ... once it is stale: one call, a fresh measurement, and back in the band
    then = Counter(picks[stale_ms + 100 :])
    assert min(then.values()) > 0.25 * sum(then.values()), then


def test_a_slow_instance_costs_one_call_per_stale_period() -> None:
    from reach.caller.routing import choose, route_entries
    from reach.clock import ManualClock
    from reach.resilience import BreakerBoard

    clock = ManualClock()
    peers = Peers(clock=clock)
    latency = {"a": 2.0, "b": 2.0, "slow": 200.0}
    for name, ms in latency.items():
        peers.observe(name, ms)
    routes = route_entries([instance(n) for n in latency], "echo", peers)
    board = BreakerBoard(clock=clock)
    picked: Counter[str] = Counter()
    for _ in range(5000):  # 5 s, a call each ms, each answered before the next
        chosen, _ = choose(routes, "echo", breakers=board)
        assert chosen is not None
        picked[chosen.agent_id] += 1
        peers.fold(chosen.peer, latency[chosen.agent_id])
        clock.advance(0.001)
    assert 1 <= picked["slow"] <= 6


def test_a_stale_instance_with_a_call_in_flight_keeps_its_average() -> None:
    """The one call that measures a stale instance is enough: while it is out, the
    instance is scored on its old average, so a hung one gets no flood of calls."""
    from reach.clock import ManualClock

    clock = ManualClock()
    peers = Peers(clock=clock)
    peers.observe("a", 2.0)
    peers.observe("slow", 300.0)
    clock.advance(5.0)
    peers.observe("a", 2.0)
    instances = [instance("a"), instance("slow")]
    firsts = [ids(rank(instances, "echo", peers=peers))[0] for _ in range(200)]
    assert firsts.count("slow") > 40  # stale: scored like an unmeasured instance
    peers.peer("slow").outstanding = 1
    firsts = [ids(rank(instances, "echo", peers=peers))[0] for _ in range(200)]
    assert firsts.count("slow") == 0


def test_a_quiet_caller_keeps_its_old_averages() -> None:
    """Nobody measured recently: the averages it has are all it knows, and they rank."""
    from reach.clock import ManualClock

    clock = ManualClock()
    peers = Peers(clock=clock)
    peers.observe("fast", 2.0)
    peers.observe("slow", 300.0)
    clock.advance(60.0)
    instances = [instance("fast"), instance("slow")]
    for _ in range(50):
        assert ids(rank(instances, "echo", peers=peers))[0] == "fast"


def test_an_observation_after_a_stale_average_replaces_it() -> None:
    from reach.clock import ManualClock

    clock = ManualClock()
    peers = Peers(clock=clock)
    peers.observe("a", 300.0)
    peers.observe("a", 2.0)  # fresh: folded in
    assert peers.latency("a") == pytest.approx(240.4)
    clock.advance(1.0)
    peers.observe("a", 2.0)  # the average was old news
    assert peers.latency("a") == 2.0
