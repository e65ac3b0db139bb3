"""The caller's route cache: the registry records it uses, kept current by KV watches.

Lookups never touch the network. Indexes by capability and by tag are maintained as
records change, so a lookup costs a dictionary access plus filtering of the matches.

A cache follows either the whole registry (``follow_all``: every ``agent.`` record, what
tools and gateways that list the fabric need) or only the capabilities it is asked
about: the route keys ``cap.<capability>.>`` of each (``reach.registry.store``), from
the first call, ``follow`` or lookup of that capability on. Record traffic of other
capabilities never reaches it, so its cost grows with the capabilities it uses, not
with the fabric. A lookup of the whole registry (``get``, ``all``, ``find`` without a
capability) switches such a cache to following the whole registry, for good.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import TypeVar

from reach.caller.routing import Aperture, Peer, Peers, RouteEntry, route_entry, sample
from reach.errors import ReachError
from reach.registry.store import RecordChange, RegistryStore, RouteChange
from reach.runtime import settle_after_load
from reach.tasks import cancel_and_wait
from reach.wire import subjects
from reach.wire.models import Instance

__all__ = ["MAX_FOLLOWED", "NAMED_CANDIDATES", "RouteCache", "version_matches"]

#: candidates a call's audit event names (it counts them all); ``AuditEvent.candidates``
NAMED_CANDIDATES = 16


def version_matches(version: str, wanted: str | None) -> bool:
    """``None`` matches all; ``"2"`` or ``"2.3"`` match by prefix; ``"2.3.1"`` exactly."""
    if wanted is None:
        return True
    core = version.split("+", 1)[0]
    return core == wanted or core.split("-", 1)[0].startswith(wanted + ".")


class Members:
    """The instances under one index key: a dict by agent id for lookups, and the same as
    a list of routes with each one's position, so a random sample is O(k) and a choice
    reads routes ready-made; and the caller's aperture among them (used when they are
    many: ``reach.caller.routing.Aperture``)."""

    __slots__ = ("_names", "aperture", "by_id", "entries", "pos")

    def __init__(self) -> None:
        self.by_id: dict[str, Instance] = {}
        self.entries: list[RouteEntry] = []
        self.pos: dict[str, int] = {}
        self._names: tuple[str, ...] | None = None
        self.aperture = Aperture()

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


#: the members of an index key nobody is under
NOBODY = Members()


log = logging.getLogger("reach.routecache")

_C = TypeVar("_C", RecordChange, RouteChange)


#: capabilities a cache follows at most (each is a subscription and a task); past it, the
#: one used least recently is dropped (followed again, one round trip, when used again).
#: A caller that uses more should follow the whole registry.
MAX_FOLLOWED = 1024
#: seconds the capabilities' names read from the registry are reused
NAMES_FRESH_SEC = 10.0
#: a revision above every real one: what drops a route whatever its revision
_GONE = 1 << 62


class _Follow:
    """The following of one capability's route keys: its task, and whether it caught up."""

    __slots__ = ("synced", "task")

    def __init__(self) -> None:
        self.synced = asyncio.Event()
        self.task: asyncio.Task[None] | None = None


