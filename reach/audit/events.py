"""Audit events: one per cross-agent call, written by the caller; denials by the denier.

On the hot path an event is a row, a plain tuple (building a model per call costs more
than the rest of the audit path); readers decode rows into ``AuditEvent``
(``reach.audit.records``), which is also the documented shape
(``schemas/audit-event.schema.json``). Events travel in batches:
one stream message holds a msgpack array of events of one capability, so the stream
is written a few times a second instead of once per call.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from operator import itemgetter
from typing import Any, Literal

import msgpack

from reach.codec import packb
from reach.errors import (
    AuthError,
    CircuitOpen,
    ContractError,
    Disconnected,
    DiscoveryError,
    NoResponders,
    ReachError,
    ReachTimeout,
    RemoteError,
    RetriesExhausted,
    Unavailable,
)

__all__ = [
    "ATTEMPT_FIELDS",
    "CALLS_HEADER",
    "CAPABILITY_INDEX",
    "EVENT_FIELDS",
    "EVENT_VERSION",
    "NOTABLE_HEADER",
    "REGISTRY_CAPABILITY",
    "ErrorClass",
    "EventRow",
    "Outcome",
    "RowSummary",
    "capability_of",
    "decode_raw",
    "denial_event",
    "encode_batch",
    "encode_rows",
    "error_class",
    "make_event",
    "pack_row",
    "pack_rows",
    "read_counts",
    "read_header_counts",
    "summary_headers",
]

EVENT_VERSION = 1

#: how a call ended: served, failed, or answered by a fallback after a failure
Outcome = Literal["ok", "error", "fallback", "denied"]

#: what failed, in the operator's words (DESIGN: connect failure, timeout, business
#: rejection, breaker rejection, auth denial — and the rest of the tree)
ErrorClass = Literal[
    "connect",
    "timeout",
    "business",
    "breaker",
    "denied",
    "contract",
    "unavailable",
    "discovery",
    "internal",
]


def error_class(exc: BaseException) -> ErrorClass:
    """The operator's name for what failed (a retried call: what the last attempt hit)."""
    if isinstance(exc, RetriesExhausted) and isinstance(exc.last, ReachError):
        exc = exc.last
    if isinstance(exc, AuthError):
        return "denied"
    if isinstance(exc, CircuitOpen):
        return "breaker"
    if isinstance(exc, ReachTimeout):
        return "timeout"
    if isinstance(exc, NoResponders | Disconnected):
        return "connect"
    if isinstance(exc, ContractError):
        return "contract"
    if isinstance(exc, Unavailable):
        return "unavailable"
    if isinstance(exc, DiscoveryError):
        return "discovery"
    if isinstance(exc, RemoteError):
        return "business" if exc.kind == "business" else "internal"
    return "internal"


#: capability name on audit events about the registry itself (refused announces etc.)
REGISTRY_CAPABILITY = "_registry"

#: the fields of an event row, in order (a batch names them, so readers do not guess)
EVENT_FIELDS: tuple[str, ...] = (
    "side",
    "ts",
    "capability",
    "call_id",
    "trace_id",
    "caller",
    "caller_agent",
    "callee",
    "outcome",
    "error",
    "code",
    "description",
    "latency_ms",
    "candidates",
    "n_candidates",
    "skipped",
    "attempts",
    "fallback",
    "fallback_reason",
)
ATTEMPT_FIELDS: tuple[str, ...] = ("agent_id", "score", "outcome", "latency_ms")
#: position of the capability in a row (batches group rows by it)
CAPABILITY_INDEX = EVENT_FIELDS.index("capability")

#: an event as the hot path builds it: a tuple in EVENT_FIELDS order, attempts as
#: tuples in ATTEMPT_FIELDS order (a tenth of the cost of building and packing maps)
EventRow = tuple[Any, ...]

_DEFAULTS: dict[str, Any] = {
    "side": "caller",
    "call_id": "",
    "trace_id": "",
    "caller": "",
    "caller_agent": None,
    "callee": "",
    "error": None,
    "code": "",
    "description": "",
    "latency_ms": 0.0,
    "candidates": (),
    "n_candidates": 0,
    "skipped": (),
    "attempts": (),
    "fallback": None,
    "fallback_reason": "",
}


def make_event(**fields: Any) -> EventRow:
    """An event row from keyword fields (``ts``, ``capability`` and ``outcome`` required;
    attempts as mappings or rows). For code off the hot path and for tests."""
    missing = {"ts", "capability", "outcome"} - fields.keys()
    unknown = fields.keys() - set(EVENT_FIELDS)
    if missing or unknown:
        raise ValueError(f"event fields: missing {sorted(missing)}, unknown {sorted(unknown)}")
    values = {**_DEFAULTS, **fields}
    values["attempts"] = tuple(
        tuple(a.get(k, _ATTEMPT_DEFAULTS[k]) for k in ATTEMPT_FIELDS) if isinstance(a, dict) else a
        for a in values["attempts"]
    )
    return tuple(values[name] for name in EVENT_FIELDS)


_ATTEMPT_DEFAULTS: dict[str, Any] = {
    "agent_id": "",
    "score": None,
    "outcome": "ok",
    "latency_ms": 0.0,
}


