"""The audit batch format: how events travel, written and read back.

One stream message holds the events of one capability, so the stream is written a few
times a second instead of once per call. ``BatchBuilder.add`` is the one conversion from
the writer's record (``reach.audit.events.CallEvent``) to the batch format: a plain call
(answered at the first attempt by the instance it went to, nothing skipped, no fallback)
becomes a slot in the batch's columns (``reach.audit.columns``), and so does a callee's
primary event of a call it answered ok (in a second set of columns, ``served``); any
other event is a packed row in ``EVENT_FIELDS`` order. ``reach.audit.decode`` reads
batches back.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from typing import Any, Final

import msgpack

from reach.audit.columns import Columns
from reach.audit.events import ATTEMPT_FIELDS, EVENT_FIELDS, CallEvent
from reach.wire.codec import packb

__all__ = [
    "BATCH_VERSION",
    "CALLS_HEADER",
    "NOTABLE_ERRORS",
    "NOTABLE_HEADER",
    "BatchBuilder",
    "RowSummary",
    "encode_batch",
    "encode_notice",
    "event_row",
    "pack_event",
    "summary_headers",
]

#: version of a batch's layout (``v``): the one version written and read
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
    types, see ``reach.wire.codec.packb``). Raises what msgpack raises for a field it cannot
    pack."""
    packed: bytes = packb(event_row(event))
    return packed


#: a caller event with one of these errors is notable: ``breaker`` (refused by open
#: breakers), ``InternalError`` (the handler failed: the ``instance_errors`` alert)
NOTABLE_ERRORS: Final = frozenset({"breaker", "InternalError"})


class RowSummary:
    """What a batch says about its events: calls per capability, notable ones."""

    __slots__ = ("calls", "notable")

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        #: caller events the alert rules look at: retried calls, breaker rejections (a
        #: call refused by open breakers, or one that passed an open breaker over), calls
        #: whose handler failed
        self.notable = 0

    def add(self, event: CallEvent) -> None:
        if event.side == "caller":
            capability = event.capability
            self.calls[capability] = self.calls.get(capability, 0) + 1
            if len(event.attempts) > 1 or event.error in NOTABLE_ERRORS or event.skipped:
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
    ``seq``, with its summary (``AuditNotice`` in ``reach.audit.eventmodels``) and the events
    its writer dropped since its last notice, if any."""
    notice: dict[str, object] = {"seq": seq, "calls": summary.calls, "notable": summary.notable}
    if dropped:
        notice["dropped"] = dropped
    return json.dumps(notice, separators=(",", ":")).encode()
