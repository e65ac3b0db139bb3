"""Budgets by key: a registrar's per agent id (control messages), the issuer's per client
(token requests), and who the server says sent a token request."""

from __future__ import annotations

import json
import random

import pytest

from reach.clock import ManualClock
from reach.registry.controlbudget import (
    BURST,
    DEFAULT_INTERVAL_SEC,
    MAX_RATE,
    PER_INTERVAL,
    ControlBudget,
)
from reach.security.accounts import REQUEST_INFO_HEADER, requester
from reach.security.ratelimit import RateByKey


def test_an_honest_instance_is_never_over_its_budget() -> None:
    clock = ManualClock()
    budget = ControlBudget(clock)
    rng = random.Random(7)
    interval = 0.5
    # it starts: an announce and its first heartbeat at once
    assert budget.take("a-1", None)
    assert budget.take("a-1", interval)
    for beat in range(2_000):
        clock.advance(interval * rng.uniform(0.9, 1.0))  # the agent's jitter
        assert budget.take("a-1", interval), beat
        if beat % 400 == 399:  # a reconnect: a heartbeat at once, and an announce again
            assert budget.take("a-1", interval)
            assert budget.take("a-1", interval)
    assert budget.dropped == 0


def test_a_flood_gets_its_burst_then_its_rate_and_no_more() -> None:
    clock = ManualClock()
    budget = ControlBudget(clock)
    interval = 0.5
    taken = sum(budget.take("rogue", interval) for _ in range(10_000))
    assert taken == BURST
    seconds = 10.0
    for _ in range(int(seconds * 1000)):  # a thousand a second for ten seconds
        clock.advance(0.001)
        taken += budget.take("rogue", interval)
    assert taken == pytest.approx(BURST + seconds * PER_INTERVAL / interval, abs=1)
    # an agent id of its own is not touched by another's flood
    assert budget.take("honest", interval)


def test_a_short_interval_does_not_buy_more_than_the_cap() -> None:
    clock = ManualClock()
    budget = ControlBudget(clock)
    taken = 0
    for _ in range(10_000):  # ten seconds, a thousand a second
        clock.advance(0.001)
        taken += budget.take("fast", 0.0001)
    assert taken == pytest.approx(BURST + 10 * MAX_RATE, abs=1)


def test_an_agent_id_without_a_record_has_the_default_interval() -> None:
    clock = ManualClock()
    budget = ControlBudget(clock)
    taken = 0
    for _ in range(1_000):
        clock.advance(0.01)
        taken += budget.take("new", None)
    assert taken == pytest.approx(BURST + 10 * PER_INTERVAL / DEFAULT_INTERVAL_SEC, abs=1)


def test_rate_by_key_forgets_every_key_when_full() -> None:
    clock = ManualClock()
    rate = RateByKey(2, max_tracked=3, clock=clock)
    assert rate.take("a", 1.0)
    assert rate.take("a", 1.0)
    assert not rate.take("a", 1.0)
    for key in ("b", "c", "d"):  # the fourth key finds it full: all are forgotten
        assert rate.take(key, 1.0)
    assert rate.take("a", 1.0)
    assert rate.refused == 1
    with pytest.raises(ValueError, match="burst"):
        RateByKey(0.5)


@pytest.mark.parametrize(
    ("headers", "user"),
    [
        ({REQUEST_INFO_HEADER: json.dumps({"acc": "CLIENTS", "user": "c-1"})}, "c-1"),
        ({REQUEST_INFO_HEADER: json.dumps({"acc": "CLIENTS", "rtt": 5})}, None),  # no share
        ({REQUEST_INFO_HEADER: json.dumps({"user": ""})}, None),
        ({REQUEST_INFO_HEADER: json.dumps({"user": 7})}, None),
        ({REQUEST_INFO_HEADER: json.dumps(["user"])}, None),
        ({REQUEST_INFO_HEADER: "{not json"}, None),
        ({REQUEST_INFO_HEADER: ""}, None),
        ({"Other": "x"}, None),
        ({}, None),
        (None, None),
    ],
)
def test_the_requester_is_the_user_the_server_stamped(
    headers: dict[str, str] | None, user: str | None
) -> None:
    assert requester(headers) == user
