"""The registrar's sweep: over the instances it owns, evict the silent, mark those that
missed heartbeats unhealthy, and probe those due a probe.

What happens to an instance is the health policy's decision (:mod:`reach.registry.health`);
this module does the I/O: compare-and-set writes that ask the policy again on the record
as it is at the write, and the probes, each in a task of its own, at most
``max_concurrent_probes`` at once.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable

from reach.codec import Limits
from reach.errors import ReachError
from reach.models import Instance
from reach.registry.health import HealthPolicy
from reach.registry.probe import probe
from reach.registry.records import RecordView
from reach.transport import Connection

__all__ = ["Sweeper"]

log = logging.getLogger("reach.registrar")

#: the longest pause between two sweeps, and the shortest
MAX_TICK_SEC = 1.0
MIN_TICK_SEC = 0.02


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
    ) -> None:
        self._conn = conn
        self._view = view
        self._policy = policy
        self._limits = limits
        self._slots = asyncio.Semaphore(max_concurrent_probes)
        #: how many messages the registrar is handling now
        self._backlog = backlog
        #: since when this registrar hears an instance's heartbeats (None: not its own)
        self._judged_since = judged_since
        #: agent ids with a probe in flight
        self._probing: set[str] = set()
        self.tasks: set[asyncio.Task[None]] = set()

    async def sweep(self) -> float:
        """One pass over owned records; returns the pause until the next (a quarter of
        the shortest health interval, within bounds)."""
        policy = self._policy
        now = policy.clock.time()
        tick = MAX_TICK_SEC
        policy.check_backlog(self._backlog(), now)
        for agent_id, (inst, _) in list(self._view.by_agent.items()):
            tick = min(tick, inst.manifest.health.interval_sec / 4)
            since = self._judged_since(agent_id)
            if since is None:
                continue
            verdict = policy.review(inst, now, since)
            if verdict.action == "evict":
                # checked again on the record as it is now if it changed meanwhile (a
                # heartbeat written or heard since)
                still = functools.partial(
                    _still_silent, policy, now=now, limit=verdict.limit, since=since
                )
                await self._view.remove(agent_id, inst.instance_id, verdict.reason, still)
                continue
            if verdict.action == "unhealthy":
                mark = functools.partial(
                    _missed, policy, reason=verdict.reason, now=now, since=since
                )
                await self._view.mutate(agent_id, mark)
            if agent_id not in self._probing and policy.probe_due(inst, now):
                self._start_probe(inst, now)
        return max(MIN_TICK_SEC, tick)

    def _start_probe(self, inst: Instance, now: float) -> None:
        self._probing.add(inst.agent_id)
        self._policy.probe_started(inst.agent_id, now)
        task = asyncio.create_task(self._probe_and_record(inst))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _probe_and_record(self, inst: Instance) -> None:
        agent_id = inst.agent_id
        policy = self._policy
        try:
            async with self._slots:
                result = await probe(self._conn, inst, limits=self._limits, clock=policy.clock)
            now = policy.clock.time()
            await self._view.mutate(
                agent_id, lambda cur: policy.after_probe(cur, inst.instance_id, result, now)
            )
        except ReachError as exc:  # NATS busy or away: the next probe tries again
            log.warning("could not record the probe of %s: %s", agent_id, exc)
        except Exception:
            log.exception("probing %s failed", agent_id)
        finally:
            self._probing.discard(agent_id)


def _still_silent(
    policy: HealthPolicy, cur: Instance, *, now: float, limit: float, since: float
) -> bool:
    return policy.still_silent(cur, now, limit, since)


def _missed(
    policy: HealthPolicy, cur: Instance, *, reason: str, now: float, since: float
) -> Instance | None:
    return policy.missed_heartbeats(cur, reason, now, since)
