"""Scored instance choice (DESIGN.md, "Routing").

::

    score = 0.4·health + 0.3·max(0, 1 − avg_latency/latency_sla)
          + 0.2·(1 − load/max_load) + 0.1·(1.0 if stable else 0.7)

Pure functions over registry records plus the caller's own observations (latency EWMA, its
calls in flight); cheap enough to run on every call.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Collection, Container, Iterable, Mapping, Sized
from typing import Final

from reach.errors import CircuitOpen, ConfigurationError, NoHealthyInstance
from reach.models import HealthStatus, Instance, RoutingFacts
from reach.resilience import BreakerBoard

__all__ = [
    "HEALTH_SCORES",
    "RANK_ALL",
    "RANK_SAMPLE",
    "LatencyTracker",
    "choose",
    "rank",
    "score_instance",
]

#: up to this many candidates are all ranked; beyond, a random sample of RANK_SAMPLE is
#: (ranking costs ~2 µs per candidate: 10,000 instances of one capability would cost ms)
RANK_ALL = 16
RANK_SAMPLE = 8

#: health term of the score. Degraded is halfway: the instance still answers but its
#: registrar saw trouble (a missed probe, not ready), so it gets calls only when it is
#: clearly better on the other terms. Unhealthy scores 0 here, and rank() never returns it.
HEALTH_SCORES: Final[Mapping[HealthStatus, float]] = {
    "healthy": 1.0,
    "degraded": 0.5,
    "unhealthy": 0.0,
}

W_HEALTH: Final = 0.4
W_LATENCY: Final = 0.3
W_LOAD: Final = 0.2
W_STABLE: Final = 0.1
#: scores this close to the best are equally good: traffic is spread among them. Narrower
#: than the pre-release penalty (0.1 × 0.3 = 0.03), so stable versions still win.
TIE_BAND: Final = 0.025
#: the stability term for a pre-release version (1.0 for a release)
PRERELEASE: Final = 0.7
#: latency term when the caller has no observation yet: as if avg latency were half the SLA.
#: A new instance then ranks below proven fast ones but above proven slow ones, so it gets
#: some traffic and a measurement instead of being starved or flooded.
UNKNOWN_LATENCY_TERM: Final = 0.5


def score_instance(
    instance: Instance, *, sla_ms: float, avg_latency_ms: float | None, load: float
) -> float:
    """The routing score of ``instance`` in [0, 1]; higher is better.

    ``sla_ms`` is the capability's ``latency_sla_ms`` (> 0, as the manifest guarantees);
    ``avg_latency_ms`` the caller's observed average (None = not measured yet: counts as
    half the SLA); ``load`` the share of the instance's concurrency in use (clamped to 0..1).
    """
    return _score(instance.status, instance.manifest.stable, sla_ms, avg_latency_ms, load)


def _score(
    status: HealthStatus, stable: bool, sla_ms: float, avg_latency_ms: float | None, load: float
) -> float:
    if avg_latency_ms is None:
        latency = UNKNOWN_LATENCY_TERM
    else:
        latency = 1.0 - avg_latency_ms / sla_ms
        latency = 0.0 if latency < 0.0 else 1.0 if latency > 1.0 else latency
    load = 0.0 if load < 0.0 else 1.0 if load > 1.0 else load
    return (
        W_HEALTH * HEALTH_SCORES[status]
        + W_LATENCY * latency
        + W_LOAD * (1.0 - load)
        + W_STABLE * (1.0 if stable else PRERELEASE)
    )


class LatencyTracker:
    """Exponentially weighted moving average of observed call latency, per agent_id.

    ``alpha`` is the weight of the newest observation: 0.2 follows a change within ~10 calls
    while one slow call moves the average by a fifth of the difference only.
    """

    __slots__ = ("_avg", "alpha")

    def __init__(self, alpha: float = 0.2) -> None:
        if isinstance(alpha, bool) or not 0 < alpha <= 1:
            raise ConfigurationError(f"alpha must be in (0, 1], got {alpha!r}")
        self.alpha = alpha
        self._avg: dict[str, float] = {}

    def observe(self, agent_id: str, ms: float) -> None:
        """Fold one observed latency (ms) in; the first observation is taken as is."""
        if ms < 0.0:
            ms = 0.0
        avg = self._avg.get(agent_id)
        self._avg[agent_id] = ms if avg is None else avg + self.alpha * (ms - avg)

    def get(self, agent_id: str) -> float | None:
        """The average latency (ms), None if never observed."""
        return self._avg.get(agent_id)

    def forget(self, agent_id: str) -> None:
        """Drop an agent's average (it left the registry)."""
        self._avg.pop(agent_id, None)

    def __len__(self) -> int:
        return len(self._avg)


