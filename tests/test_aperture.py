"""A caller's aperture among a capability's many instances (reach.caller.routing.Aperture).

Above ``APERTURE_ABOVE`` candidates a choice samples among the caller's working set, not
among all of them: the set is what one caller's calls land on, it turns over, it drops
members that are unhealthy or gone, it widens while the instances it picks are full and
narrows back when they are not, and across callers every instance gets its share. The
planner hands a call the aperture of its route cache's own list."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterator

import pytest

from reach.caller.plan import CallPlanner
from reach.caller.routecache import RouteCache
from reach.caller.routing import (
    APERTURE,
    APERTURE_ABOVE,
    APERTURE_TURN,
    Aperture,
    Peers,
    RouteEntry,
    choose,
    route_entries,
)
from reach.clock import system_clock
from reach.resilience import BreakerBoard
from reach.telemetry import Telemetry

from .routing_helpers import instance

#: a capability with this many instances is routed through apertures
MANY = 2 * APERTURE_ABOVE


@pytest.fixture(autouse=True)
def _seeded() -> Iterator[None]:
    """Choices draw from the module's random generator: the same draws on every run."""
    state = random.getstate()
    random.seed(2026)
    yield
    random.setstate(state)


def _routes(count: int, *, in_flight: int = 0) -> list[RouteEntry]:
    return route_entries(
        [instance(f"echo-{n}", in_flight=in_flight) for n in range(count)], "echo", Peers()
    )


def _pick(routes: list[RouteEntry], board: BreakerBoard, aperture: Aperture | None) -> str:
    chosen, _ = choose(routes, "echo", breakers=board, aperture=aperture)
    assert chosen is not None
    return chosen.agent_id


def test_a_caller_routes_among_its_aperture_and_it_turns_over() -> None:
    routes = _routes(MANY)
    board = BreakerBoard()
    aperture = Aperture()
    calls = 2000
    picked = Counter(_pick(routes, board, aperture) for _ in range(calls))
    # its members, and the few that came in as it turned: one per APERTURE_TURN choices
    assert len(picked) <= APERTURE + calls // APERTURE_TURN
    assert len(aperture) == APERTURE
    # without an aperture the same calls spread over the whole capability
    spread = Counter(_pick(routes, board, None) for _ in range(calls))
    assert len(spread) > len(picked) + 500
    # turning over, the caller reaches instances it did not call at first
    later = {_pick(routes, board, aperture) for _ in range(calls)}
    assert len(later - set(picked)) > 50


def test_few_candidates_take_no_aperture() -> None:
    routes = _routes(APERTURE_ABOVE)
    aperture = Aperture()
    board = BreakerBoard()
    picked = {_pick(routes, board, aperture) for _ in range(3000)}
    assert len(aperture) == 0
    assert len(picked) > APERTURE + 3000 // APERTURE_TURN


def test_callers_apertures_share_the_capability_between_them() -> None:
    routes = _routes(MANY)
    board = BreakerBoard()
    calls: Counter[str] = Counter()
    for _caller in range(24):
        aperture = Aperture()
        calls.update(_pick(routes, board, aperture) for _ in range(500))
    # 12,000 calls over 2,048 instances (about 6 each): most instances got some, none
    # got a share far beyond its own
    assert len(calls) > 0.85 * MANY
    assert max(calls.values()) < 40


def test_members_unhealthy_or_gone_are_replaced_when_sampled() -> None:
    routes = _routes(MANY)
    board = BreakerBoard()
    aperture = Aperture()
    for _ in range(100):
        _pick(routes, board, aperture)
    for entry in routes[::2]:
        entry.unhealthy = True
    # half its members are unhealthy now; each is swapped when a sample meets it
    for _ in range(2000):
        aperture.pool(routes)
    settled = [e.unhealthy for _ in range(100) for e in aperture.pool(routes)]
    assert sum(settled) / len(settled) < 0.05
    # every choice still goes to a healthy instance
    chosen = [_pick(routes, board, aperture) for _ in range(200)]
    assert not any(routes[int(name.split("-")[1])].unhealthy for name in chosen)
    # the list shrinks (instances left): members past its end are drawn again
    del routes[APERTURE_ABOVE + 10 :]
    for _ in range(500):
        assert all(e is routes[int(e.agent_id.split("-")[1])] for e in aperture.pool(routes))


def test_an_aperture_widens_while_its_picks_are_full_and_narrows_back() -> None:
    routes = _routes(MANY, in_flight=64)  # every instance at its max_concurrency
    board = BreakerBoard()
    aperture = Aperture()
    for _ in range(100):
        _pick(routes, board, aperture)
    assert len(aperture) == APERTURE + 100
    for entry in routes:
        entry.in_flight = 0
    for _ in range(100 * APERTURE_TURN + APERTURE_TURN):
        _pick(routes, board, aperture)
    assert len(aperture) == APERTURE


def test_the_planner_hands_a_call_the_aperture_of_its_route_cache_list() -> None:
    cache = RouteCache(store=None)  # type: ignore[arg-type]  # _apply needs no store
    for n in range(APERTURE_ABOVE + 1):
        cache._apply(f"echo-{n}", instance(f"echo-{n}"), n + 1)
    for n in range(10):
        cache._apply(f"few-{n}", instance(f"few-{n}", capabilities=("few",)), n + 1)
    planner = CallPlanner(system_clock, Telemetry())
    planner.routes = cache
    few, _meta, _body = planner.plan("few", {"text": "hi"}, None, (), None)
    assert few.aperture is None
    first, _meta, _body = planner.plan("echo", {"text": "hi"}, None, (), None)
    again, _meta, _body = planner.plan("echo", {"text": "hi"}, None, (), None)
    assert first.candidates is cache.entries("echo")
    assert first.aperture is not None
    assert again.aperture is first.aperture
    # a list made for one call (two tags) has no aperture to keep
    assert cache.index_of("echo", ("a", "b"), cache.entries("echo", ("a", "b"))) is None
