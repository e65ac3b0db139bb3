"""The audit batch format: how events travel, written and read back.

One stream message holds the events of one capability, so the stream is written a few
times a second instead of once per call. ``BatchBuilder.add`` is the one conversion from
the writer's record (``reach.audit.events.CallEvent``) to the batch format: a plain call
(answered at the first attempt by the instance it went to, nothing skipped, no fallback)
becomes a slot in the batch's columns (``reach.audit.columns``), and so does a callee's
primary event of a call it answered ok (in a second set of columns, ``served``); any
other event is a packed row in ``EVENT_FIELDS`` order. Readers get maps of
``AuditEvent``'s fields back (``decode_events``), from batches of any layout (rows only,
version 1; a caller's columns beside rows, version 2; a callee's too, version 3; columns
that may name an actor, version 4), and can count a batch's calls without reading its
rows (``read_counts``, or its headers alone, ``read_header_counts``). A batch names the
fields of its rows, so a row written before a field existed (``actor``) reads back
without it, and ``AuditEvent`` gives it its default.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from itertools import pairwise
from typing import Any, TypeGuard

import msgpack

from reach.audit.columns import Columns, expand_plain
from reach.audit.events import ATTEMPT_FIELDS, EVENT_FIELDS, EVENT_VERSION, CallEvent
from reach.codec import packb

__all__ = [
    "BATCH_VERSION",
    "CALLS_HEADER",
    "NOTABLE_HEADER",
    "BatchBuilder",
    "DecodedBatch",
    "RowSummary",
    "decode_events",
    "decode_raw",
    "encode_batch",
    "encode_notice",
    "event_row",
    "pack_event",
    "read_counts",
    "read_header_counts",
    "summary_headers",
]

#: version of a batch's layout: 2 keeps plain calls as columns beside the rows, 3 a
#: callee's plain calls too, 4 an ``actor`` column in them when a call had one
BATCH_VERSION = 4


def event_row(event: CallEvent) -> tuple[Any, ...]:
    """``event`` as a row of a batch: its fields in ``EVENT_FIELDS`` order, attempts in
    ``ATTEMPT_FIELDS`` order."""
    return (
        event.side,
        event.ts,
        event.capability,
        event.call_id,
        event.trace_id,
        event.caller,
        event.caller_agent,
        event.actor,
        event.callee,
        event.outcome,
        event.error,
        event.code,
        event.description,
        event.latency_ms,
        event.candidates,
        event.n_candidates,
        event.skipped,
        event.attempts,
        event.fallback,
        event.fallback_reason,
        event.primary,
    )


def pack_event(event: CallEvent) -> bytes:
    """``event``'s row, packed (the library's shared packer: a row is made of built-in
    types, see ``reach.codec.packb``). Raises what msgpack raises for a field it cannot
    pack."""
    packed: bytes = packb(event_row(event))
    return packed


class RowSummary:
    """What a batch says about its events: calls per capability, notable ones."""

    __slots__ = ("calls", "notable")

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        #: caller events the alert rules look at: retried calls, breaker rejections (a
        #: call refused by open breakers, or one that passed an open breaker over)
        self.notable = 0

    def add(self, event: CallEvent) -> None:
        if event.side == "caller":
            capability = event.capability
            self.calls[capability] = self.calls.get(capability, 0) + 1
            if len(event.attempts) > 1 or event.error == "breaker" or event.skipped:
                self.notable += 1
        elif event.side == "callee" and event.primary:
            capability = event.capability
            self.calls[capability] = self.calls.get(capability, 0) + 1

    def add_calls(self, capability: str, n: int) -> None:
        """``n`` calls that are not notable."""
        if n:
            self.calls[capability] = self.calls.get(capability, 0) + n


def _is_plain(event: CallEvent) -> bool:
    """Answered at the first attempt by the instance it went to, with nothing skipped,
    no fallback and nothing to say: what the columns hold."""
    attempts = event.attempts
    if len(attempts) != 1:
        return False
    agent_id, score, outcome, _latency = attempts[0]
    return (
        event.side == "caller"
        and event.outcome == "ok"
        and outcome == "ok"
        and agent_id == event.callee
        and event.error is None
        and event.fallback is None
        and event.code == ""
        and event.description == ""
        and event.fallback_reason == ""
        and not event.skipped
        and 0 <= event.n_candidates <= 0xFFFFFFFF
        and (score is None or score == score)  # a NaN score stands for None in the columns
    )


def _is_served_plain(event: CallEvent) -> bool:
    """A callee's primary event of a call it answered ok, with nothing else to say: what
    the ``served`` columns hold."""
    return (
        event.side == "callee"
        and event.primary
        and event.outcome == "ok"
        and event.error is None
        and not event.attempts
        and not event.candidates
        and event.n_candidates == 0
        and event.fallback is None
        and event.code == ""
        and event.description == ""
        and event.fallback_reason == ""
        and not event.skipped
    )


class BatchBuilder:
    """The events of one stream message as they are recorded: plain calls of the
    batch's capability as columns (``reach.audit.columns``), every other event a packed
    row, with its place among them. ``count`` counts them all."""

    __slots__ = (
        "capability",
        "columns",
        "count",
        "positions",
        "rows",
        "served",
        "served_positions",
        "summary",
    )

    def __init__(self, capability: str) -> None:
        self.capability = capability
        self.columns = Columns()
        #: a callee's plain events (made on its first one), and where each one falls
        self.served: Columns | None = None
        self.served_positions: list[int] = []
        #: rows packed by ``pack_event``, one after another, and where each one falls
        self.rows = bytearray()
        self.positions: list[int] = []
        self.summary = RowSummary()
        self.count = 0

    @property
    def size(self) -> int:
        """Packed size, estimated."""
        served = self.served
        return len(self.rows) + self.columns.size + (served.size if served is not None else 0)

    @property
    def full(self) -> bool:
        served = self.served
        return self.columns.full or (served is not None and served.full)

    def add(self, event: CallEvent) -> None:
        """Any event: a plain call of this capability joins the columns, anything else is
        packed as a row. Raises what msgpack raises for a row it cannot pack, adding
        nothing."""
        if not self.add_if_plain(event):
            self.add_packed(event, pack_event(event))

    def add_if_plain(self, event: CallEvent) -> bool:
        """Add ``event`` if it is a plain call of this capability; False if it is not."""
        if event.capability != self.capability:
            return False
        if event.side == "callee":
            served = self.served
            if served is None:
                served = self.served = Columns("callee")
            if served.full or not _is_served_plain(event):
                return False
            served.add(event)
            self.served_positions.append(self.count)
        else:
            if self.columns.full or not _is_plain(event):
                return False
            self.columns.add(event)
        self.count += 1
        return True

    def add_packed(self, event: CallEvent, packed: bytes) -> None:
        """An event that is not a plain call, and ``packed``, what ``pack_event`` made of
        it."""
        self.rows += packed
        self.positions.append(self.count)
        self.summary.add(event)
        self.count += 1

    def encode(self) -> tuple[bytes, RowSummary, int]:
        """One stream message (``AuditBatch``): ``{"v", "fields", "attempt_fields",
        "calls", "notable", ["plain",] ["served", "served_positions",] ["positions",]
        "events": [row, ...]}``; the summary of its events (``summary_headers``); and how
        many events it had to leave out.

        Columns are packed only here: if a set of them cannot be (a name that is not
        valid UTF-8, say), its events are written as rows instead, each packed on its own
        after the other rows (the batch then says nothing of their order), and only those
        that cannot be packed are left out.
        """
        summary = RowSummary()
        summary.calls = dict(self.summary.calls)
        summary.notable = self.summary.notable
        rows, n_rows = bytearray(self.rows), len(self.positions)
        plain, plain_rows, n_plain, lost = _pack_columns(self.columns, self.capability)
        served, served_rows, n_served, lost_served = _pack_columns(self.served, self.capability)
        lost += lost_served
        for as_rows, n in ((plain_rows, n_plain), (served_rows, n_served)):
            if as_rows:
                rows += as_rows
                n_rows += n
        in_order = not (plain_rows or served_rows) and (plain is not None or served is not None)
        summary.add_calls(self.capability, n_plain + n_served)
        packer = msgpack.Packer(use_bin_type=True)
        extra: list[tuple[str, bytes]] = []
        if plain is not None:
            extra.append(("plain", plain))
        if served is not None:
            extra.append(("served", served))
        if in_order:
            extra.append(("positions", packer.pack(self.positions)))
            if served is not None:
                extra.append(("served_positions", packer.pack(self.served_positions)))
        parts = [
            packer.pack_map_header(6 + len(extra)),
            _HEAD,
            packer.pack("calls"),
            packer.pack(summary.calls),
            packer.pack("notable"),
            packer.pack(summary.notable),
        ]
        for key, value in extra:
            parts += (packer.pack(key), value)
        parts += (packer.pack("events"), packer.pack_array_header(n_rows), bytes(rows))
        return b"".join(parts), summary, lost


def _pack_columns(columns: Columns | None, capability: str) -> tuple[bytes | None, bytes, int, int]:
    """``columns`` packed (None when there are none, or when they cannot be packed: then
    their events packed one by one as rows, second), how many events they stand for, and
    how many could not be packed at all."""
    if columns is None or not len(columns):
        return None, b"", 0, 0
    try:
        packed: bytes = msgpack.packb(columns.encode(capability), use_bin_type=True)
        return packed, b"", len(columns), 0
    except (TypeError, ValueError, OverflowError, struct.error):
        pass
    rows: list[bytes] = []
    lost = 0
    for event in columns.events(capability):
        try:
            rows.append(pack_event(event))
        except (TypeError, ValueError, OverflowError):
            lost += 1
    return None, b"".join(rows), len(rows), lost


#: the constant entries of every batch (without their map's header)
_HEAD = msgpack.packb(
    {"v": BATCH_VERSION, "fields": EVENT_FIELDS, "attempt_fields": ATTEMPT_FIELDS},
    use_bin_type=True,
)[1:]


def encode_batch(events: Sequence[CallEvent]) -> bytes:
    """One stream message from ``events``, as the writer makes it: plain calls of the
    first event's capability as columns, the rest as rows (for tests and tools)."""
    builder = BatchBuilder(events[0].capability if events else "")
    for event in events:
        builder.add(event)
    return builder.encode()[0]