def rank(
    instances: Iterable[Instance],
    capability: str,
    *,
    latency: LatencyTracker,
    outstanding: Mapping[str, int],
    exclude: Container[str] = (),
    rng: Callable[[], float] = random.random,
) -> list[tuple[float, Instance]]:
    """Instances that can take a call to ``capability``, best first, with their scores.

    Healthy and degraded instances that offer the capability and are not in ``exclude``
    (e.g. the instances a retry already tried); never unhealthy ones. Load is the larger of
    the instance's own in-flight count (from its last heartbeat, possibly stale) and the
    caller's own calls in flight to it (``outstanding``, always current), over its
    ``max_concurrency``.

    Scores within ``TIE_BAND`` of the best are treated as equal and ordered randomly
    (``rng``, one draw per instance): when instances are about equally good, always
    picking the marginally best one would put all traffic on one instance and leave the
    others idle (and unmeasured). The band is narrower than the pre-release penalty, so a
    stable version still wins over an otherwise equal pre-release one.

    An instance whose latency this caller has not observed yet is scored with the best
    latency observed among the candidates, so a new instance gets tried and measured
    instead of starved.
    """
    # per candidate only its routing facts (gathered once per record) and two dict lookups:
    # among thousands of instances each candidate is a cache miss, so fewer objects is faster
    candidates: list[tuple[Instance, RoutingFacts, float, float, float | None]] = []
    best_known: float | None = None
    observed_of = latency.get
    mine_of = outstanding.get
    for inst in instances:
        facts = inst.routing_facts
        agent_id = facts.agent_id
        if facts.status == "unhealthy" or agent_id in exclude:
            continue
        sla_ms = facts.sla_ms.get(capability)
        if sla_ms is None:
            continue
        in_flight = facts.in_flight
        mine = mine_of(agent_id, 0)
        load = (in_flight if in_flight > mine else mine) / (facts.max_concurrency or 1)
        observed = observed_of(agent_id)
        if observed is not None and (best_known is None or observed < best_known):
            best_known = observed
        candidates.append((inst, facts, sla_ms, load, observed))
    scored: list[tuple[float, int, Instance]] = []
    for i, (inst, facts, sla_ms, load, observed) in enumerate(candidates):
        score = _score(
            facts.status,
            facts.stable,
            sla_ms,
            observed if observed is not None else best_known,
            load,
        )
        # the index settles equal scores, so Instances are never compared
        scored.append((score, i, inst))
    if len(scored) < 2:
        return [(score, inst) for score, _, inst in scored]
    scored.sort(reverse=True)
    floor = scored[0][0] - TIE_BAND
    cut = next((n for n, entry in enumerate(scored) if entry[0] < floor), len(scored))
    if cut > 1:
        ties = scored[:cut]
        draws = [rng() for _ in ties]
        order = sorted(range(cut), key=draws.__getitem__)
        scored[:cut] = [ties[n] for n in order]
    return [(score, inst) for score, _, inst in scored]


def choose(
    instances: Iterable[Instance],
    capability: str,
    *,
    latency: LatencyTracker,
    outstanding: Mapping[str, int],
    breakers: BreakerBoard,
    failed: Collection[str] = (),
    sample: Callable[[str, int], list[Instance]] | None = None,
    skipped: list[str] | None = None,
) -> tuple[Instance | None, float | None]:
    """The instance a call goes to, and its score (None: the only candidate, not ranked).

    ``(None, None)`` when no instance is known (the capability's queue subject decides).
    Beyond ``RANK_ALL`` candidates a random ``RANK_SAMPLE`` are ranked (the power of k
    choices), taken with ``sample(capability, k)`` when ``instances`` is not a list; the
    whole set is ranked if the sample has nobody to offer. Instances in ``failed`` are
    tried only when nothing else is left. Instances passed over because their breaker is
    open are appended to ``skipped``. NoHealthyInstance if every known instance is
    unhealthy; CircuitOpen (saying when to try again) if every breaker is open.
    """
    if isinstance(instances, Sized) and len(instances) == 1 and not failed:
        (only,) = instances
        if only.status != "unhealthy" and breakers.get(only.agent_id).allow():
            return only, None
    pool: Iterable[Instance] = instances
    if isinstance(instances, Sized) and len(instances) > RANK_ALL:
        if isinstance(instances, list):
            pool = random.sample(instances, RANK_SAMPLE)
        elif sample is not None:
            pool = sample(capability, RANK_SAMPLE)
    ranked = rank(pool, capability, latency=latency, outstanding=outstanding, exclude=failed)
    if not ranked and pool is not instances:
        ranked = rank(
            instances, capability, latency=latency, outstanding=outstanding, exclude=failed
        )
    if not ranked and failed:
        ranked = rank(instances, capability, latency=latency, outstanding=outstanding)
    if not ranked:
        known = list(instances)
        if not known:
            return None, None
        why = ", ".join(f"{i.agent_id} {i.status} ({i.status_reason})" for i in known[:5])
        raise NoHealthyInstance(f"no healthy instance of {capability}: {why}")
    for score, inst in ranked:
        if breakers.get(inst.agent_id).allow():
            return inst, score
        if skipped is not None and inst.agent_id not in skipped:
            skipped.append(inst.agent_id)
    targets = [inst.agent_id for _, inst in ranked]
    retry_at = breakers.earliest_retry_at(targets)
    retry_in = max(0.0, retry_at - breakers.clock.monotonic())
    raise CircuitOpen(capability, retry_at, retry_in=retry_in)
