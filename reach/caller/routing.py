"""Scored instance choice (docs/architecture.md, "Routing score").

::

    score = 0.4·health + 0.3·max(0, 1 − avg_latency/latency_sla)
          + 0.2·(1 − load/max_load) + 0.1·(1.0 if stable else 0.7)

Pure functions over registry records plus the caller's own observations (latency EWMA, its
calls in flight); cheap enough to run on every call.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Final, TypeVar, final

from reach.caller.peers import LATENCY_STALE_SEC, Peer, Peers
from reach.errors import CircuitOpen, NoHealthyInstance
from reach.resilience import BreakerBoard
from reach.wire.models import Capability, HealthStatus, Instance

__all__ = [
    "APERTURE",
    "APERTURE_ABOVE",
    "APERTURE_TURN",
    "HEALTH_SCORES",
    "LATENCY_STALE_SEC",
    "RANK_ALL",
    "RANK_SAMPLE",
    "Aperture",
    "Peer",
    "Peers",
    "RouteEntry",
    "choose",
    "rank",
    "route_entries",
    "route_entry",
    "route_load",
    "sample",
    "score_instance",
]

_T = TypeVar("_T")

#: up to this many candidates are all ranked; beyond, a random sample of RANK_SAMPLE is
#: (scoring costs the same for every candidate: thousands of instances of one capability
#: would cost every call more than the rest of it)
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


@final
class RouteEntry:
    """One instance as a route to one capability: what a choice reads of it, gathered once
    per registry record (the route cache builds it as the record arrives), never per call.

    Among thousands of instances each candidate is a CPU cache miss, so a choice touches
    this one object (compiled, its numbers sit in it) and the instance's :class:`Peer`,
    not the record's objects nor a dictionary per candidate."""

    __slots__ = (
        "agent_id",
        "base",
        "in_flight",
        "instance",
        "peer",
        "per_sla_ms",
        "per_slot",
        "spec",
        "unhealthy",
    )

    def __init__(
        self,
        agent_id: str,
        unhealthy: bool,
        base: float,
        per_sla_ms: float,
        in_flight: int,
        per_slot: float,
        instance: Instance,
        spec: Capability,
        peer: Peer,
    ) -> None:
        self.agent_id = agent_id
        self.unhealthy = unhealthy
        #: the terms of the score a call does not change: W_HEALTH·health + W_STABLE·stable
        self.base = base
        #: 1 / the capability's latency_sla_ms
        self.per_sla_ms = per_sla_ms
        #: in-flight calls at the instance's last heartbeat
        self.in_flight = in_flight
        #: 1 / the instance's max_concurrency
        self.per_slot = per_slot
        self.instance = instance
        #: the capability as the instance declares it (its contract and SLA)
        self.spec = spec
        #: the caller's view of the instance (its latency, its calls in flight)
        self.peer = peer

    def __repr__(self) -> str:
        return f"RouteEntry({self.agent_id!r}, {self.spec.name!r})"


def route_entry(instance: Instance, capability: str, peer: Peer) -> RouteEntry | None:
    """``instance`` as a route to ``capability``; None if it does not offer it."""
    facts = instance.routing_facts
    spec = instance.manifest.capability(capability)
    if spec is None:
        return None
    return RouteEntry(
        facts.agent_id,
        facts.status == "unhealthy",
        _base(facts.status, facts.stable),
        1.0 / facts.sla_ms[capability],
        facts.in_flight,
        1.0 / (facts.max_concurrency or 1),
        instance,
        spec,
        peer,
    )


def route_entries(instances: Iterable[Instance], capability: str, peers: Peers) -> list[RouteEntry]:
    """The instances that offer ``capability``, as routes to it (for lists of records that
    do not come from a route cache, which keeps them ready)."""
    out: list[RouteEntry] = []
    for inst in instances:
        entry = route_entry(inst, capability, peers.peer(inst.agent_id))
        if entry is not None:
            out.append(entry)
    return out


def route_load(entry: RouteEntry) -> float:
    """The share of the instance's ``max_concurrency`` in use: the larger of its in-flight
    count at its last heartbeat (possibly stale) and this caller's own calls in flight to
    it (always current). Not clamped: above 1 it is full."""
    in_flight = entry.in_flight
    mine = entry.peer.outstanding
    return (in_flight if in_flight > mine else mine) * entry.per_slot


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


