"""Audit events: one per cross-agent call, written by the caller; denials by the denier.

On the hot path an event is a row, a plain tuple (building a model per call costs more
than the rest of the audit path), or, for a plain call answered at the first attempt,
a slot in a few columns (``reach.audit.columns``); readers decode both into
``AuditEvent`` (``reach.audit.records``), which is also the documented shape
(``schemas/audit-event.schema.json``). Events travel in batches: one stream message
holds the events of one capability, so the stream is written a few times a second
instead of once per call.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from itertools import pairwise
from operator import itemgetter
from typing import Any, Literal, TypeGuard

import msgpack

from reach.audit.columns import PlainColumns, expand_plain, new_columns, plain_events
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
    "BATCH_VERSION",
    "CALLS_HEADER",
    "CAPABILITY_INDEX",
    "EVENT_FIELDS",
    "EVENT_VERSION",
    "NOTABLE_HEADER",
    "REGISTRY_CAPABILITY",
    "BatchBuilder",
    "DecodedBatch",
    "ErrorClass",
    "EventRow",
    "Outcome",
    "RowSummary",
    "capability_of",
    "decode_events",
    "decode_raw",
    "denial_event",
    "encode_batch",
    "error_class",
    "make_event",
    "pack_row",
    "read_counts",
    "read_header_counts",
    "summary_headers",
]

#: version of an event's map (``AuditEvent.v``)
EVENT_VERSION = 1
#: version of a batch's layout: 2 keeps plain calls as columns beside the rows
BATCH_VERSION = 2

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
_WIDTH = len(EVENT_FIELDS)

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


_SIDE, _ERROR, _ATTEMPTS, _SKIPPED = (
    EVENT_FIELDS.index(f) for f in ("side", "error", "attempts", "skipped")
)
#: the capability of an event row
capability_of = itemgetter(CAPABILITY_INDEX)

#: packs one event row (rows are built of exact built-in types, so the library's shared
#: packer serves, see ``reach.codec.packb``)
pack_row = packb


class RowSummary:
    """What a batch says about its events: calls per capability, notable rows."""

    __slots__ = ("calls", "notable")

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        #: caller rows the alert rules look at: retried calls, breaker rejections (a call
        #: refused by open breakers, or one that passed an open breaker over)
        self.notable = 0

    def add(self, row: EventRow) -> None:
        if len(row) == _WIDTH and row[_SIDE] == "caller":
            capability = row[CAPABILITY_INDEX]
            self.calls[capability] = self.calls.get(capability, 0) + 1
            if len(row[_ATTEMPTS]) > 1 or row[_ERROR] == "breaker" or row[_SKIPPED]:
                self.notable += 1

    def add_calls(self, capability: str, n: int) -> None:
        """``n`` calls that are not notable."""
        if n:
            self.calls[capability] = self.calls.get(capability, 0) + n


def _plain_names(value: Any) -> tuple[str, ...] | None:
    if type(value) is tuple:
        names: tuple[Any, ...] = value
    elif type(value) is list:
        names = tuple(value)
    else:
        return None
    return names if all(type(name) is str for name in names) else None


def _add_if_plain(columns: PlainColumns, row: EventRow) -> bool:
    """Add ``row`` to ``columns`` if it is a plain call (answered at the first attempt by
    the instance it went to, nothing skipped, no fallback); False if it is not."""
    (side, ts, _cap, call_id, trace_id, caller, caller_agent, callee, outcome, error, code,
     description, latency, candidates, n_candidates, skipped, attempts, fallback,
     fallback_reason) = row  # fmt: skip
    if not (
        side == "caller"
        and outcome == "ok"
        and error is None
        and fallback is None
        and code == ""
        and description == ""
        and fallback_reason == ""
        and type(ts) is float
        and type(latency) is float
        and type(call_id) is str
        and type(trace_id) is str
        and type(caller) is str
        and type(callee) is str
        and (caller_agent is None or type(caller_agent) is str)
        and type(n_candidates) is int
        and 0 <= n_candidates < 2**32
        and type(skipped) in (tuple, list)
        and not skipped
        and type(attempts) in (tuple, list)
        and len(attempts) == 1
    ):
        return False
    attempt = attempts[0]
    if type(attempt) not in (tuple, list) or len(attempt) != len(ATTEMPT_FIELDS):
        return False
    agent_id, score, attempt_outcome, attempt_latency = attempt
    if agent_id != callee or attempt_outcome != "ok" or type(attempt_latency) is not float:
        return False
    if score is not None and (type(score) is not float or score != score):  # NaN: a row
        return False
    names = _plain_names(candidates)
    if names is None:
        return False
    columns.add(
        ts, call_id, trace_id, caller, caller_agent, callee, latency, names, n_candidates,
        score, attempt_latency,
    )  # fmt: skip
    return True


class BatchBuilder:
    """The events of one stream message as they are recorded: plain calls of the
    batch's capability as columns (``reach.audit.columns``), every other event a packed
    row, with its place among them. ``count`` counts them all (whoever adds to
    ``columns`` directly counts it)."""

    __slots__ = ("capability", "columns", "count", "positions", "rows", "summary")

    def __init__(self, capability: str) -> None:
        self.capability = capability
        self.columns = new_columns()
        #: rows packed by ``pack_row``, one after another, and where each one falls
        self.rows = bytearray()
        self.positions: list[int] = []
        self.summary = RowSummary()
        self.count = 0

    @property
    def size(self) -> int:
        """Packed size, estimated."""
        return len(self.rows) + self.columns.size

    @property
    def full(self) -> bool:
        return self.columns.full

    def add_row(self, row: EventRow) -> None:
        """Any event: a plain call of this capability joins the columns, anything else is
        packed as a row. Raises what msgpack raises for a row it cannot pack, adding
        nothing."""
        if not self.add_if_plain(row):
            self.add_packed(row, pack_row(row))

    def add_if_plain(self, row: EventRow) -> bool:
        """Add ``row`` if it is a plain call of this capability; False if it is not."""
        if (
            len(row) == _WIDTH
            and row[CAPABILITY_INDEX] == self.capability
            and not self.columns.full
            and _add_if_plain(self.columns, row)
        ):
            self.count += 1
            return True
        return False

    def add_packed(self, row: EventRow, packed: bytes) -> None:
        """A row that is not a plain call, and ``packed``, what ``pack_row`` made of it."""
        self.rows += packed
        self.positions.append(self.count)
        self.summary.add(row)
        self.count += 1

    def encode(self) -> tuple[bytes, RowSummary, int]:
        """One stream message (``AuditBatch``): ``{"v", "fields", "attempt_fields",
        "calls", "notable", ["positions", "plain",] "events": [row, ...]}``; the summary
        of its events (``summary_headers``); and how many events it had to leave out.

        Columns are packed only here: if one of them cannot be (a name that is not
        valid UTF-8, say), the batch is written as rows instead, each plain call packed on
        its own after the other rows, and only those that cannot be packed are left out.
        """
        summary = RowSummary()
        summary.calls = dict(self.summary.calls)
        summary.notable = self.summary.notable
        n_plain = len(self.columns)
        rows, count, positions = bytes(self.rows), len(self.positions), self.positions
        plain: bytes | None = None
        lost = 0
        if n_plain:
            try:
                plain = msgpack.packb(self.columns.encode(self.capability), use_bin_type=True)
            except (TypeError, ValueError, OverflowError, struct.error):
                packed = []
                for row in _plain_rows(self.columns, self.capability):
                    try:
                        packed.append(pack_row(row))
                    except (TypeError, ValueError, OverflowError):
                        lost += 1
                rows += b"".join(packed)
                count += len(packed)
                positions = list(range(count))
                n_plain = len(packed)
        summary.add_calls(self.capability, n_plain)
        packer = msgpack.Packer(use_bin_type=True)
        parts = [
            packer.pack_map_header(6 if plain is None else 8),
            _HEAD,
            packer.pack("calls"),
            packer.pack(summary.calls),
            packer.pack("notable"),
            packer.pack(summary.notable),
        ]
        if plain is not None:
            parts += (
                packer.pack("positions"),
                packer.pack(positions),
                packer.pack("plain"),
                plain,
            )
        parts += (packer.pack("events"), packer.pack_array_header(count), rows)
        return b"".join(parts), summary, lost


def _plain_rows(columns: PlainColumns, capability: str) -> list[EventRow]:
    """The plain calls of ``columns`` as event rows."""
    return [make_event(**event) for event in plain_events(columns, capability)]


#: the constant entries of every batch (without their map's header)
_HEAD = msgpack.packb(
    {"v": BATCH_VERSION, "fields": EVENT_FIELDS, "attempt_fields": ATTEMPT_FIELDS},
    use_bin_type=True,
)[1:]


def encode_batch(events: Sequence[EventRow]) -> bytes:
    """One stream message from event rows, as the writer makes them: plain calls of the
    first event's capability as columns, the rest as rows (for tests and tools)."""
    capability = next((e[CAPABILITY_INDEX] for e in events if len(e) == _WIDTH), "")
    builder = BatchBuilder(capability)
    for event in events:
        builder.add_row(event)
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
    plain_part = batch.get("plain")
    if plain_part is None:
        return DecodedBatch([e for e in full if e is not None], bad)
    try:
        plain = expand_plain(plain_part)
    except ValueError:
        n = plain_part.get("n") if isinstance(plain_part, dict) else None
        lost = n if type(n) is int and n > 0 else 1
        return DecodedBatch([e for e in full if e is not None], bad + lost)
    for event in plain:
        event["v"] = EVENT_VERSION
    return DecodedBatch(_merge(plain, full, batch.get("positions")), bad)


def _names(value: Any) -> TypeGuard[list[str]]:
    return type(value) is list and all(type(name) is str for name in value)


def _merge(plain: list[dict[str, Any]], full: list[Any], positions: Any) -> list[dict[str, Any]]:
    """Plain events and rows in recorded order (rows after the rest when their positions
    do not fit)."""
    total = len(plain) + len(full)
    if not (
        type(positions) is list
        and len(positions) == len(full)
        and all(type(p) is int and 0 <= p < total for p in positions)
        and all(a < b for a, b in pairwise(positions))
    ):
        return plain + [e for e in full if e is not None]
    out: list[dict[str, Any]] = []
    rest = iter(plain)
    at = 0
    for position, event in zip(positions, full, strict=True):
        while at < position:
            out.append(next(rest))
            at += 1
        if event is not None:
            out.append(event)
        at += 1
    out.extend(rest)
    return out


def decode_raw(data: bytes) -> list[dict[str, Any]]:
    """The events of one stream message as maps, unvalidated (for fast consumers that
    read a few keys with ``.get``); events that do not fit the format are left out."""
    return decode_events(data).events
