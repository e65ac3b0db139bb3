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

from reach.codec import Limits
from reach.errors import ReachError
from reach.models import Instance
from reach.registry.health import HealthPolicy
from reach.registry.probe import ProbeResult
from reach.registry.probes import ProbeDispatcher
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
        self.probes.send(inst)

    def _record_probe(self, inst: Instance, result: ProbeResult) -> None:
        """The outcome of the probe of ``inst``: written if it changes the record."""
        agent_id = inst.agent_id
        self._probing.discard(agent_id)
        policy = self._policy
        now = policy.clock.time()
        write = self._view.change_now(
            agent_id, functools.partial(_probed, policy, inst.instance_id, result, now)
        )
        if write is not None:
            task = asyncio.create_task(self._write(agent_id, write))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _write(self, agent_id: str, write: Awaitable[Instance | None]) -> None:
        try:
            await write
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
