"""Route keys brought back in step with their instance records.

A registrar writes an instance record, then its route keys (``reach.registry.store``).
One that dies between the two leaves route keys missing, stale or orphaned: callers
following a capability would not see the instance, see an old version of it, or keep
one that left. Every registrar's registry watch sees both kinds of keys; it remembers a
hash of each record and of each route key, and an agent whose route keys disagree with
its record for ``ROUTE_REPAIR_AFTER_SEC`` (longer than the writes of one change take) has
them rewritten from the record as it is then, or deleted if the record is gone.

Only agents whose keys changed since the last check are checked, so a quiet registry
costs nothing. Several registrars may repair the same agent at once: they write the same
bytes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from reach.errors import ReachError
from reach.tasks import cancel_and_wait

if TYPE_CHECKING:  # pragma: no cover
    from reach.registry.store import RegistryStore

__all__ = ["ROUTE_REPAIR_AFTER_SEC", "RouteRepair"]

log = logging.getLogger("reach.registry")

#: seconds an agent's route keys may disagree with its record before they are rewritten
ROUTE_REPAIR_AFTER_SEC = 3.0


class RouteRepair:
    """What a registrar's watch saw of records and route keys, and their repair."""

    def __init__(
        self,
        store: RegistryStore,
        after: float = ROUTE_REPAIR_AFTER_SEC,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self.after = after
        self._clock = clock
        #: agent id → hash of its record's bytes, and its capabilities
        self._agents: dict[str, tuple[int, frozenset[str]]] = {}
        #: agent id → capability → hash of the route key's bytes
        self._routes: dict[str, dict[str, int]] = {}
        #: agents whose keys changed since the last check
        self._dirty: set[str] = set()
        #: agents out of step, since when
        self._suspect: dict[str, float] = {}
        self._synced = False
        self._checked_at = 0.0
        self._task: asyncio.Task[None] | None = None
        #: a check to come while agents are out of step (a quiet registry brings no tick)
        self._timer: asyncio.TimerHandle | None = None
        #: agents whose route keys were rewritten or deleted
        self.repaired = 0

    def agent_seen(self, agent_id: str, value: bytes | None, caps: frozenset[str] | None) -> None:
        """The record of ``agent_id`` is ``value`` serving ``caps`` (None: deleted)."""
        if value is None or caps is None:
            self._agents.pop(agent_id, None)
        else:
            self._agents[agent_id] = (hash(value), caps)
        self._dirty.add(agent_id)
        self.tick()

    def route_seen(self, key: str, value: bytes, deleted: bool) -> None:
        """The route key ``key`` (``cap.<capability>.<agent_id>``) holds ``value``."""
        capability, _, agent_id = key.partition(".")[2].partition(".")
        if not agent_id:
            return
        routes = self._routes.setdefault(agent_id, {})
        if deleted or not value:
            routes.pop(capability, None)
            if not routes:
                del self._routes[agent_id]
        else:
            routes[capability] = hash(value)
        self._dirty.add(agent_id)
        self.tick()

    def caught_up(self) -> None:
        self._synced = True
        self._dirty.update(self._agents)
        self._dirty.update(self._routes)
        self.tick()

    def out_of_step(self, agent_id: str) -> bool:
        routes = self._routes.get(agent_id, {})
        agent = self._agents.get(agent_id)
        if agent is None:
            return bool(routes)
        digest, caps = agent
        return routes.keys() != caps or any(h != digest for h in routes.values())

    def tick(self) -> None:
        """Check the agents that changed, at most twice per ``after``; repair those out of
        step for ``after``."""
        now = self._clock()
        if not self._synced or now - self._checked_at < self.after / 2:
            return
        self._checked_at = now
        dirty, self._dirty = self._dirty, set()
        for agent_id in dirty:
            if self.out_of_step(agent_id):
                self._suspect.setdefault(agent_id, now)
            else:
                self._suspect.pop(agent_id, None)
        self._dirty.update(self._suspect)  # checked again next time
        loop = asyncio.get_running_loop()
        if self._suspect and self._timer is None:
            self._timer = loop.call_later(self.after / 2, self._timed)
        if self._task is not None and not self._task.done():
            return
        due = [a for a, since in self._suspect.items() if now - since >= self.after]
        if due:
            for agent_id in due:
                del self._suspect[agent_id]
            self._task = loop.create_task(self._repair(due), name="route-repair")

    def _timed(self) -> None:
        self._timer = None
        self.tick()

    async def _repair(self, agent_ids: list[str]) -> None:
        for agent_id in agent_ids:
            present = tuple(self._routes.get(agent_id, {}))
            try:
                await self._store.repair_routes(agent_id, present)
            except ReachError as exc:
                log.warning("route keys of %s not repaired (%s)", agent_id, exc)
                continue
            except Exception:  # a bug here must not end the registrar's watch
                log.exception("route keys of %s not repaired", agent_id)
                continue
            self.repaired += 1
            log.info("route keys of %s repaired", agent_id)

    async def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._task is not None:
            await cancel_and_wait([self._task])
            self._task = None
