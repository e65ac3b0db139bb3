"""Audit batches read for counting: rows as maps, plain calls left in their columns.

``reach.audit.decode.decode_events`` makes a map of every event, which is what a reader
that shows events needs. A reader that counts every call of a busy fabric (the console)
needs only a plain call's time, names and latencies: ``split_batch`` checks a batch as
``decode_events`` does (the same events are read, the same are refused) but leaves its
plain calls in their columns (``ColumnPart``), so that no map is made per plain call.
"""

from __future__ import annotations

from typing import Any

import msgpack

from reach.audit.columns import PlainPart
from reach.audit.decode import _check_version, _names, _row_to_map

__all__ = ["ColumnPart", "SplitBatch", "split_batch"]


#: a set of plain calls' columns, checked as ``expand_plain`` checks them but not made
#: into maps; for readers that count calls rather than show them
ColumnPart = PlainPart


class SplitBatch:
    """A batch's rows as maps (unvalidated) and its sets of columns as they are."""

    __slots__ = ("bad", "columns", "rows")

    def __init__(self, rows: list[dict[str, Any]], columns: list[ColumnPart], bad: int) -> None:
        self.rows = rows
        self.columns = columns
        #: rows and columns that do not fit the format (left out)
        self.bad = bad


def split_batch(data: bytes) -> SplitBatch:
    """The events of one stream message as ``decode_events`` reads them, in no particular
    order: the rows as maps, the plain calls left in their columns (``ColumnPart``), for
    a reader that counts every call of the fabric and so builds no map per plain call.
    ``BatchVersionError`` for a batch of another version, as ``decode_events``."""
    try:
        batch = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception:
        return SplitBatch([], [], 1)
    if not isinstance(batch, dict):
        return SplitBatch([], [], 1)
    _check_version(batch)
    fields, attempt_fields, rows = (
        batch.get("fields"),
        batch.get("attempt_fields"),
        batch.get("events"),
    )
    if not (_names(fields) and _names(attempt_fields) and isinstance(rows, list)):
        return SplitBatch([], [], 1)
    full: list[Any] = [_row_to_map(row, fields, attempt_fields) for row in rows]
    bad = full.count(None)
    columns: list[ColumnPart] = []
    for key in ("plain", "served"):
        part = batch.get(key)
        if part is None:
            continue
        try:
            columns.append(PlainPart(part))
        except ValueError:
            n = part.get("n") if isinstance(part, dict) else None
            bad += n if type(n) is int and n > 0 else 1
    return SplitBatch([e for e in full if e is not None], columns, bad)
