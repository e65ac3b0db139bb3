"""Outlier detection (reach.resilience.outliers): an instance whose handler fails, or that
answers far slower than its peers, is set aside from a caller's choices for a while, then
tried again; the policy on a ManualClock, and the choice that honours it."""

from __future__ import annotations

from collections import Counter

import pytest

from reach.caller.routing import Peers, choose, rank, route_entries
from reach.clock import ManualClock
from reach.errors import ConfigurationError
from reach.resilience import BreakerBoard
from reach.resilience.outliers import OutlierConfig, OutlierDetector, OutlierState

from .routing_helpers import instance


def _states(n: int) -> list[OutlierState]:
    return [OutlierState() for _ in range(n)]


def test_a_run_of_handler_failures_ejects_for_the_base_time_then_it_is_tried_again() -> None:
    clock = ManualClock()
    detector = OutlierDetector(OutlierConfig(consecutive_errors=5, base_ejection_sec=10), clock)
    states = _states(3)
    bad = states[0]
    assert not any(detector.error(bad, "bad", clock.monotonic(), states) for _ in range(4))
    assert not bad.ejected(clock.monotonic())
    assert detector.error(bad, "bad", clock.monotonic(), states)
    assert bad.ejected(clock.monotonic())
    assert bad.reason == "errors"
    clock.advance(9.9)
    assert bad.ejected(clock.monotonic())
    clock.advance(0.2)
    assert not bad.ejected(clock.monotonic())


def test_a_good_answer_ends_the_run() -> None:
    clock = ManualClock()
    detector = OutlierDetector(OutlierConfig(consecutive_errors=3), clock)
    states = _states(3)
    bad = states[0]
    for _ in range(10):
        assert not detector.error(bad, "flaky", clock.monotonic(), states)
        assert not detector.error(bad, "flaky", clock.monotonic(), states)
        detector.good(bad)
    assert bad.until == 0.0


def test_back_from_an_ejection_one_bad_answer_ejects_again_for_twice_as_long() -> None:
    clock = ManualClock()
    config = OutlierConfig(consecutive_errors=5, base_ejection_sec=10, max_ejection_sec=30)
    detector = OutlierDetector(config, clock)
    states = _states(3)
    bad = states[0]
    for _ in range(5):
        detector.error(bad, "bad", clock.monotonic(), states)
    lengths = []
    for _ in range(4):
        start = clock.monotonic()
        lengths.append(bad.until - start)
        clock.advance(bad.until - start + 0.01)
        assert detector.error(bad, "bad", clock.monotonic(), states)  # probation: one is enough
    lengths.append(bad.until - clock.monotonic())
    assert lengths == pytest.approx([10, 20, 30, 30, 30])
    # good answers end the probation: the next run must be a whole one again
    clock.advance(31)
    for _ in range(5):
        detector.good(bad)
    assert bad.ejections == 0
    assert not any(detector.error(bad, "bad", clock.monotonic(), states) for _ in range(4))
    assert detector.error(bad, "bad", clock.monotonic(), states)
    assert bad.until - clock.monotonic() == pytest.approx(10)


def test_attempts_in_flight_when_it_was_ejected_count_no_more() -> None:
    """Calls sent before the ejection end badly after it: they are the run that ejected
    it, not a failed probation."""
    clock = ManualClock()
    detector = OutlierDetector(OutlierConfig(consecutive_slow=3), clock)
    states = _states(3)
    crawling = states[0]
    sent = clock.monotonic()
    clock.advance(0.3)
    assert not detector.slow(crawling, "c", sent, 300.0, 2.0, states)
    assert not detector.slow(crawling, "c", sent, 300.0, 2.0, states)
    assert detector.slow(crawling, "c", sent, 300.0, 2.0, states)
    until = crawling.until
    for _ in range(5):  # the rest of that burst times out after the ejection
        assert not detector.slow(crawling, "c", sent, 300.0, 2.0, states)
    assert crawling.until == until
    assert crawling.ejections == 1


def test_business_errors_do_not_count_but_end_a_run() -> None:
    """The call path reports a business error as a good answer."""
    clock = ManualClock()
    detector = OutlierDetector(OutlierConfig(consecutive_errors=2), clock)
    states = _states(2)
    detector.error(states[0], "a", clock.monotonic(), states)
    detector.good(states[0])
    assert not detector.error(states[0], "a", clock.monotonic(), states)


def test_at_most_the_share_and_never_the_last_one_standing() -> None:
    clock = ManualClock()
    detector = OutlierDetector(OutlierConfig(consecutive_errors=1, max_ejected_share=0.5), clock)
    four = _states(4)
    assert detector.error(four[0], "a", clock.monotonic(), four)
    assert detector.error(four[1], "b", clock.monotonic(), four)
    assert not detector.error(four[2], "c", clock.monotonic(), four)  # half of them out already
    two = _states(2)
    assert detector.error(two[0], "a", clock.monotonic(), two)  # one of two: at least one may go
    assert not detector.error(two[1], "b", clock.monotonic(), two)  # never the last one
    one = _states(1)
    assert not detector.error(one[0], "only", clock.monotonic(), one)
    none = OutlierDetector(OutlierConfig(consecutive_errors=1, max_ejected_share=0.0), clock)
    pair = _states(2)
    assert none.error(
        pair[0], "a", clock.monotonic(), pair
    )  # at least one of two or more, whatever the share


