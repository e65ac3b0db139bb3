"""A registrar's view of the instance records, and its compare-and-set writes to them.

The view is kept by the registrar's registry watch (:mod:`reach.registry.watch`) and by
its own writes; every write is a compare-and-set on the revision of the view, so several
registrars can write at once and none overwrites a record it has not seen. A conflict
re-reads the record and asks the change again.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from reach.registry.store import RegistryStore
from reach.transport import KVConflict
from reach.wire.models import Instance

__all__ = ["CAS_ATTEMPTS", "RecordView"]

log = logging.getLogger("reach.registrar")

#: compare-and-set attempts of one change before it is given up
CAS_ATTEMPTS = 8


class RecordView:
    """Instance records by agent id, each with the revision it was seen at."""

    def __init__(self, on_gone: Callable[[str], None] = lambda agent_id: None) -> None:
        #: agent id → (record, revision)
        self.by_agent: dict[str, tuple[Instance, int]] = {}
        self._store: RegistryStore | None = None
        #: told the agent id of a record that was deleted
        self._on_gone = on_gone

    def attach(self, store: RegistryStore) -> None:
        self._store = store

    @property
    def attached(self) -> bool:
        return self._store is not None

    @property
    def store(self) -> RegistryStore:
        if self._store is None:
            raise RuntimeError("start the registrar first")
        return self._store

    def get(self, agent_id: str) -> tuple[Instance, int] | None:
        return self.by_agent.get(agent_id)

    def instances(self) -> list[Instance]:
        return [inst for inst, _ in self.by_agent.values()]

    def remember(self, inst: Instance, revision: int) -> None:
        """Take ``inst`` at ``revision`` unless the view holds a newer one."""
        current = self.by_agent.get(inst.agent_id)
        if current is None or current[1] < revision:
            self.by_agent[inst.agent_id] = (inst, revision)

    def forget(self, agent_id: str, revision: int) -> None:
        """The record was deleted at ``revision``: dropped unless the view's is newer."""
        current = self.by_agent.get(agent_id)
        if current is not None and current[1] < revision:
            del self.by_agent[agent_id]
            self._on_gone(agent_id)

    async def reload(self, agent_id: str) -> None:
        """Read the record again (after a conflict: someone else wrote it)."""
        fresh = await self.store.get(agent_id)
        if fresh is None:
            self.by_agent.pop(agent_id, None)
        else:
            self.remember(*fresh)

    async def mutate(
        self, agent_id: str, change: Callable[[Instance], Instance | None]
    ) -> Instance | None:
        """Apply ``change`` to the record with compare-and-set, re-reading on conflict.

        ``change`` returning None or its argument writes nothing. Returns the record as
        written (or as it was, if nothing was written); None if there is none, or the
        change was given up after ``CAS_ATTEMPTS`` conflicts."""
        for _ in range(CAS_ATTEMPTS):
            current = self.by_agent.get(agent_id)
            if current is None:
                return None
            inst, rev = current
            updated = change(inst)
            if updated is None or updated is inst:
                return inst
            try:
                self.remember(updated, await self.store.update(updated, rev))
                return updated
            except KVConflict:
                await self.reload(agent_id)
        log.warning("gave up updating %s after %d conflicts", agent_id, CAS_ATTEMPTS)
        return None

    def change_now(
        self, agent_id: str, change: Callable[[Instance], Instance | None]
    ) -> Callable[[], Coroutine[Any, Any, Instance | None]] | None:
        """:meth:`mutate` without a coroutine when there is nothing to write: ``change``
        is asked on the view's record now, and None returned if it writes nothing (or
        there is no record); else the write, to be called and awaited in the task that
        makes it (a coroutine made outside a task that is cancelled before it starts
        would never be awaited), starting with the record ``change`` just gave (not
        asked twice unless a conflict makes it)."""
        current = self.by_agent.get(agent_id)
        if current is None:
            return None
        updated = change(current[0])
        if updated is None or updated is current[0]:
            return None
        return self.write_of(agent_id, current, updated, change)

    def write_of(
        self,
        agent_id: str,
        current: tuple[Instance, int],
        updated: Instance,
        change: Callable[[Instance], Instance | None],
    ) -> Callable[[], Coroutine[Any, Any, Instance | None]]:
        """The write :meth:`change_now` gives when the caller asked ``change`` itself on
        ``current`` (the view's entry now) and got ``updated``, a change: the caller
        makes and binds ``change`` only for a write."""
        return functools.partial(self._write_then_mutate, agent_id, updated, current[1], change)

    async def _write_then_mutate(
        self,
        agent_id: str,
        updated: Instance,
        revision: int,
        change: Callable[[Instance], Instance | None],
    ) -> Instance | None:
        try:
            self.remember(updated, await self.store.update(updated, revision))
            return updated
        except KVConflict:
            await self.reload(agent_id)
        return await self.mutate(agent_id, change)

    async def remove(
        self,
        agent_id: str,
        instance_id: str | None,
        reason: str,
        still: Callable[[Instance], bool] | None = None,
    ) -> bool:
        """Delete the record (of ``instance_id`` if given) with compare-and-set; after a
        conflict the fresh record is checked again, and kept unless ``still(record)``."""
        for _ in range(CAS_ATTEMPTS):
            current = self.by_agent.get(agent_id)
            if current is None or (instance_id and current[0].instance_id != instance_id):
                return False
            if still is not None and not still(current[0]):
                return False
            try:
                await self.store.delete(agent_id, last=current[1])
            except KVConflict:
                await self.reload(agent_id)
                continue
            self.by_agent.pop(agent_id, None)
            self._on_gone(agent_id)
            log.info("removed %s: %s", agent_id, reason)
            return True
        return False
