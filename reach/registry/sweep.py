"""The registrar's sweep: over the instances it owns, evict the silent, mark those that
missed heartbeats unhealthy, and probe those due a probe.

What happens to an instance is the health policy's decision (:mod:`reach.registry.health`);
this module does the I/O: compare-and-set writes that ask the policy again on the record
as it is at the write, and the probes, sent by :mod:`reach.registry.probes` (at most
``max_concurrent_probes`` at once). A probe's outcome is recorded as it arrives; only one
that changes the record costs a write (a task of its own).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable

from reach.errors import ReachError
from reach.registry.health import HealthPolicy
from reach.registry.instances import RecordView
from reach.registry.probes import ProbeDispatcher, ProbeResult
from reach.transport import Connection
from reach.wire.codec import Limits
from reach.wire.models import Instance

__all__ = ["Sweeper"]

log = logging.getLogger("reach.registrar")

#: the longest pause between two sweeps, and the shortest
MAX_TICK_SEC = 1.0
MIN_TICK_SEC = 0.02
#: a record's next due time is taken this much early (float rounding)
_MARGIN_SEC = 1e-6
_NEVER = float("inf")
#: what a review returns when it must await a write (an eviction or a mark): told
#: apart by identity, never by value
_LATER = float("-inf")


class Sweeper:
    """One registrar's passes over its records, and the probes they start."""

    def __init__(
        self,
        conn: Connection,
        *,
        view: RecordView,
        policy: HealthPolicy,
        limits: Limits,
        max_concurrent_probes: int,
        backlog: Callable[[], int],
        judged_since: Callable[[str], float | None],
        ownership_version: Callable[[], int] = lambda: 0,
    ) -> None:
        self._view = view
        self._policy = policy
        self.probes = ProbeDispatcher(
            conn,
            limits=limits,
            clock=policy.clock,
            record=self._record_probe,
            max_in_flight=max_concurrent_probes,
        )
        #: how many messages the registrar is handling now
        self._backlog = backlog
        #: since when this registrar hears an instance's heartbeats (None: not its own)
        self._judged_since = judged_since
        #: changes whenever ``judged_since`` may answer differently
        self._version = ownership_version
        #: agent id → (the record and its revision as the view held them, the ownership
        #: version, the time before which nothing is due about it, a quarter of its
        #: health interval)
        self._quiet: dict[str, tuple[tuple[Instance, int], int, float, float]] = {}
        #: agent ids with a probe in flight
        self._probing: set[str] = set()
        #: writes of probe outcomes that changed a record
        self.tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        await self.probes.start()

    async def stop(self) -> None:
        await self.probes.stop()
        self._probing.clear()

    async def sweep(self) -> float:
        """One pass over owned records; returns the pause until the next (a quarter of
        the shortest health interval, within bounds).

        A record is looked at only once something may be due about it: each keeps the
        time before which nothing can be (:meth:`HealthPolicy.next_review_at`,
        :meth:`HealthPolicy.next_probe_at`), valid while the record and the partitions
        this registrar hears are the same; heartbeats heard and trouble only move it
        later."""
        policy = self._policy
        now = policy.clock.time()
        tick = MAX_TICK_SEC
        policy.check_backlog(self._backlog(), now)
        version = self._version()
        quiet = self._quiet
        due: list[tuple[str, tuple[Instance, int]]] = []
        for agent_id, held in self._view.by_agent.items():  # nothing awaited in this loop
            entry = quiet.get(agent_id)
            if entry is not None and entry[0] is held and entry[1] == version:
                if entry[3] < tick:
                    tick = entry[3]
                if entry[2] > now:
                    continue
            due.append((agent_id, held))
        for agent_id, held in due:
            inst = held[0]
            quarter = inst.manifest.health.interval_sec / 4
            tick = min(tick, quarter)
            until = self._review(agent_id, inst, now)
            if until is _LATER:  # looked at again at the next sweep
                await self._act(agent_id, inst, now)
                until = None
            if until is None or agent_id not in self._view.by_agent:
                quiet.pop(agent_id, None)
            else:
                quiet[agent_id] = (held, version, until, quarter)
        return max(MIN_TICK_SEC, tick)

    def _review(self, agent_id: str, inst: Instance, now: float) -> float | None:
        """Probe ``inst`` if due; returns the time before which nothing is due about it
        (None: ask again at the next sweep), or ``_LATER`` when it is to be evicted or
        marked (:meth:`_act`, which awaits the write)."""
        policy = self._policy
        since = self._judged_since(agent_id)
        if since is None:  # not this registrar's: until the partitions it hears change
            return _NEVER
        review_at = policy.keep_until(inst, now, since)
        if review_at is None:
            return _LATER
        if agent_id in self._probing:
            return None  # its probe ends soon: due again then
        due, probe_at = policy.probe_plan(inst, now)
        if due:
            self._start_probe(inst, now)
        # computed in floats as the checks are: a hair early rather than late
        return min(review_at, probe_at) - _MARGIN_SEC

    async def _act(self, agent_id: str, inst: Instance, now: float) -> None:
        """Evict or mark ``inst`` (as :meth:`HealthPolicy.review` says), and probe it if
        due; the next sweep looks at it again."""
        policy = self._policy
        since = self._judged_since(agent_id)
        assert since is not None
        verdict = policy.review(inst, now, since)
        if verdict.action == "evict":
            # checked again on the record as it is now if it changed meanwhile (a
            # heartbeat written or heard since)
            still = functools.partial(
                _still_silent, policy, now=now, limit=verdict.limit, since=since
            )
            await self._view.remove(agent_id, inst.instance_id, verdict.reason, still)
            return
        if verdict.action == "unhealthy":
            mark = functools.partial(_missed, policy, reason=verdict.reason, now=now, since=since)
            await self._view.mutate(agent_id, mark)
        if agent_id not in self._probing and policy.probe_due(inst, now):
            self._start_probe(inst, now)

    def forget(self, agent_id: str) -> None:
        """The record is gone."""
        self._quiet.pop(agent_id, None)

    def _start_probe(self, inst: Instance, now: float) -> None:
        self._probing.add(inst.agent_id)
        self._policy.probe_started(inst.agent_id, now)
        self.probes.send(inst)

    def _record_probe(self, inst: Instance, result: ProbeResult) -> None:
        """The outcome of the probe of ``inst``: written if it changes the record."""
        agent_id = inst.agent_id
        self._probing.discard(agent_id)
        policy = self._policy
        current = self._view.by_agent.get(agent_id)
        if current is None:
            return
        now = policy.clock.time()
        # asked here first; the write (rare: most probes change nothing) asks again on
        # the record as it is then if it meets a conflict
        updated = policy.after_probe(current[0], inst.instance_id, result, now)
        if updated is None or updated is current[0]:
            return
        change = functools.partial(_probed, policy, inst.instance_id, result, now)
        write = self._view.write_of(agent_id, current, updated, change)
        task = asyncio.create_task(self._write(agent_id, write))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _write(self, agent_id: str, write: Callable[[], Awaitable[Instance | None]]) -> None:
        try:
            await write()
        except ReachError as exc:  # NATS busy or away: the next probe tries again
            log.warning("could not record the probe of %s: %s", agent_id, exc)
        except Exception:
            log.exception("recording the probe of %s failed", agent_id)


def _probed(
    policy: HealthPolicy, instance_id: str, result: ProbeResult, now: float, cur: Instance
) -> Instance | None:
    return policy.after_probe(cur, instance_id, result, now)


def _still_silent(
    policy: HealthPolicy, cur: Instance, *, now: float, limit: float, since: float
) -> bool:
    return policy.still_silent(cur, now, limit, since)


def _missed(
    policy: HealthPolicy, cur: Instance, *, reason: str, now: float, since: float
) -> Instance | None:
    return policy.missed_heartbeats(cur, reason, now, since)