#: above this many candidates a caller routes among a working set of them, its aperture
APERTURE_ABOVE: Final = 1024
#: the aperture's members while the instances it picks have room (it widens past this
#: while they are full)
APERTURE: Final = 256
#: one member of an aperture is swapped for a random instance every this many choices
APERTURE_TURN: Final = 8


@final
class Aperture:
    """A caller's working set among a capability's many instances: client-side subsetting,
    as load balancers for very large services do it (Finagle's aperture, Google's
    subsetting).

    Above ``APERTURE_ABOVE`` candidates a choice samples ``RANK_SAMPLE`` of this caller's
    members instead of any of the candidates. A few hundred routes and the caller's views
    of them stay in the processor's caches, where a sample among a hundred thousand
    records would read eight of them from main memory on every call; and each member is
    called often enough for this caller's latency average of it to stay fresh. Every
    caller draws its own members at random, so across callers each instance gets its
    share.

    The set turns over: one member is swapped for a random instance every
    ``APERTURE_TURN`` choices, and at once when it is sampled unhealthy or gone. It widens
    by one member whenever the instance chosen is already at its ``max_concurrency`` (this
    caller needs more instances than it has) and narrows back by one per turn while the
    chosen one is below half of it. Members are positions in the capability's list of
    routes: a route keeps its place while its record changes, and one moved into the hole
    another left is as random a member as the one that left.
    """

    __slots__ = ("_idle", "_slots", "_turn", "base")

    def __init__(self, base: int = APERTURE) -> None:
        self.base = base
        self._slots: list[int] = []
        self._turn = 0
        self._idle = False

    def __len__(self) -> int:
        return len(self._slots)

    def pool(self, entries: Sequence[RouteEntry], k: int = RANK_SAMPLE) -> list[RouteEntry]:
        """``k`` members, as routes (fewer if the aperture has fewer); the first call
        draws the members."""
        n = len(entries)
        slots = self._slots
        if not n:
            return []
        if not slots:
            slots.extend(random.sample(range(n), min(self.base, n)))
        draw = random.random
        m = len(slots)
        want = k if k < m else m
        taken: set[int] = set()
        out: list[RouteEntry] = []
        while len(out) < want:
            s = int(draw() * m)
            if s in taken:
                continue
            taken.add(s)
            at = slots[s]
            if at >= n or entries[at].unhealthy:
                at = slots[s] = int(draw() * n)
            out.append(entries[at])
        self._turn += 1
        if self._turn >= APERTURE_TURN:
            self._turn = 0
            s = int(draw() * len(slots))
            if self._idle and len(slots) > self.base:
                slots[s] = slots[-1]
                slots.pop()
            else:
                slots[s] = int(draw() * n)
        return out

    def chose(self, entry: RouteEntry, n: int) -> None:
        """The choice among ``n`` candidates went to ``entry``: widen if it is full."""
        load = route_load(entry)
        self._idle = load < 0.5
        if load >= 1.0 and len(self._slots) < n:
            self._slots.append(int(random.random() * n))


