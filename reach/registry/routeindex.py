"""The route cache's index lists: the instances under one capability (or capability and
tag), ready for a choice; and how a wanted version matches."""

from __future__ import annotations

from reach.models import Instance
from reach.routing import Aperture, RouteEntry

__all__ = ["NAMED_CANDIDATES", "NOBODY", "Members", "version_matches"]

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
    many: ``reach.routing.Aperture``)."""

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
