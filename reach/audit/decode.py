"""Audit batches read back (``reach.audit.batch`` writes them): every event as a map of
``AuditEvent``'s fields (``decode_events``), and a batch's calls counted without reading
its rows (``read_counts``, or its headers alone, ``read_header_counts``).

Only batches of ``BATCH_VERSION`` are read: any other is refused whole
(``BatchVersionError``). Within it, columns and their positions are optional (a batch
may be rows only, the layout docs/protocol.md gives writers in other languages), and a
batch names the fields of its rows: a writer writes the ones it knows, and each field it
leaves out reads back as ``AuditEvent``'s default.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from itertools import pairwise
from typing import Any, TypeGuard

import msgpack

from reach.audit.batch import BATCH_VERSION, CALLS_HEADER, NOTABLE_HEADER
from reach.audit.columns import expand_plain
from reach.audit.events import EVENT_VERSION
from reach.errors import CodecError

__all__ = [
    "BatchVersionError",
    "DecodedBatch",
    "decode_events",
    "decode_raw",
    "read_counts",
    "read_header_counts",
]


class BatchVersionError(CodecError):
    """An audit batch of a layout version (``version``) other than ``BATCH_VERSION``:
    none of it is read."""

    def __init__(self, version: object) -> None:
        self.version = version
        super().__init__(
            f"audit batch of version {version!r}; this reader reads version {BATCH_VERSION}",
            path="v",
        )


def _check_version(batch: Mapping[str, Any]) -> None:
    """Raise ``BatchVersionError`` unless the decoded ``batch`` is of ``BATCH_VERSION``."""
    version = batch.get("v")
    if type(version) is not int or version != BATCH_VERSION:
        raise BatchVersionError(version)


def read_header_counts(headers: Mapping[str, str]) -> dict[str, int] | None:
    """``read_counts`` from a batch's headers alone; None when its rows must be read."""
    try:
        notable = int(headers[NOTABLE_HEADER])
        calls = json.loads(headers[CALLS_HEADER])
    except (KeyError, ValueError, TypeError):
        return None
    return _plain_counts(calls) if notable == 0 else None


def _plain_counts(calls: Any) -> dict[str, int] | None:
    if type(calls) is not dict:
        return None
    if not all(type(k) is str and k and type(n) is int and n > 0 for k, n in calls.items()):
        return None
    return calls


def read_counts(data: bytes) -> dict[str, int] | None:
    """The calls per capability of a batch in which no row is notable, read without
    unpacking its rows; None when the rows must be read (notable rows, a writer that
    sends no summary, a batch of another version, or anything unexpected)."""
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=True, max_buffer_size=len(data) or 1)
    try:
        unpacker.feed(data)
        calls: Any = None
        notable: Any = None
        version: Any = None
        for _ in range(unpacker.read_map_header()):
            key = unpacker.unpack()
            if key == "events":
                break
            if key == "v":
                version = unpacker.unpack()
            elif key == "calls":
                calls = unpacker.unpack()
            elif key == "notable":
                notable = unpacker.unpack()
            else:
                unpacker.skip()
    except Exception:
        return None
    if type(version) is not int or version != BATCH_VERSION:
        return None
    return _plain_counts(calls) if notable == 0 else None


def _row_to_map(row: Any, fields: Sequence[str], attempt_fields: Sequence[str]) -> Any:
    if not isinstance(row, list) or len(row) != len(fields):
        return None
    event = dict(zip(fields, row, strict=True))
    attempts = event.get("attempts")
    if isinstance(attempts, list):
        event["attempts"] = [
            dict(zip(attempt_fields, a, strict=False)) if isinstance(a, list) else a
            for a in attempts
        ]
    event["v"] = EVENT_VERSION
    return event


class DecodedBatch:
    """A batch's events as maps, unvalidated, in the order they were recorded."""

    __slots__ = ("bad", "events")

    def __init__(self, events: list[dict[str, Any]], bad: int) -> None:
        self.events = events
        #: rows and columns that do not fit the format (left out of ``events``)
        self.bad = bad


def decode_events(data: bytes) -> DecodedBatch:
    """The events of one stream message as maps (``AuditEvent``'s fields), unvalidated,
    and how many could not be read; ``BatchVersionError`` for a batch of another version."""
    try:
        batch = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception:
        return DecodedBatch([], 1)
    if not isinstance(batch, dict):
        return DecodedBatch([], 1)
    _check_version(batch)
    fields, attempt_fields, rows = (
        batch.get("fields"),
        batch.get("attempt_fields"),
        batch.get("events"),
    )
    if not (_names(fields) and _names(attempt_fields)):
        return DecodedBatch([], 1)
    if not isinstance(rows, list):
        return DecodedBatch([], 1)
    full: list[Any] = [_row_to_map(row, fields, attempt_fields) for row in rows]
    bad = full.count(None)
    plain, bad_plain = _expand(batch.get("plain"))
    served, bad_served = _expand(batch.get("served"))
    bad += bad_plain + bad_served
    if bad_plain or bad_served:  # the places of the rest no longer add up
        return DecodedBatch(plain + [e for e in full if e is not None] + served, bad)
    order = _order(
        len(plain), batch.get("positions"), len(full), batch.get("served_positions"), len(served)
    )
    if order is None:
        return DecodedBatch(plain + [e for e in full if e is not None] + served, bad)
    sources = (iter(plain), iter(full), iter(served))
    picked = [next(sources[i]) for i in order]  # a list: mypyc compiles no generator here
    events = [event for event in picked if event is not None]
    return DecodedBatch(events, bad)


def _expand(part: Any) -> tuple[list[dict[str, Any]], int]:
    """The events of a set of columns (none: no events), and how many could not be read."""
    if part is None:
        return [], 0
    try:
        events = expand_plain(part)
    except ValueError:
        n = part.get("n") if isinstance(part, dict) else None
        return [], n if type(n) is int and n > 0 else 1
    for event in events:
        event["v"] = EVENT_VERSION
    return events, 0


def _names(value: Any) -> TypeGuard[list[str]]:
    return type(value) is list and all(type(name) is str for name in value)


def _order(
    n_plain: int, positions: Any, n_rows: int, served_positions: Any, n_served: int
) -> list[int] | None:
    """Where each event of a batch comes from, in recorded order (0: the caller's columns,
    1: the rows, 2: the callee's columns): rows at ``positions``, the callee's plain
    events at ``served_positions``, the caller's filling the other places. None when the
    places do not fit (then the reader takes the columns, the rows, then the callee's)."""
    total = n_plain + n_rows + n_served
    if n_served == 0 and served_positions is None:
        served_positions = []
    if n_plain + n_served == 0 and positions is None:
        positions = list(range(n_rows))
    places: list[int | None] = [None] * total
    for source, at, n in ((1, positions, n_rows), (2, served_positions, n_served)):
        if not (
            type(at) is list
            and len(at) == n
            and all(type(p) is int and 0 <= p < total for p in at)
            and all(a < b for a, b in pairwise(at))
        ):
            return None
        for p in at:
            if places[p] is not None:
                return None
            places[p] = source
    return [0 if source is None else source for source in places]


def decode_raw(data: bytes) -> list[dict[str, Any]]:
    """The events of one stream message as maps, unvalidated (for fast consumers that
    read a few keys with ``.get``); events that do not fit the format are left out, and a
    batch of another version raises ``BatchVersionError``."""
    return decode_events(data).events
