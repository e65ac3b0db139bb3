"""The caller's route cache: every registry record, kept current by a KV watch.

Lookups never touch the network. Indexes by capability and by tag are maintained as
records change, so a lookup costs a dictionary access plus filtering of the matches.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Sequence

from reach import subjects
from reach.errors import ReachError
from reach.models import Instance
from reach.registry.store import RegistryStore
from reach.routing import Peers, RouteEntry, route_entry, sample
from reach.tasks import cancel_and_wait

__all__ = ["NAMED_CANDIDATES", "RouteCache", "version_matches"]

log = logging.getLogger("reach.routecache")


#: candidates a call's audit event names (it counts them all); ``AuditEvent.candidates``
NAMED_CANDIDATES = 16


def version_matches(version: str, wanted: str | None) -> bool:
    """``None`` matches all; ``"2"`` or ``"2.3"`` match by prefix; ``"2.3.1"`` exactly."""
    if wanted is None:
        return True
    core = version.split("+", 1)[0]
    return core == wanted or core.split("-", 1)[0].startswith(wanted + ".")


class _Members:
    """The instances under one index key: a dict by agent id for lookups, and the same as
    a list of routes with each one's position, so a random sample is O(k) and a choice
    reads routes ready-made."""

    __slots__ = ("_names", "by_id", "entries", "pos")

    def __init__(self) -> None:
        self.by_id: dict[str, Instance] = {}
        self.entries: list[RouteEntry] = []
        self.pos: dict[str, int] = {}
        self._names: tuple[str, ...] | None = None

    def names(self) -> tuple[str, ...]:
        """The first ``NAMED_CANDIDATES`` agent ids of ``entries``, kept until they change."""
        if self._names is None:
            self._names = tuple(e.agent_id for e in self.entries[:NAMED_CANDIDATES])
        return self._names

    def add(self, entry: RouteEntry) -> None:
        self.by_id[entry.agent_id] = entry.instance
        at = self.pos.get(entry.agent_id)
        if at is not None:  # already here (a tag listed twice, news of it): same place
            self.entries[at] = entry
            return
        self.pos[entry.agent_id] = len(self.entries)
        self.entries.append(entry)
        self._names = None

    def remove(self, agent_id: str) -> bool:
        """Take ``agent_id`` out; True if nobody is left."""
        self.by_id.pop(agent_id, None)
        at = self.pos.pop(agent_id, None)
        if at is not None:
            self._names = None
            last = self.entries.pop()
            if at < len(self.entries):  # move the last one into the hole
                self.entries[at] = last
                self.pos[last.agent_id] = at
        return not self.entries


_NOBODY = _Members()


class RouteCache:
    """Instances by agent id, capability and tag, fed by a watch on REACH_REGISTRY."""

    def __init__(self, store: RegistryStore, peers: Peers | None = None) -> None:
        self._store = store
        #: the caller's view of each instance, which its routes point to (forgotten when
        #: the instance leaves the registry)
        self.peers = peers if peers is not None else Peers()
        self._instances: dict[str, tuple[Instance, int]] = {}
        self._by_capability: dict[str, _Members] = {}
        #: (capability, tag) → the instances whose capability carries the tag
        self._by_cap_tag: dict[tuple[str, str], _Members] = {}
        self._by_tag: dict[str, set[tuple[str, str]]] = {}
        self._synced = asyncio.Event()
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._listeners: list[Callable[[str, Instance | None], None]] = []
        #: monotonic time of the last change applied (route-cache freshness for ``doctor``)
        self.last_change_at = 0.0
        self.changes = 0

    async def start(self, timeout: float = 10.0) -> None:
        self._task = asyncio.create_task(self._run(), name="route-cache-watch")
        # (compiled by mypyc, an await inside an except block leaks the error it handles
        # into whatever runs next: here and below the waiting happens after the block)
        synced = False
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._synced.wait(), timeout)
            synced = True
        if not synced:
            await self.stop()
            raise TimeoutError(f"the registry watch did not catch up within {timeout:g}s")

    async def stop(self) -> None:
        self._stopping = True
        if self._task is not None:
            await cancel_and_wait([self._task])
            self._task = None

    @property
    def synced(self) -> bool:
        return self._synced.is_set()

    def on_change(self, listener: Callable[[str, Instance | None], None]) -> None:
        """Call ``listener(agent_id, instance or None)`` after each applied change."""
        self._listeners.append(listener)

    async def _run(self) -> None:
        while not self._stopping:
            try:
                async for change in self._store.watch():
                    if change is None:
                        self._synced.set()
                        continue
                    if not change.key.startswith(subjects.AGENT_KEY_PREFIX):
                        continue
                    self._apply(change.agent_id, change.instance, change.revision)
            except asyncio.CancelledError:
                raise
            except ReachError as exc:
                log.warning("registry watch failed (%s); restarting", exc)
            except Exception:  # a bug here must not leave the cache frozen for good
                log.exception("registry watch failed; restarting")
            await asyncio.sleep(0.5)

    def _apply(self, agent_id: str, instance: Instance | None, revision: int) -> None:
        current = self._instances.get(agent_id)
        if current is not None and current[1] >= revision:
            return
        if instance is None:
            if current is not None:
                self._unindex(current[0])
            self._instances.pop(agent_id, None)
            self.peers.forget(agent_id)  # a call still in flight to it keeps its own
        else:
            self._instances[agent_id] = (instance, revision)
            # a new version of a record (a heartbeat) takes its old routes' places: a call
            # in flight holds an index's list, which must not empty under it and move on
            self._index(instance)
            if current is not None:
                self._unindex(current[0], keep=instance)
        self.last_change_at = time.monotonic()
        self.changes += 1
        for listener in self._listeners:
            try:
                listener(agent_id, instance)
            except Exception:  # the user's: it must not stop the cache
                log.exception("route cache listener %r failed", listener)
        # wake every waiter once: they hold the old event, later waiters get a new one
        self._changed.set()
        self._changed = asyncio.Event()

    def _index(self, inst: Instance) -> None:
        peer = self.peers.peer(inst.agent_id)
        for cap in inst.manifest.capabilities:
            # gathered now, as the record arrives, not on a call
            entry = route_entry(inst, cap.name, peer)
            if entry is None:  # pragma: no cover - every capability has its SLA
                continue
            self._by_capability.setdefault(cap.name, _Members()).add(entry)
            for tag in cap.tags:
                self._by_cap_tag.setdefault((cap.name, tag), _Members()).add(entry)
                self._by_tag.setdefault(tag, set()).add((inst.agent_id, cap.name))

    def _unindex(self, inst: Instance, keep: Instance | None = None) -> None:
        """Take ``inst`` out of the indexes, except where ``keep`` (its new version,
        already indexed) offers the same capability and tag."""
        agent_id = inst.agent_id
        kept: set[tuple[str, str | None]] = set()
        if keep is not None:
            for cap in keep.manifest.capabilities:
                kept.add((cap.name, None))
                kept.update((cap.name, tag) for tag in cap.tags)
        for cap in inst.manifest.capabilities:
            members = self._by_capability.get(cap.name)
            if (cap.name, None) not in kept and members is not None and members.remove(agent_id):
                del self._by_capability[cap.name]
            for tag in cap.tags:
                key = (cap.name, tag)
                if key in kept:
                    continue
                members = self._by_cap_tag.get(key)
                if members is not None and members.remove(agent_id):
                    del self._by_cap_tag[key]
                tagged = self._by_tag.get(tag)
                if tagged is not None:
                    tagged.discard((agent_id, cap.name))
                    if not tagged:
                        del self._by_tag[tag]

    def get(self, agent_id: str) -> Instance | None:
        found = self._instances.get(agent_id)
        return found[0] if found else None

    def all(self) -> list[Instance]:
        return [inst for inst, _ in self._instances.values()]

    def sample(self, capability: str, k: int, tags: Iterable[str] = ()) -> list[Instance]:
        """Up to ``k`` instances of a capability (carrying all ``tags``) picked at random
        (all if there are fewer)."""
        return [entry.instance for entry in sample(self.entries(capability, tags), k)]

    def for_capability(self, capability: str, tags: Iterable[str] = ()) -> Iterable[Instance]:
        """Every known instance of a capability whose entry carries all ``tags``, healthy
        or not (a dictionary access for no tag or one, a walk of the smallest tag's
        members for more)."""
        wanted = tuple(tags)
        if len(wanted) <= 1:
            return self._members(capability, wanted).by_id.values()
        return [entry.instance for entry in self.entries(capability, wanted)]

    def entries(self, capability: str, tags: Iterable[str] = ()) -> Sequence[RouteEntry]:
        """``for_capability`` as routes to the capability, ready for ``reach.routing.choose``
        (the routing hot path: the index's own list for no tag or one; do not change it)."""
        wanted = tuple(tags)
        if len(wanted) <= 1:
            return self._members(capability, wanted).entries
        sets = sorted(
            (self._members(capability, (t,)) for t in wanted), key=lambda m: len(m.entries)
        )
        rest = [m.by_id for m in sets[1:]]
        return [e for e in sets[0].entries if all(e.agent_id in m for m in rest)]

    def first_names(
        self, capability: str, tags: tuple[str, ...], candidates: Sequence[RouteEntry]
    ) -> tuple[str, ...]:
        """The agent ids of the first ``NAMED_CANDIDATES`` of ``candidates``, which
        ``entries(capability, tags)`` returned (kept with the index: no walk per call)."""
        if len(tags) <= 1:
            members = self._members(capability, tags)
            if members.entries is candidates:
                return members.names()
        return tuple(e.agent_id for e in candidates[:NAMED_CANDIDATES])

    def _members(self, capability: str, tags: tuple[str, ...]) -> _Members:
        if tags:
            return self._by_cap_tag.get((capability, tags[0]), _NOBODY)
        return self._by_capability.get(capability, _NOBODY)

    def capabilities(self) -> list[str]:
        """The capabilities some registered instance offers, sorted."""
        return sorted(name for name, members in self._by_capability.items() if members.entries)

    def find(
        self,
        capability: str | None = None,
        tags: Iterable[str] = (),
        version: str | None = None,
        include_unhealthy: bool = False,
    ) -> list[Instance]:
        """Instances offering ``capability`` (if given) with a capability carrying all ``tags``."""
        wanted = list(tags)
        if wanted and capability is not None:
            candidates = list(self.for_capability(capability, wanted))
        elif wanted:
            pairs = set.intersection(*[self._by_tag.get(t, set()) for t in wanted])
            ids = {agent_id for agent_id, _ in pairs}
            candidates = [self._instances[i][0] for i in ids if i in self._instances]
        elif capability is not None:
            candidates = list(self.for_capability(capability))
        else:
            candidates = self.all()
        return sorted(
            (
                inst
                for inst in candidates
                if (include_unhealthy or inst.status != "unhealthy")
                and version_matches(inst.manifest.version, version)
            ),
            key=lambda inst: inst.agent_id,
        )

    async def wait_for(
        self, predicate: Callable[[RouteCache], object], timeout: float = 10.0
    ) -> None:
        """Wait until ``predicate(cache)`` is true (any truthy value, a list of instances
        say); TimeoutError after ``timeout`` seconds."""
        async with asyncio.timeout(timeout):
            while not predicate(self):
                await self._changed.wait()