class RouteCache:
    """Instances by agent id, capability and tag, fed by watches on REACH_REGISTRY."""

    def __init__(
        self, store: RegistryStore, peers: Peers | None = None, *, follow_all: bool = True
    ) -> None:
        self._store = store
        #: the caller's view of each instance, which its routes point to (forgotten when
        #: the instance leaves the registry)
        self.peers = peers if peers is not None else Peers()
        self._instances: dict[str, tuple[Instance, int]] = {}
        #: agent id → capability → (revision, tags) of the route indexed for it
        self._held: dict[str, dict[str, tuple[int, tuple[str, ...]]]] = {}
        self._by_capability: dict[str, Members] = {}
        #: (capability, tag) → the instances whose capability carries the tag
        self._by_cap_tag: dict[tuple[str, str], Members] = {}
        self._by_tag: dict[str, set[tuple[str, str]]] = {}
        #: whether the whole registry is followed (else only ``_follows``)
        self.follow_all = follow_all
        self._follows: OrderedDict[str, _Follow] = OrderedDict()
        self.max_followed = MAX_FOLLOWED
        self._synced = asyncio.Event()
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._started = False
        self._stopping = False
        self._listeners: list[Callable[[str, Instance | None], None]] = []
        #: monotonic time of the last change applied (route-cache freshness for ``doctor``)
        self.last_change_at = 0.0
        self.changes = 0
        #: records received from the registry (each one decoded)
        self.records = 0
        #: when the capabilities' names were read, and what they were
        self._names: tuple[float, list[str]] | None = None

    async def start(self, timeout: float = 10.0) -> None:
        """Follow the whole registry and wait until caught up (``follow_all``), or be
        ready to follow capabilities as they are used."""
        self._started = True
        if not self.follow_all:
            self._synced.set()
            return
        # (compiled by mypyc, an await inside an except block leaks the error it handles
        # into whatever runs next: here and below the waiting happens after the block)
        synced = False
        with contextlib.suppress(TimeoutError):
            await self._start_all(timeout)
            synced = True
        if not synced:
            await self.stop()
            raise TimeoutError(f"the registry watch did not catch up within {timeout:g}s")

    async def _start_all(self, timeout: float) -> None:
        """Follow the whole registry (if not yet) and wait until caught up; TimeoutError
        after ``timeout`` seconds (the watch goes on)."""
        if self._task is None:
            self._synced.clear()
            self._task = asyncio.create_task(self._run(), name="route-cache-watch")
        await asyncio.wait_for(self._synced.wait(), timeout)

    async def stop(self) -> None:
        self._stopping = True
        tasks = [f.task for f in self._follows.values() if f.task is not None]
        if self._task is not None:
            tasks.append(self._task)
            self._task = None
        self._follows.clear()
        await cancel_and_wait(tasks)

    @property
    def synced(self) -> bool:
        return self._synced.is_set()

    def on_change(self, listener: Callable[[str, Instance | None], None]) -> None:
        """Call ``listener(agent_id, instance or None)`` after each applied change."""
        self._listeners.append(listener)

    # -- what is followed ----------------------------------------------------------------

    def followed(self) -> list[str]:
        """The capabilities followed one by one (none once the whole registry is)."""
        return list(self._follows)

    def ready(self, capability: str) -> bool:
        """Whether lookups of ``capability`` answer from a followed, caught-up source
        (and, if followed alone, it counts as used now)."""
        if self.follow_all:
            return self._synced.is_set()
        follow = self._follows.get(capability)
        if follow is None or not follow.synced.is_set():
            return False
        self._follows.move_to_end(capability)
        return True

    async def follow(self, capability: str, timeout: float = 10.0) -> None:
        """Follow ``capability`` (if not yet) and wait until its instances are known:
        one scan of its route keys. TimeoutError after ``timeout`` seconds."""
        if self.ready(capability):
            return
        if self.follow_all:
            await self._start_all(timeout)
            return
        follow = self._want(capability)
        if follow is None:
            return
        async with asyncio.timeout(timeout):
            await follow.synced.wait()

    async def follow_everything(self, timeout: float = 10.0) -> None:
        """Follow the whole registry from now on and wait until caught up."""
        if not self.follow_all:
            self.follow_all = True
            self._synced.clear()
        await self._start_all(timeout)

    def _want(self, capability: str) -> _Follow | None:
        """Start following ``capability`` unless it is (or everything is): a lookup's
        first use of it. None when nothing can be followed (not started, stopped, or a
        name that cannot be a capability)."""
        if self.follow_all:
            if self._started and self._task is None and not self._stopping:
                self._task = asyncio.get_running_loop().create_task(
                    self._run(), name="route-cache-watch"
                )
            return None
        follow = self._follows.get(capability)
        if follow is not None:
            self._follows.move_to_end(capability)
            return follow
        if not self._started or self._stopping or not subjects.is_token(capability):
            return None
        follow = self._follows[capability] = _Follow()
        follow.task = asyncio.get_running_loop().create_task(
            self._run_routes(capability, follow), name=f"route-cache-{capability}"
        )
        while len(self._follows) > self.max_followed:
            self._unfollow(next(iter(self._follows)))
        return follow

    def _want_all(self) -> None:
        """A lookup of the whole registry: follow all of it from now on (in the background)."""
        if not self.follow_all and self._started and not self._stopping:
            self.follow_all = True
            self._synced.clear()
            self._want("")

    def _unfollow(self, capability: str) -> None:
        follow = self._follows.pop(capability, None)
        if follow is None:
            return
        if follow.task is not None:
            follow.task.cancel()
        members = self._by_capability.get(capability)
        for agent_id in list(members.by_id) if members is not None else ():
            self._apply_route(RouteChange(capability, agent_id, _GONE))

    async def _run_routes(self, capability: str, follow: _Follow) -> None:
        watch = functools.partial(self._store.watch_routes, capability)
        await self._keep_following(watch, capability, follow.synced, self._apply_route)

    async def _run(self) -> None:
        watch = functools.partial(self._store.watch, f"{subjects.AGENT_KEY_PREFIX}>")
        await self._keep_following(watch, "", self._synced, self._apply_record)

    def _apply_record(self, change: RecordChange) -> None:
        if change.key.startswith(subjects.AGENT_KEY_PREFIX):
            self._apply(change.agent_id, change.instance, change.revision)

    async def _keep_following(
        self,
        watch: Callable[[], AsyncIterator[_C | None]],
        what: str,
        synced: asyncio.Event,
        apply: Callable[[_C], None],
    ) -> None:
        while not self._stopping:
            try:
                async for change in watch():
                    if change is None:
                        if synced is self._synced:
                            self._caught_up()
                        synced.set()
                        continue
                    self.records += 1
                    apply(change)
            except asyncio.CancelledError:
                raise
            except ReachError as exc:
                log.warning("registry watch %s failed (%s); restarting", what or ">", exc)
            except Exception:  # a bug here must not leave the cache frozen for good
                log.exception("registry watch %s failed; restarting", what or ">")
            await asyncio.sleep(0.5)

    def _caught_up(self) -> None:
        """The whole registry is loaded: the capabilities' own watches go (what they
        indexed stays, kept current by the records), and after the first load of a
        large registry the full collection it made due is taken now (reach.runtime)."""
        if not self._synced.is_set():
            settle_after_load(len(self._instances))
        for follow in self._follows.values():
            if follow.task is not None:
                follow.task.cancel()
        self._follows.clear()

    # -- changes -------------------------------------------------------------------------

    def _apply(self, agent_id: str, instance: Instance | None, revision: int) -> None:
        """A whole instance record (or its deletion) at ``revision``."""
        current = self._instances.get(agent_id)
        if current is not None and current[1] >= revision:
            return
        held = self._held.get(agent_id, {})
        if instance is None:
            for name in list(held):
                self._drop(agent_id, name, revision)
            if current is not None or held:
                self._gone(agent_id)
        else:
            self._instances[agent_id] = (instance, revision)
            # a new version of a record (a heartbeat) takes its old routes' places: a call
            # in flight holds an index's list, which must not empty under it and move on
            peer = self.peers.peer(agent_id)
            served = [spec.name for spec in instance.manifest.capabilities]
            for name in served:
                self._put(instance, name, revision, peer)
            for name in [c for c in held if c not in served]:
                self._drop(agent_id, name, revision)
        self._changed_now(agent_id, instance)

    def _apply_route(self, change: RouteChange) -> None:
        """A route key: ``change.instance`` serving ``change.capability`` (None: removed)."""
        agent_id, cap, revision = change.agent_id, change.capability, change.revision
        instance = change.instance
        if instance is not None and instance.manifest.capability(cap) is None:
            instance = None  # a record that does not serve the key's capability
        if instance is None:
            if not self._drop(agent_id, cap, revision):
                return
            if not self._held.get(agent_id):
                self._gone(agent_id)
                self._changed_now(agent_id, None)
            return
        if not self._put(instance, cap, revision, self.peers.peer(agent_id)):
            return
        current = self._instances.get(agent_id)
        if current is None or current[1] < revision:
            self._instances[agent_id] = (instance, revision)
        self._changed_now(agent_id, self._instances[agent_id][0])

    def _gone(self, agent_id: str) -> None:
        self._instances.pop(agent_id, None)
        self._held.pop(agent_id, None)
        self.peers.forget(agent_id)  # a call still in flight to it keeps its own

    def _changed_now(self, agent_id: str, instance: Instance | None) -> None:
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

    def _put(self, inst: Instance, cap: str, revision: int, peer: Peer) -> bool:
        """Index ``inst`` as a route to ``cap`` (in place of an older one); False if the
        route held is as new."""
        agent_id = inst.agent_id
        held = self._held.setdefault(agent_id, {})
        old = held.get(cap)
        if old is not None and old[0] >= revision:
            return False
        # gathered now, as the record arrives, not on a call
        entry = route_entry(inst, cap, peer)
        if entry is None:  # pragma: no cover - callers check the capability is served
            return False
        tags = tuple(dict.fromkeys(entry.spec.tags))
        held[cap] = (revision, tags)
        self._by_capability.setdefault(cap, Members()).add(entry)
        for tag in tags:
            self._by_cap_tag.setdefault((cap, tag), Members()).add(entry)
            self._by_tag.setdefault(tag, set()).add((agent_id, cap))
        for tag in old[1] if old is not None else ():
            if tag not in tags:
                self._untag(agent_id, cap, tag)
        return True

    def _drop(self, agent_id: str, cap: str, revision: int) -> bool:
        """Take the route of ``agent_id`` to ``cap`` out; False if none older is held."""
        held = self._held.get(agent_id)
        old = held.get(cap) if held is not None else None
        if held is None or old is None or old[0] >= revision:
            return False
        del held[cap]
        members = self._by_capability.get(cap)
        if members is not None and members.remove(agent_id):
            del self._by_capability[cap]
        for tag in old[1]:
            self._untag(agent_id, cap, tag)
        return True

    def _untag(self, agent_id: str, cap: str, tag: str) -> None:
        key = (cap, tag)
        members = self._by_cap_tag.get(key)
        if members is not None and members.remove(agent_id):
            del self._by_cap_tag[key]
        tagged = self._by_tag.get(tag)
        if tagged is not None:
            tagged.discard((agent_id, cap))
            if not tagged:
                del self._by_tag[tag]

    def get(self, agent_id: str) -> Instance | None:
        """The instance ``agent_id`` (a lookup of the whole registry: see the module)."""
        self._want_all()
        found = self._instances.get(agent_id)
        return found[0] if found else None

    def all(self) -> list[Instance]:
        """Every instance known (a lookup of the whole registry: see the module)."""
        self._want_all()
        return [inst for inst, _ in self._instances.values()]

    def known(self) -> list[Instance]:
        """Every instance known now, whatever is followed (follows nothing more)."""
        return [inst for inst, _ in self._instances.values()]

    def sample(self, capability: str, k: int, tags: Iterable[str] = ()) -> list[Instance]:
        """Up to ``k`` instances of a capability (carrying all ``tags``) picked at random
        (all if there are fewer)."""
        return [entry.instance for entry in sample(self.entries(capability, tags), k)]

    def for_capability(self, capability: str, tags: Iterable[str] = ()) -> Iterable[Instance]:
        """Every known instance of a capability whose entry carries all ``tags``, healthy
        or not (a dictionary access for no tag or one, a walk of the smallest tag's
        members for more)."""
        if capability not in self._follows:
            self._want(capability)
        wanted = tuple(tags)
        if len(wanted) <= 1:
            return self._members(capability, wanted).by_id.values()
        return [entry.instance for entry in self.entries(capability, wanted)]

    def entries(self, capability: str, tags: Iterable[str] = ()) -> Sequence[RouteEntry]:
        """``for_capability`` as routes to the capability, ready for ``reach.caller.routing.choose``
        (the routing hot path: the index's own list for no tag or one; do not change it).
        It follows nothing: a caller makes sure of that first (``follow``)."""
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
        members = self.index_of(capability, tags, candidates)
        if members is None:
            return tuple(e.agent_id for e in candidates[:NAMED_CANDIDATES])
        return members.names()

    def index_of(
        self, capability: str, tags: tuple[str, ...], candidates: Sequence[RouteEntry]
    ) -> Members | None:
        """The index's members whose own list ``entries`` gave as ``candidates`` (None: a
        list made for one call, for several tags), with this caller's ``aperture``."""
        members = self._members(capability, tags) if len(tags) <= 1 else NOBODY
        return members if members.entries is candidates and members is not NOBODY else None

    def _members(self, capability: str, tags: tuple[str, ...]) -> Members:
        if tags:
            return self._by_cap_tag.get((capability, tags[0]), NOBODY)
        return self._by_capability.get(capability, NOBODY)

    def capabilities(self) -> list[str]:
        """The capabilities some known instance offers, sorted (those followed, unless the
        whole registry is)."""
        return sorted(name for name, members in self._by_capability.items() if members.entries)

    async def capability_names(self) -> list[str]:
        """The capabilities offered on the fabric, sorted: known ones if the whole registry
        is followed, else the route keys' names (read at most every
        ``NAMES_FRESH_SEC``: what a caller that misspelled a capability is told)."""
        if self.follow_all:
            return self.capabilities()
        now = time.monotonic()
        if self._names is None or now - self._names[0] > NAMES_FRESH_SEC:
            self._names = (now, sorted(await self._store.capability_names()))
        return self._names[1]

    def find(
        self,
        capability: str | None = None,
        tags: Iterable[str] = (),
        version: str | None = None,
        include_unhealthy: bool = False,
    ) -> list[Instance]:
        """Instances offering ``capability`` (if given) with a capability carrying all ``tags``."""
        wanted = list(tags)
        if capability is None:
            self._want_all()
        if wanted and capability is not None:
            candidates = list(self.for_capability(capability, wanted))
        elif wanted:
            pairs = set.intersection(*[self._by_tag.get(t, set()) for t in wanted])
            ids = {agent_id for agent_id, _ in pairs}
            candidates = [self._instances[i][0] for i in ids if i in self._instances]
        elif capability is not None:
            candidates = list(self.for_capability(capability))
        else:
            candidates = self.known()
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
