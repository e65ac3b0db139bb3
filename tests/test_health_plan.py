"""The sweep's one-reading answers (``keep_until``, ``probe_plan``) say exactly what the
policy's separate questions say, on records and states drawn at random."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

from reach.clock import ManualClock
from reach.registry.health import HealthPolicy
from reach.wire.models import Instance, Manifest

from .conftest import manifest


def _instance(rnd: random.Random, now: float) -> Instance:
    interval = rnd.choice([0.5, 1.0, 2.5, 5.0, 15.0])
    return Instance(
        manifest=Manifest.model_validate(
            manifest(
                f"plan-{rnd.randrange(5)}",
                interval=interval,
                timeout=0.3,
                failures=rnd.choice([1, 2, 3]),
            )
        ),
        instance_id="plan-i",
        status=rnd.choice(["healthy", "degraded", "unhealthy"]),
        registered_at=now - rnd.uniform(0, 4 * interval),
        last_heartbeat_at=now - rnd.uniform(0, 5 * interval),
    )


def _draws(
    seed: int, policy_of: Callable[[random.Random, ManualClock], HealthPolicy]
) -> Iterator[tuple[random.Random, HealthPolicy, float, Instance]]:
    """3,000 policies and records at random, the clock moving on between them."""
    rnd = random.Random(seed)
    clock = ManualClock()
    for _ in range(3000):
        policy = policy_of(rnd, clock)
        now = clock.time()
        yield rnd, policy, now, _instance(rnd, now)
        clock.advance(rnd.uniform(0, 3))


def test_keep_until_is_review_then_next_review_at() -> None:
    draws = _draws(
        7, lambda rnd, clock: HealthPolicy(clock, evict_after_intervals=rnd.choice([2.0, 3.0, 4.5]))
    )
    for rnd, policy, now, inst in draws:
        policy.started_at = now - rnd.uniform(0, 20)
        policy.trouble_at = rnd.choice([0.0, now - rnd.uniform(0, 20)])
        if rnd.random() < 0.5:
            policy.heard(inst.agent_id, now - rnd.uniform(0, 10))
        since = rnd.choice([0.0, now - rnd.uniform(0, 20)])
        expected = (
            policy.next_review_at(inst, now, since)
            if policy.review(inst, now, since).action == "keep"
            else None
        )
        assert policy.keep_until(inst, now, since) == expected


def test_probe_plan_is_probe_due_then_next_probe_at() -> None:
    """As the sweep asked before: due?, started if so, then when the next is due."""
    draws = _draws(
        11,
        lambda rnd, clock: HealthPolicy(
            clock, new_agent_window_sec=rnd.choice([0.0, 5.0, 86400.0])
        ),
    )
    for rnd, policy, now, inst in draws:
        if rnd.random() < 0.7:
            policy.probe_started(inst.agent_id, now - rnd.uniform(0, 10))
        plan = policy.probe_plan(inst, now)
        due = policy.probe_due(inst, now)
        if due:
            policy.probe_started(inst.agent_id, now)
        assert plan == (due, policy.next_probe_at(inst, now))