def test_slow_answers_eject_only_an_instance_far_slower_than_its_peers() -> None:
    clock = ManualClock()
    detector = OutlierDetector(OutlierConfig(consecutive_slow=3, slow_factor=3.0), clock)
    states = _states(3)
    slow = states[0]
    assert not detector.slow(slow, "slow", clock.monotonic(), 1000.0, 200.0, states)
    assert not detector.slow(slow, "slow", clock.monotonic(), 1000.0, 200.0, states)
    assert detector.slow(slow, "slow", clock.monotonic(), 1000.0, 200.0, states)
    assert slow.reason == "slow"
    # slow everywhere (what every instance depends on is slow): nobody is an outlier
    everywhere = _states(3)
    for _ in range(10):
        assert not detector.slow(everywhere[0], "a", clock.monotonic(), 1000.0, 900.0, everywhere)
        assert not detector.slow(everywhere[0], "a", clock.monotonic(), 1000.0, None, everywhere)


def test_probes_passing_again_end_an_ejection_and_a_new_process_starts_afresh() -> None:
    """A hung instance fails its probes; once they pass again it is back at once. One
    that answers its probes all along stays set aside."""
    clock = ManualClock()
    detector = OutlierDetector(OutlierConfig(consecutive_slow=1), clock)
    states = _states(3)
    hung = states[0]
    detector.registry(hung, "p-1", healthy=True)
    assert detector.slow(hung, "hung", clock.monotonic(), 300.0, 2.0, states)
    detector.registry(hung, "p-1", healthy=True)  # probes still pass: a crawling one
    assert hung.ejected(clock.monotonic())
    detector.registry(hung, "p-1", healthy=False)
    assert hung.ejected(clock.monotonic())
    detector.registry(hung, "p-1", healthy=True)  # resumed
    assert not hung.ejected(clock.monotonic())
    assert detector.slow(hung, "hung", clock.monotonic(), 300.0, 2.0, states)  # on probation still
    detector.registry(hung, "p-2", healthy=True)  # restarted: another process
    assert not hung.ejected(clock.monotonic())
    assert hung.ejections == 0


@pytest.mark.parametrize(
    "field",
    [
        {"consecutive_errors": 0},
        {"consecutive_slow": -1},
        {"slow_factor": 0.5},
        {"base_ejection_sec": float("nan")},
        {"max_ejection_sec": 1.0},
        {"max_ejected_share": 1.5},
    ],
)
def test_bad_config_is_refused_with_the_field_named(field: dict[str, object]) -> None:
    with pytest.raises(ConfigurationError) as err:
        OutlierConfig(**field)  # type: ignore[arg-type]
    assert next(iter(field)) in str(err.value)


# -- the choice honours it ----------------------------------------------------------------


def test_an_ejected_instance_gets_no_call_until_its_time_is_up() -> None:
    clock = ManualClock()
    peers = Peers(clock=clock)
    routes = route_entries([instance(a) for a in ("a", "b", "bad")], "echo", peers)
    board = BreakerBoard(clock=clock)
    detector = OutlierDetector(OutlierConfig(base_ejection_sec=10), clock)
    bad = peers.peer("bad").outlier
    states = [r.peer.outlier for r in routes]
    for _ in range(5):
        detector.error(bad, "bad", clock.monotonic(), states)
    picks: Counter[str] = Counter()
    for _ in range(1000):
        chosen, _ = choose(routes, "echo", breakers=board)
        assert chosen is not None
        picks[chosen.agent_id] += 1
    assert picks["bad"] == 0
    assert "bad" not in [
        i.agent_id for _, i in rank([r.instance for r in routes], "echo", peers=peers)
    ]
    clock.advance(10.1)
    for _ in range(300):
        chosen, _ = choose(routes, "echo", breakers=board)
        assert chosen is not None
        picks[chosen.agent_id] += 1
    assert picks["bad"] > 0


def test_an_ejected_instance_still_takes_calls_when_nothing_else_is_left() -> None:
    """A retry goes back to an instance the call failed on before an ejected one; an
    ejected one is chosen rather than none."""
    clock = ManualClock()
    peers = Peers(clock=clock)
    routes = route_entries([instance("a"), instance("bad")], "echo", peers)
    board = BreakerBoard(clock=clock)
    detector = OutlierDetector(OutlierConfig(consecutive_errors=1), clock)
    states = [r.peer.outlier for r in routes]
    assert detector.error(peers.peer("bad").outlier, "bad", clock.monotonic(), states)
    chosen, _ = choose(routes, "echo", breakers=board, failed={"a"})
    assert chosen is not None
    assert chosen.agent_id == "a"
    # the other one turned unhealthy meanwhile: the ejected one is all there is
    left = route_entries([instance("a", status="unhealthy"), instance("bad")], "echo", peers)
    chosen, _ = choose(left, "echo", breakers=board)
    assert chosen is not None
    assert chosen.agent_id == "bad"
    ranked = rank([r.instance for r in left], "echo", peers=peers)
    assert [i.agent_id for _, i in ranked] == ["bad"]
