"""Which registrar probes and evicts which instance: rendezvous hashing over the live ones.

Every registrar sees the same ``registrar.<id>`` records through its registry watch, so
each computes the same owner for an instance without talking to the others; when one
stops refreshing its record its instances move to the others, and only those. No I/O.
"""

from __future__ import annotations

import hashlib

from reach.models import RegistrarRecord

__all__ = ["LIVE_INTERVALS", "Ownership"]

#: a registrar whose record was not refreshed for this many of its intervals is not live
LIVE_INTERVALS = 3


def _weight(registrar_id: str, agent_id: str) -> bytes:
    return hashlib.blake2b(f"{registrar_id}/{agent_id}".encode()).digest()


class Ownership:
    """One registrar's answer to "is this instance mine?", kept current by its watch."""

    def __init__(self, registrar_id: str) -> None:
        self.registrar_id = registrar_id
        #: the registrar records seen on the watch, by id
        self.registrars: dict[str, RegistrarRecord] = {}
        self._mine: dict[str, bool] = {}

    def seen(self, registrar_id: str, record: RegistrarRecord) -> None:
        """A registrar's record was written (a new one changes every owner)."""
        if registrar_id not in self.registrars:
            self._mine.clear()
        self.registrars[registrar_id] = record

    def gone(self, registrar_id: str) -> None:
        """A registrar's record was deleted."""
        if self.registrars.pop(registrar_id, None) is not None:
            self._mine.clear()

    def forget(self, agent_id: str) -> None:
        """The instance's record is gone."""
        self._mine.pop(agent_id, None)

    def _live(self, record: RegistrarRecord, now: float) -> bool:
        return now - record.seen_at < LIVE_INTERVALS * record.interval_sec

    def owns(self, agent_id: str, now: float) -> bool:
        """Whether this registrar probes and evicts ``agent_id`` (remembered until the
        set of live registrars changes)."""
        cached = self._mine.get(agent_id)
        if cached is not None:
            return cached
        live = [self.registrar_id] + [
            rid
            for rid, rec in self.registrars.items()
            if rid != self.registrar_id and self._live(rec, now)
        ]
        owner = max(live, key=lambda rid: _weight(rid, agent_id))
        mine = owner == self.registrar_id
        self._mine[agent_id] = mine
        return mine

    def expire(self, now: float) -> None:
        """Registrars that stopped refreshing their records drop out of ownership."""
        if any(
            rid != self.registrar_id and not self._live(rec, now)
            for rid, rec in self.registrars.items()
        ):
            self._mine.clear()
