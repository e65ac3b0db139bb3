"""Process-wide settings for a process that follows a large registry.

A registrar (and a caller whose route cache holds thousands of instances) replaces one
registry record per heartbeat: at 10,000 instances heartbeating every 5 s, 2,000 records
a second, each a few dozen objects the cyclic garbage collector tracks. A record lives
one heartbeat interval, long enough to reach the collector's oldest generation, so with
Python's default thresholds full collections come often, and each walks every object of
every record: under that load a registrar spends a large share of its CPU on them and
falls behind. Records hold no reference cycles, and reference counting frees them the
moment they are replaced: what full collections find there is nothing.

A full collection walks every record held, so its pause grows with the registry.
CPython's generational collector takes one only once the objects that survived since
the last have grown by a quarter; a first load of the registry leaves such a collection
due, and without :func:`settle_after_load` it comes at a moment nobody chose, while the
first changes after the load are being applied.
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
    """After a first load of the registry that left ``records`` records held (a route cache
    or a registrar catching up with it): one full collection now, if there are at least
    :data:`SETTLE_AFTER_RECORDS`, at the end of the load that made it due rather than
    during the changes applied next. Nothing if the application turned automatic
    collection off: it runs collections itself."""
    if records >= SETTLE_AFTER_RECORDS and gc.isenabled():
        gc.collect()