def denial_event(
    *,
    side: Literal["callee", "registrar"],
    ts: float,
    capability: str,
    callee: str,
    call_id: str,
    code: str,
    description: str,
    caller: str = "",
    caller_agent: str | None = None,
    trace_id: str = "",
) -> EventRow:
    """The audit event of a refusal, written by the side that refused."""
    return make_event(
        side=side,
        ts=ts,
        capability=capability,
        call_id=call_id,
        trace_id=trace_id,
        caller=caller,
        caller_agent=caller_agent,
        callee=callee,
        outcome="denied",
        error="denied",
        code=code,
        description=description,
    )


_SIDE, _ERROR, _ATTEMPTS = (EVENT_FIELDS.index(f) for f in ("side", "error", "attempts"))
_GET_SIDE, _GET_ERROR, _GET_ATTEMPTS = (itemgetter(i) for i in (_SIDE, _ERROR, _ATTEMPTS))
#: the capability of an event row
capability_of = itemgetter(CAPABILITY_INDEX)

#: packs one event row: the writer packs rows as they are recorded, so the events that
#: wait for their batch are bytes, which CPython's cyclic GC never tracks. Rows of tuples
#: waiting there made the collector run (and walk the whole heap now and then) where the
#: rest of the call path leaves it nothing to do. Rows are built here of exact built-in
#: types, so the library's shared packer serves (see ``reach.codec.packb``).
pack_row = packb


def pack_rows(rows: Sequence[EventRow]) -> memoryview:
    """Rows packed one after another, as ``pack_row`` would each (in one call into
    msgpack: packed as an array, whose header is left off)."""
    n = len(rows)
    header = 1 if n < 16 else 3 if n < 0x10000 else 5
    return memoryview(pack_row(rows))[header:]


class RowSummary:
    """What the batch of packed rows says about them: calls per capability, notable rows."""

    __slots__ = ("calls", "notable")

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        #: caller rows the alert rules look at: retried calls, breaker rejections
        self.notable = 0

    def add(self, row: EventRow) -> None:
        self.add_all((row,))

    def add_all(self, rows: Sequence[EventRow]) -> None:
        if not rows:
            return
        if list(map(_GET_SIDE, rows)).count("caller") != len(rows):
            self._add_each(rows)
            return
        capability = rows[0][CAPABILITY_INDEX]
        if list(map(capability_of, rows)).count(capability) != len(rows):
            self._add_each(rows)
            return
        # the call path's case, a turn of calls to one capability: counted in C
        self.calls[capability] = self.calls.get(capability, 0) + len(rows)
        if max(map(len, map(_GET_ATTEMPTS, rows))) <= 1:
            self.notable += list(map(_GET_ERROR, rows)).count("breaker")
        else:
            self.notable += sum(
                1 for row in rows if len(row[_ATTEMPTS]) > 1 or row[_ERROR] == "breaker"
            )

    def _add_each(self, rows: Sequence[EventRow]) -> None:
        for row in rows:
            if row[_SIDE] == "caller":
                capability = row[CAPABILITY_INDEX]
                self.calls[capability] = self.calls.get(capability, 0) + 1
                if len(row[_ATTEMPTS]) > 1 or row[_ERROR] == "breaker":
                    self.notable += 1


#: the constant entries of every batch (without their map's header)
_HEAD = msgpack.packb(
    {"v": EVENT_VERSION, "fields": EVENT_FIELDS, "attempt_fields": ATTEMPT_FIELDS},
    use_bin_type=True,
)[1:]


def encode_rows(rows: bytes | bytearray | memoryview, count: int, summary: RowSummary) -> bytes:
    """One stream message (``AuditBatch``) from ``count`` rows packed by ``pack_row``:
    ``{"v", "fields", "attempt_fields", "calls", "notable", "events": [row, ...]}``."""
    packer = msgpack.Packer(use_bin_type=True)
    return b"".join(
        (
            packer.pack_map_header(6),
            _HEAD,
            packer.pack("calls"),
            packer.pack(summary.calls),
            packer.pack("notable"),
            packer.pack(summary.notable),
            packer.pack("events"),
            packer.pack_array_header(count),
            rows,
        )
    )


def encode_batch(events: Sequence[EventRow]) -> bytes:
    """One stream message from event rows (see ``encode_rows``)."""
    summary = RowSummary()
    summary.add_all(events)
    return encode_rows(pack_rows(events), len(events), summary)


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


def decode_raw(data: bytes) -> list[dict[str, Any]]:
    """The events of one stream message as maps, unvalidated (for fast consumers that
    read a few keys with ``.get``); rows that do not fit the batch's fields are left out."""
    try:
        batch = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception:
        return []
    if not isinstance(batch, dict):
        return []
    fields, attempt_fields, rows = (
        batch.get("fields"),
        batch.get("attempt_fields"),
        batch.get("events"),
    )
    if not (isinstance(fields, list) and isinstance(attempt_fields, list)):
        return []
    if not isinstance(rows, list):
        return []
    out = []
    for row in rows:
        event = _row_to_map(row, fields, attempt_fields)
        if isinstance(event, dict):
            out.append(event)
    return out