#: headers of a batch message that repeat its summary, for readers that ask the server for
#: headers only (the alert watcher): calls by capability as JSON, notable rows
CALLS_HEADER = "Reach-Calls"
NOTABLE_HEADER = "Reach-Notable"


def summary_headers(summary: RowSummary) -> dict[str, str]:
    """The headers that carry ``summary`` beside a batch."""
    return {
        CALLS_HEADER: json.dumps(summary.calls, separators=(",", ":")),
        NOTABLE_HEADER: str(summary.notable),
    }


def encode_notice(seq: int, summary: RowSummary, dropped: int = 0) -> bytes:
    """The notice on ``reach.v1.audited.<capability>.<writer>`` that the stream holds a batch at
    ``seq``, with its summary (``AuditNotice`` in ``reach.audit.records``) and the events
    its writer dropped since its last notice, if any."""
    notice: dict[str, object] = {"seq": seq, "calls": summary.calls, "notable": summary.notable}
    if dropped:
        notice["dropped"] = dropped
    return json.dumps(notice, separators=(",", ":")).encode()


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
    unpacking its rows; None when the rows must be read (notable rows, an older writer
    that sends no summary, or anything unexpected)."""
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=True, max_buffer_size=len(data) or 1)
    try:
        unpacker.feed(data)
        calls: Any = None
        notable: Any = None
        for _ in range(unpacker.read_map_header()):
            key = unpacker.unpack()
            if key == "events":
                break
            if key == "calls":
                calls = unpacker.unpack()
            elif key == "notable":
                notable = unpacker.unpack()
            else:
                unpacker.skip()
    except Exception:
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
    and how many could not be read. Reads both layouts: rows only (batch version 1) and
    plain calls as columns beside rows (version 2)."""
    try:
        batch = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception:
        return DecodedBatch([], 1)
    if not isinstance(batch, dict):
        return DecodedBatch([], 1)
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
    read a few keys with ``.get``); events that do not fit the format are left out."""
    return decode_events(data).events
