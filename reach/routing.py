"""Scored instance choice (DESIGN.md, "Routing").

::

    score = 0.4·health + 0.3·max(0, 1 − avg_latency/latency_sla)
          + 0.2·(1 − load/max_load) + 0.1·(1.0 if stable else 0.7)

Pure functions over registry records plus the caller's own observations (latency EWMA, its
calls in flight); cheap enough to run on every call.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Collection, Container, Iterable, Mapping, Sequence
from operator import itemgetter
from typing import Final, NamedTuple, TypeVar

from reach.errors import CircuitOpen, ConfigurationError, NoHealthyInstance
from reach.models import Capability, HealthStatus, Instance
from reach.resilience import BreakerBoard

__all__ = [
    "HEALTH_SCORES",
    "RANK_ALL",
    "RANK_SAMPLE",
    "LatencyTracker",
    "RouteEntry",
    "choose",
    "rank",
    "route_entries",
    "route_entry",
    "sample",
    "score_instance",
]

_T = TypeVar("_T")
_SCORE = itemgetter(0)

#: up to this many candidates are all ranked; beyond, a random sample of RANK_SAMPLE is
#: (scoring costs about half a µs per candidate: 10,000 of one capability would cost ms)
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
    latency = (
        UNKNOWN_LATENCY_TERM if avg_latency_ms is None else _latency_term(avg_latency_ms / sla_ms)
    )
    load = 0.0 if load < 0.0 else 1.0 if load > 1.0 else load
    return _base(status, stable) + W_LOAD * (1.0 - load) + W_LATENCY * latency


def _base(status: HealthStatus, stable: bool) -> float:
    """The terms of the score that depend on the record alone: health and stability."""
    return W_HEALTH * HEALTH_SCORES[status] + W_STABLE * (1.0 if stable else PRERELEASE)


def _latency_term(share_of_sla: float) -> float:
    """1 − avg_latency/latency_sla, clamped to [0, 1]."""
    term = 1.0 - share_of_sla
    return 0.0 if term < 0.0 else 1.0 if term > 1.0 else term


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


class RouteEntry(NamedTuple):
    """One instance as a route to one capability: what a choice reads of it, gathered once
    per registry record (the route cache builds it as the record arrives), never per call.

    Among thousands of instances each candidate is a cache miss, so a choice touches this
    one tuple and the caller's own observations, not the record's objects."""

    agent_id: str
    unhealthy: bool
    #: the terms of the score a call does not change: W_HEALTH·health + W_STABLE·stable
    base: float
    #: 1 / the capability's latency_sla_ms
    per_sla_ms: float
    #: in-flight calls at the instance's last heartbeat
    in_flight: int
    #: 1 / the instance's max_concurrency
    per_slot: float
    instance: Instance
    #: the capability as the instance declares it (its contract and SLA)
    spec: Capability


def route_entry(instance: Instance, capability: str) -> RouteEntry | None:
    """``instance`` as a route to ``capability``; None if it does not offer it."""
    facts = instance.routing_facts
    spec = instance.manifest.capability(capability)
    if spec is None:
        return None
    sla_ms = facts.sla_ms[capability]
    return RouteEntry(
        facts.agent_id,
        facts.status == "unhealthy",
        _shared(_base(facts.status, facts.stable)),
        _shared(1.0 / sla_ms),
        facts.in_flight,
        _shared(1.0 / (facts.max_concurrency or 1)),
        instance,
        spec,
    )


def _shared(value: float) -> float:
    """One float object per distinct value (there are few: a handful of SLAs and pool
    sizes), so a choice among thousands of entries reads values that stay in the CPU
    cache instead of one scattered object per entry."""
    if len(_SHARED) >= _SHARED_MAX:
        return value
    return _SHARED.setdefault(value, value)


_SHARED: dict[float, float] = {}
_SHARED_MAX = 4096


def route_entries(instances: Iterable[Instance], capability: str) -> list[RouteEntry]:
    """The instances that offer ``capability``, as routes to it (for lists of records that
    do not come from a route cache, which keeps them ready)."""
    return [e for e in (route_entry(i, capability) for i in instances) if e is not None]


def sample(items: Sequence[_T], k: int) -> list[_T]:
    """``k`` distinct items picked at random (all of them if there are no more than ``k``),
    in O(k) when picking few from many."""
    n = len(items)
    if n <= k:
        return list(items)
    if n < 4 * k:
        return random.sample(items, k)
    # few from many: k draws with a rare redraw (random.sample costs several times more)
    draw = random.random
    picked = {int(draw() * n) for _ in range(k)}
    while len(picked) < k:
        picked.add(int(draw() * n))
    return [items[i] for i in picked]


def _scored(
    entries: Iterable[RouteEntry],
    latency: LatencyTracker,
    outstanding: Mapping[str, int],
    exclude: Container[str],
) -> list[tuple[float, RouteEntry]]:
    """The entries that can take a call with their scores, in the order given.

    Load is the larger of the instance's own in-flight count (from its last heartbeat,
    possibly stale) and the caller's own calls in flight to it (``outstanding``, always
    current), over its ``max_concurrency``. An instance whose latency this caller has not
    observed yet is scored with the best latency observed among the candidates (so a new
    instance gets tried and measured instead of starved), or as half the SLA if none is.
    """
    scored: list[tuple[float, RouteEntry]] = []
    unmeasured: list[int] = []
    best_known: float | None = None
    observed_of = latency._avg.get  # per candidate: a dict access, not a method call
    mine_of = outstanding.get
    # RouteEntry's fields by position: attribute access costs more, thousands of times
    for entry in entries:
        agent_id = entry[0]
        if entry[1] or agent_id in exclude:
            continue
        in_flight = entry[4]
        mine = mine_of(agent_id, 0)
        load = (in_flight if in_flight > mine else mine) * entry[5]
        score = entry[2] + W_LOAD * (1.0 - (0.0 if load < 0.0 else 1.0 if load > 1.0 else load))
        observed = observed_of(agent_id)
        if observed is None:
            unmeasured.append(len(scored))
        else:
            if best_known is None or observed < best_known:
                best_known = observed
            term = 1.0 - observed * entry[3]
            score += W_LATENCY * (0.0 if term < 0.0 else 1.0 if term > 1.0 else term)
        scored.append((score, entry))
    for n in unmeasured:
        score, entry = scored[n]
        term = (
            UNKNOWN_LATENCY_TERM
            if best_known is None
            else _latency_term(best_known * entry.per_sla_ms)
        )
        scored[n] = (score + W_LATENCY * term, entry)
    return scored


def _ranked(
    scored: list[tuple[float, RouteEntry]], rng: Callable[[], float]
) -> list[tuple[float, RouteEntry]]:
    """``scored`` best first; scores within ``TIE_BAND`` of the best in random order."""
    if len(scored) < 2:
        return scored
    # the index settles equal scores, so entries are never compared
    order = sorted(((score, n) for n, (score, _) in enumerate(scored)), reverse=True)
    floor = order[0][0] - TIE_BAND
    cut = next((i for i, (score, _) in enumerate(order) if score < floor), len(order))
    if cut > 1:
        ties = order[:cut]
        draws = [rng() for _ in ties]
        order[:cut] = [ties[i] for i in sorted(range(cut), key=draws.__getitem__)]
    return [scored[n] for _, n in order]


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
    scored = _scored(route_entries(instances, capability), latency, outstanding, exclude)
    return [(score, entry.instance) for score, entry in _ranked(scored, rng)]


def choose(
    entries: Sequence[RouteEntry],
    capability: str,
    *,
    latency: LatencyTracker,
    outstanding: Mapping[str, int],
    breakers: BreakerBoard,
    failed: Collection[str] = (),
    skipped: list[str] | None = None,
) -> tuple[Instance | None, float | None]:
    """The instance a call goes to, and its score (None: the only candidate, not ranked).

    ``entries`` are the capability's instances as routes to it (``RouteCache.entries``, or
    ``route_entries`` of a list of records); ``(None, None)`` when there are none (the
    capability's queue subject decides). Beyond ``RANK_ALL`` candidates a random
    ``RANK_SAMPLE`` are scored (the power of k choices); all of them if the sample has
    nobody to offer. The best one goes, or one picked at random among those within
    ``TIE_BAND`` of the best (see ``rank``). Instances in ``failed`` are tried only when
    nothing else is left. Instances passed over because their breaker is open are appended
    to ``skipped``. NoHealthyInstance if every known instance is unhealthy; CircuitOpen
    (saying when to try again) if every breaker is open.
    """
    if len(entries) == 1 and not failed:
        only = entries[0]
        if not only.unhealthy and breakers.get(only.agent_id).allow():
            return only.instance, None
    pool = sample(entries, RANK_SAMPLE) if len(entries) > RANK_ALL else entries
    scored = _scored(pool, latency, outstanding, failed)
    if not scored and pool is not entries:
        scored = _scored(entries, latency, outstanding, failed)
    if not scored and failed:
        scored = _scored(entries, latency, outstanding, ())
    if not scored:
        if not entries:
            return None, None
        why = ", ".join(
            f"{e.agent_id} {e.instance.status} ({e.instance.status_reason})" for e in entries[:5]
        )
        raise NoHealthyInstance(f"no healthy instance of {capability}: {why}")
    # the common case without a sort: one of the best, and its breaker lets it through
    floor = max(scored, key=_SCORE)[0] - TIE_BAND
    best = [item for item in scored if item[0] >= floor]
    score, entry = best[int(random.random() * len(best))] if len(best) > 1 else best[0]
    if breakers.get(entry.agent_id).allow():
        return entry.instance, score
    refused = entry
    if skipped is not None and refused.agent_id not in skipped:
        skipped.append(refused.agent_id)  # passed over, whoever serves the call instead
    for score, entry in _ranked(scored, random.random):
        if entry is refused:
            continue
        if breakers.get(entry.agent_id).allow():
            return entry.instance, score
        if skipped is not None and entry.agent_id not in skipped:
            skipped.append(entry.agent_id)
    targets = [entry.agent_id for _, entry in scored]
    retry_at = breakers.earliest_retry_at(targets)
    retry_in = max(0.0, retry_at - breakers.clock.monotonic())
    raise CircuitOpen(capability, retry_at, retry_in=retry_in)
