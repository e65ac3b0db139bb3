"""Process-wide settings for a process that follows a large registry.

A registrar (and a caller whose route cache holds thousands of instances) replaces one
registry record per heartbeat: at 10,000 instances heartbeating every 5 s, 2,000 records
a second, each a few dozen objects the cyclic garbage collector tracks. A record lives
one heartbeat interval, long enough to reach the collector's oldest generation, so with
Python's default thresholds full collections come often, and each walks every object of
every record: under that load a registrar spends a large share of its CPU on them and
falls behind. Records hold no reference cycles, and reference counting frees them the
moment they are replaced: what full collections find there is nothing.

A full collection walks every record held, so its pause grows with the registry. The
interpreter takes one only once the objects that survived since the last have grown by
a quarter; a cache that has just loaded the registry leaves such a collection due, and
without :func:`settle_after_load` it comes at a moment nobody chose, while the first
changes after the load are being applied.
"""

from __future__ import annotations

import gc
from typing import Final

__all__ = ["REGISTRY_GC_THRESHOLD", "SETTLE_AFTER_RECORDS", "settle_after_load", "tune_gc"]

#: a full collection after this many collections of the middle generation (Python's
#: default is 10): a hundred times rarer
REGISTRY_GC_THRESHOLD: Final = 1000
#: records loaded at once from which the load is followed by a full collection
SETTLE_AFTER_RECORDS: Final = 1000


def tune_gc() -> None:
    """Make full garbage collections rare in this process (``reach up`` calls it for its
    registrar; call it at the start of a process whose route cache follows thousands of
    instances). Younger generations are collected as before, so cycles made by the
    process's own work are still freed; a threshold set higher already is kept."""
    young, middle, old = gc.get_threshold()
    if old < REGISTRY_GC_THRESHOLD:
        gc.set_threshold(young, middle, REGISTRY_GC_THRESHOLD)


def settle_after_load(records: int) -> None:
    """After ``records`` registry records were loaded at once (a cache catching up with
    the registry): one full collection now, while the caller waits for the load anyway,
    if there were at least :data:`SETTLE_AFTER_RECORDS`. The next one then comes only
    once the heap has grown by a quarter again, instead of soon after, in the middle of
    the changes the cache applies next."""
    if records >= SETTLE_AFTER_RECORDS:
        gc.collect()