def _score_into(
    entries: Sequence[RouteEntry],
    exclude: Collection[str],
    routes: list[RouteEntry],
    scores: list[float],
    fresh_after: float,
    now: float,
) -> None:
    """The entries that can take a call, appended to ``routes`` in the order given, with
    their scores at the same places in ``scores``: neither unhealthy, nor in ``exclude``,
    nor ejected by this caller's outlier detection at monotonic time ``now`` (``math.inf``:
    ejected ones too).

    Load is the larger of the instance's own in-flight count (from its last heartbeat,
    possibly stale) and the caller's own calls in flight to it (its peer's, always
    current), over its ``max_concurrency``. An instance whose latency this caller has not
    observed yet is scored with the best latency observed among the candidates (so a new
    instance gets tried and measured instead of starved), or as half the SLA if none is.
    So is one whose average was last observed before ``fresh_after`` (monotonic) while
    another candidate's was observed since, unless a call of this caller is in flight to
    it (see ``LATENCY_STALE_SEC``).
    """
    unmeasured: list[int] = []
    stale: list[int] = []
    best_known = -1.0  # the lowest latency observed recently among them; < 0: none
    excluding = len(exclude) > 0
    for entry in entries:
        if entry.unhealthy or (excluding and entry.agent_id in exclude):
            continue
        peer = entry.peer
        if peer.outlier.until > now:
            continue
        mine = peer.outstanding
        load = route_load(entry)
        score = entry.base + W_LOAD * (1.0 - (0.0 if load < 0.0 else 1.0 if load > 1.0 else load))
        if not peer.measured:
            unmeasured.append(len(routes))
        elif peer.seen >= fresh_after or mine:
            observed = peer.latency_ms
            if best_known < 0.0 or observed < best_known:
                best_known = observed
            term = 1.0 - observed * entry.per_sla_ms
            score += W_LATENCY * (0.0 if term < 0.0 else 1.0 if term > 1.0 else term)
        else:
            stale.append(len(routes))
        routes.append(entry)
        scores.append(score)
    if stale:
        if best_known < 0.0:
            # nobody measured recently (a quiet caller): the old averages are all it has
            for n in stale:
                observed = routes[n].peer.latency_ms
                if best_known < 0.0 or observed < best_known:
                    best_known = observed
                scores[n] += W_LATENCY * _latency_term(observed * routes[n].per_sla_ms)
        else:
            unmeasured.extend(stale)
    for n in unmeasured:
        term = (
            UNKNOWN_LATENCY_TERM
            if best_known < 0.0
            else _latency_term(best_known * routes[n].per_sla_ms)
        )
        scores[n] += W_LATENCY * term


def _ranked(
    routes: list[RouteEntry], scores: list[float], rng: Callable[[], float]
) -> list[tuple[float, RouteEntry]]:
    """The routes with their scores, best first; scores within ``TIE_BAND`` of the best in
    random order."""
    if len(routes) < 2:
        return list(zip(scores, routes, strict=True))
    # the index settles equal scores, so entries are never compared
    order = sorted(((score, n) for n, score in enumerate(scores)), reverse=True)
    floor = order[0][0] - TIE_BAND
    cut = next((i for i, (score, _) in enumerate(order) if score < floor), len(order))
    if cut > 1:
        ties = order[:cut]
        draws = [rng() for _ in ties]
        order[:cut] = [ties[i] for i in sorted(range(cut), key=draws.__getitem__)]
    return [(score, routes[n]) for score, n in order]


def rank(
    instances: Iterable[Instance],
    capability: str,
    *,
    peers: Peers,
    exclude: Collection[str] = (),
    rng: Callable[[], float] = random.random,
) -> list[tuple[float, Instance]]:
    """Instances that can take a call to ``capability``, best first, with their scores.

    Healthy and degraded instances that offer the capability and are not in ``exclude``
    (e.g. the instances a retry already tried); never unhealthy ones. Load is the larger of
    the instance's own in-flight count (from its last heartbeat, possibly stale) and the
    caller's own calls in flight to it (its peer's ``outstanding``, always current), over
    its ``max_concurrency``.

    Scores within ``TIE_BAND`` of the best are treated as equal and ordered randomly
    (``rng``, one draw per instance): when instances are about equally good, always
    picking the marginally best one would put all traffic on one instance and leave the
    others idle (and unmeasured). The band is narrower than the pre-release penalty, so a
    stable version still wins over an otherwise equal pre-release one.

    An instance whose latency this caller has not observed yet (``peers``) is scored with
    the best latency observed among the candidates, so a new instance gets tried and
    measured instead of starved; so is one whose average is stale (``LATENCY_STALE_SEC``).
    Instances this caller's outlier detection ejected are left out while others remain.
    """
    routes: list[RouteEntry] = []
    scores: list[float] = []
    now = peers.clock.monotonic()
    entries = route_entries(instances, capability, peers)
    _score_into(entries, exclude, routes, scores, now - LATENCY_STALE_SEC, now)
    if not routes:  # every one left is ejected: they take calls rather than nobody
        _score_into(entries, exclude, routes, scores, now - LATENCY_STALE_SEC, math.inf)
    return [(score, entry.instance) for score, entry in _ranked(routes, scores, rng)]


