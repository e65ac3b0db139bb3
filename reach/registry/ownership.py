"""Which registrar hears and judges which instance: rendezvous hashing of heartbeat
partitions over the live registrars.

An instance's heartbeats come on its partition's subject (``reach.registry.partitions``);
each partition belongs to the live registrar with the highest weight for it. Every
registrar sees the same ``registrar.<id>`` records through its registry watch, so each
computes the same owners without talking to the others; when one stops refreshing its
record its partitions move to the others, and only those; when one joins it takes about
its share from each. No I/O.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

from reach.registry.partitions import partition_of
from reach.wire import subjects
from reach.wire.models import RegistrarRecord

__all__ = ["LIVE_INTERVALS", "Ownership"]

#: a registrar whose record was not refreshed for this many of its intervals is not live
LIVE_INTERVALS = 3
#: agent ids whose partition is kept
_PARTITIONS_KEPT = 1 << 18


def _weight(registrar_id: str, partition: int) -> bytes:
    return hashlib.blake2b(f"{registrar_id}/p{partition}".encode()).digest()


class Ownership:
    """One registrar's answer to "is this partition (this instance) mine?", kept current
    by its watch; ``on_change`` is told when the set of live registrars may have changed."""

    def __init__(
        self,
        registrar_id: str,
        partitions: int = subjects.HEARTBEAT_PARTITIONS,
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        self.registrar_id = registrar_id
        self.partitions = partitions
        self.on_change = on_change
        #: the registrar records seen on the watch, by id
        self.registrars: dict[str, RegistrarRecord] = {}
        self._owned: frozenset[int] | None = None
        #: the live registrars ``_owned`` was computed with
        self._computed_with: frozenset[str] = frozenset()
        self._partition_of: dict[str, int] = {}

    def _changed(self) -> None:
        self._owned = None
        self.on_change()

    def seen(self, registrar_id: str, record: RegistrarRecord) -> None:
        """A registrar's record was written (a new one changes the owners)."""
        known = registrar_id in self.registrars
        self.registrars[registrar_id] = record
        if not known:
            self._changed()

    def gone(self, registrar_id: str) -> None:
        """A registrar's record was deleted."""
        if self.registrars.pop(registrar_id, None) is not None:
            self._changed()

    def _live(self, record: RegistrarRecord, now: float) -> bool:
        return now - record.seen_at < LIVE_INTERVALS * record.interval_sec

    def live(self, now: float) -> list[str]:
        """The live registrars, this one first."""
        return [self.registrar_id] + [
            rid
            for rid, rec in self.registrars.items()
            if rid != self.registrar_id and self._live(rec, now)
        ]

    def owned(self, now: float) -> frozenset[int]:
        """The partitions this registrar owns (remembered until the set of live
        registrars changes)."""
        if self._owned is None:
            live = self.live(now)
            self._computed_with = frozenset(live)
            me = self.registrar_id
            self._owned = frozenset(
                p
                for p in range(self.partitions)
                if max(live, key=lambda rid: _weight(rid, p)) == me
            )
        return self._owned

    def partition(self, agent_id: str) -> int:
        """The heartbeat partition of ``agent_id`` (kept for the most recent agent ids:
        every heartbeat and every sweep asks)."""
        known = self._partition_of.get(agent_id)
        if known is None:
            if len(self._partition_of) >= _PARTITIONS_KEPT:
                self._partition_of.clear()
            known = self._partition_of[agent_id] = partition_of(agent_id, self.partitions)
        return known

    def owns(self, agent_id: str, now: float) -> bool:
        """Whether the partition of ``agent_id`` is this registrar's."""
        return self.partition(agent_id) in self.owned(now)

    def expire(self, now: float) -> None:
        """Registrars that stopped refreshing their records drop out of ownership (and
        one that refreshes its record again comes back)."""
        if self._owned is not None and frozenset(self.live(now)) != self._computed_with:
            self._changed()