def _pool(
    entries: Sequence[RouteEntry], aperture: Aperture | None
) -> tuple[Sequence[RouteEntry], Aperture | None]:
    """The candidates a choice scores first, and the aperture they came from (None if
    they did not)."""
    count = len(entries)
    if aperture is not None and count > APERTURE_ABOVE:
        return aperture.pool(entries), aperture
    return (sample(entries, RANK_SAMPLE) if count > RANK_ALL else entries), None


def choose(
    entries: Sequence[RouteEntry],
    capability: str,
    *,
    breakers: BreakerBoard,
    failed: Collection[str] = (),
    skipped: list[str] | None = None,
    aperture: Aperture | None = None,
) -> tuple[RouteEntry | None, float | None]:
    """The route a call takes, and its score (None: the only candidate, not ranked).

    ``entries`` are the capability's instances as routes to it (``RouteCache.entries``, or
    ``route_entries`` of a list of records); ``(None, None)`` when there are none (the
    capability's queue subject decides). Beyond ``RANK_ALL`` candidates a random
    ``RANK_SAMPLE`` are scored (the power of k choices), beyond ``APERTURE_ABOVE`` sampled
    among the members of this caller's ``aperture`` if it is given; all of them if the
    sample has nobody to offer. The best one goes, or one picked at random among those within
    ``TIE_BAND`` of the best (see ``rank``). Instances in ``failed`` are tried only when
    nothing else is left, and those this caller's outlier detection ejected
    (``reach.resilience.outliers``) only when not even they are. Instances passed over
    because their breaker is open are appended to ``skipped``. NoHealthyInstance if every
    known instance is unhealthy; CircuitOpen (saying when to try again) if every breaker is
    open.
    """
    if len(entries) == 1 and not failed:
        only = entries[0]
        if not only.unhealthy and breakers.get(only.agent_id).allow():
            return only, None
    pool, aperture = _pool(entries, aperture)
    routes: list[RouteEntry] = []
    scores: list[float] = []
    now = breakers.clock.monotonic()
    fresh_after = now - LATENCY_STALE_SEC
    _score_into(pool, failed, routes, scores, fresh_after, now)
    if not routes and pool is not entries:
        _score_into(entries, failed, routes, scores, fresh_after, now)
    if not routes and failed:
        _score_into(entries, (), routes, scores, fresh_after, now)
    if not routes:  # every one left is ejected: they take calls rather than nobody
        _score_into(entries, (), routes, scores, fresh_after, math.inf)
    if not routes:
        if not entries:
            return None, None
        why = ", ".join(
            f"{e.agent_id} {e.instance.status} ({e.instance.status_reason})" for e in entries[:5]
        )
        raise NoHealthyInstance(f"no healthy instance of {capability}: {why}")
    # the common case without a sort: one of the best, and its breaker lets it through
    n = len(routes)
    pick = 0
    if n > 1:
        top = scores[0]
        for i in range(1, n):
            if scores[i] > top:
                top = scores[i]
        floor = top - TIE_BAND
        band = [i for i in range(n) if scores[i] >= floor]
        pick = band[int(random.random() * len(band))] if len(band) > 1 else band[0]
    entry = routes[pick]
    if aperture is not None:
        aperture.chose(entry, len(entries))
    if breakers.get(entry.agent_id).allow():
        return entry, scores[pick]
    refused = entry
    if skipped is not None and refused.agent_id not in skipped:
        skipped.append(refused.agent_id)  # passed over, whoever serves the call instead
    for score, entry in _ranked(routes, scores, random.random):
        if entry is refused:
            continue
        if breakers.get(entry.agent_id).allow():
            return entry, score
        if skipped is not None and entry.agent_id not in skipped:
            skipped.append(entry.agent_id)
    targets = [entry.agent_id for entry in routes]
    retry_at = breakers.earliest_retry_at(targets)
    retry_in = max(0.0, retry_at - breakers.clock.monotonic())
    raise CircuitOpen(capability, retry_at, retry_in=retry_in)
