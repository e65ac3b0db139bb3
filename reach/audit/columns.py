"""Plain calls as columns: the compact part of an audit batch.

Most audit events say the same thing: the call went to one instance, once, and it
answered. Such a *plain* event is kept as a slot in a few columns instead of a row of its
own: times and latencies as arrays of little-endian doubles, names as two-byte indexes
into the batch's table of values, trace ids as 16 raw bytes, the candidate list as an
index into the batch's candidate sets. Recording one is a handful of list appends (no
tuple, no msgpack call, nothing for the garbage collector), and it takes far fewer bytes
than a row, which the server stores and every reader reads.

A callee's plain events (a call it answered ok, counted as the call) take the same
columns in a second set with ``side`` "callee": they have no candidates (the empty set),
no score (NaN) and no attempts (their attempt latency is their latency).

The ``actor`` column (the gateway that made a call for its caller) is written only when
one of the calls had one: a batch of calls nobody made for another carries no such
column, and a reader takes a batch without it as calls without an actor.

Everything else (failures, retries, fallbacks, skipped breakers, denials) stays a full
row (``reach.audit.batch``). The format is ``AuditPlain`` in ``reach.audit.eventmodels``
(``schemas/audit-batch.schema.json``).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from typing import Any, Final

from reach.audit.events import CallEvent, attempt

__all__ = [
    "PLAIN_ROW_BYTES",
    "Columns",
    "PlainPart",
    "expand_plain",
]

#: bytes a plain event takes besides its call id and trace id (doubles, indexes, string
#: headers), to estimate a batch's size while it fills (from above: a trace id counts as
#: text, though it usually travels as 16 raw bytes)
PLAIN_ROW_BYTES: Final = 4 * 8 + 4 * 2 + 2 * 3
#: what the actor column adds to each of them, once a call of the batch has an actor
_ACTOR_BYTES: Final = 2
#: distinct names or candidate sets one batch may index (two-byte indexes)
MAX_VALUES: Final = 0xFFFF
_TRACE_HEX: Final = 32
#: (constants, compiled, are read without a lookup per call)
_NAN: Final = math.nan
_IS_ASCII: Final = str.isascii
_UPPER_HEX: Final = "ABCDEF"


def _text_bytes(text: str) -> int:
    """Packed size of ``text`` at most (without its header): UTF-8 takes up to 4 bytes a
    character, and ``isascii`` answers without reading the text."""
    return len(text) if _IS_ASCII(text) else 4 * len(text)


class Columns:
    """The plain events of one batch being filled (all of one capability)."""

    __slots__ = (
        "_actor_known",
        "_agent_known",
        "_last_actor",
        "_last_actor_at",
        "_last_agent",
        "_last_agent_at",
        "_last_callee",
        "_last_callee_at",
        "_last_caller",
        "_last_caller_at",
        "_last_count",
        "_last_names",
        "_last_set",
        "_row_bytes",
        "_set_index",
        "_value_index",
        "actor",
        "any_actor",
        "attempt_latency",
        "call_id",
        "callee",
        "caller",
        "caller_agent",
        "candidates",
        "latency",
        "score",
        "sets",
        "side",
        "size",
        "trace_hex",
        "trace_id",
        "ts",
        "values",
    )

    def __init__(self, side: str = "caller") -> None:
        #: whose plain events: a caller's, or a callee's
        self.side = side
        self.ts: list[float] = []
        self.call_id: list[str] = []
        self.trace_id: list[str] = []
        #: every trace id so far is 32 hex digits, lowercase (so 16 raw bytes say it)
        self.trace_hex = True
        self.caller: list[int] = []
        self.caller_agent: list[int] = []
        self.actor: list[int] = []
        #: some call had an actor (else the batch carries no actor column)
        self.any_actor = False
        self.callee: list[int] = []
        self.latency: list[float] = []
        self.candidates: list[int] = []
        self.score: list[float] = []
        self.attempt_latency: list[float] = []
        #: names the index columns point into, and candidate sets (first names, how many)
        self.values: list[str | None] = []
        self._value_index: dict[str | None, int] = {}
        self.sets: list[tuple[tuple[str, ...], int]] = []
        self._set_index: dict[tuple[tuple[str, ...], int], int] = {}
        self._last_caller: str | None = None
        self._last_caller_at = 0
        self._last_callee: str | None = None
        self._last_callee_at = 0
        self._last_agent: str | None = None
        self._last_agent_at = 0
        self._agent_known = False
        self._last_actor: str | None = None
        self._last_actor_at = 0
        self._actor_known = False
        self._last_names: tuple[str, ...] = ()
        self._last_count = -1
        self._last_set = 0
        #: estimated packed size, and what each event adds to it besides its ids
        self.size = 0
        self._row_bytes = PLAIN_ROW_BYTES

    def __len__(self) -> int:
        return len(self.ts)

    @property
    def full(self) -> bool:
        """No room for another event's names (indexes are two bytes; an event names up
        to four: its caller, the agent it calls from, its actor and its callee)."""
        return len(self.values) > MAX_VALUES - 4 or len(self.sets) >= MAX_VALUES

    def add(self, event: CallEvent) -> None:
        """``event``, a plain call (``reach.audit.batch`` decides which are): answered by
        its callee at the first attempt. ValueError for a count a batch's reader would
        refuse, recording nothing."""
        if event.attempts:
            _agent, score, _outcome, attempt_latency_ms = event.attempts[0]
        else:  # a callee's: no routing, one attempt that is the call
            score, attempt_latency_ms = None, event.latency_ms
        self.add_call(
            ts=event.ts,
            call_id=event.call_id,
            trace_id=event.trace_id,
            caller=event.caller,
            caller_agent=event.caller_agent,
            actor=event.actor,
            callee=event.callee,
            latency_ms=event.latency_ms,
            candidates=event.candidates,
            n_candidates=event.n_candidates,
            score=score,
            attempt_latency_ms=attempt_latency_ms,
        )

    def add_call(
        self,
        *,
        ts: float,
        call_id: str,
        trace_id: str,
        caller: str,
        caller_agent: str | None,
        callee: str,
        latency_ms: float,
        candidates: tuple[str, ...],
        n_candidates: int,
        score: float | None,
        attempt_latency_ms: float,
        actor: str | None = None,
    ) -> None:
        """A plain call by its fields (``CallEvent``'s, by name; ``score`` and
        ``attempt_latency_ms`` its one attempt's): what ``add`` records of an event, for
        a caller that has the fields at hand and no event built. ValueError for a count a
        batch's reader would refuse, recording nothing."""
        if not 0 <= n_candidates <= 0xFFFFFFFF:
            raise ValueError("Columns.add: n_candidates must be in [0, 2**32)")
        # a caller's own id, its callee's, the agent it calls for and the gateway that
        # calls for it (None, mostly) are the same objects call after call: an identity
        # check instead of a lookup
        if caller is not self._last_caller:
            self._last_caller_at = self._value(caller)
            self._last_caller = caller
        if caller_agent is not self._last_agent or not self._agent_known:
            self._last_agent_at = self._value(caller_agent)
            self._last_agent = caller_agent
            self._agent_known = True
        if actor is not self._last_actor or not self._actor_known:
            self._last_actor_at = self._value(actor)
            self._last_actor = actor
            self._actor_known = True
            if actor is not None and not self.any_actor:
                # the column is written from now on, for the events before this one too
                self.any_actor = True
                self._row_bytes = PLAIN_ROW_BYTES + _ACTOR_BYTES
                self.size += _ACTOR_BYTES * len(self.ts)
        if callee is not self._last_callee:
            self._last_callee_at = self._value(callee)
            self._last_callee = callee
        if candidates is self._last_names and n_candidates == self._last_count:
            at = self._last_set  # the route cache hands out one tuple until it changes
        else:
            key = (candidates, n_candidates)
            found = self._set_index.get(key)
            if found is None:
                found = self._set_index[key] = len(self.sets)
                self.sets.append(key)
                self.size += 10 + sum(_text_bytes(name) + 3 for name in candidates)
            at = self._last_set = found
            self._last_names = candidates
            self._last_count = n_candidates
        # every lookup above is done: the appends below cannot fail part way
        self.ts.append(ts)
        self.call_id.append(call_id)
        self.trace_id.append(trace_id)
        if len(trace_id) != _TRACE_HEX:
            self.trace_hex = False
        self.caller.append(self._last_caller_at)
        self.caller_agent.append(self._last_agent_at)
        self.actor.append(self._last_actor_at)
        self.callee.append(self._last_callee_at)
        self.latency.append(latency_ms)
        self.candidates.append(at)
        self.score.append(_NAN if score is None else score)
        self.attempt_latency.append(attempt_latency_ms)
        self.size += self._row_bytes + _text_bytes(call_id) + _text_bytes(trace_id)

    def _value(self, value: str | None) -> int:
        at = self._value_index.get(value)
        if at is None:
            at = self._value_index[value] = len(self.values)
            self.values.append(value)
            self.size += 3 + (_text_bytes(value) if value is not None else 0)
        return at

    def events(self, capability: str) -> list[CallEvent]:
        """The events in the columns so far, in the order they were recorded."""
        values, sets = self.values, self.sets
        events: list[CallEvent] = []
        for i in range(len(self.ts)):
            names, count = sets[self.candidates[i]]
            callee = values[self.callee[i]]
            assert callee is not None  # (only caller_agent and actor may be None)
            caller = values[self.caller[i]]
            assert caller is not None
            score = self.score[i]
            callee_side = self.side == "callee"
            events.append(
                CallEvent(
                    side="callee" if callee_side else "caller",
                    ts=self.ts[i],
                    capability=capability,
                    call_id=self.call_id[i],
                    trace_id=self.trace_id[i],
                    caller=caller,
                    caller_agent=values[self.caller_agent[i]],
                    actor=values[self.actor[i]],
                    callee=callee,
                    outcome="ok",
                    latency_ms=self.latency[i],
                    candidates=names,
                    n_candidates=count,
                    attempts=()
                    if callee_side
                    else (
                        attempt(
                            agent_id=callee,
                            score=None if math.isnan(score) else score,
                            latency_ms=self.attempt_latency[i],
                        ),
                    ),
                )
            )
        return events

    def encode(self, capability: str) -> dict[str, Any]:
        """The batch's ``plain`` map."""
        n = len(self.ts)
        doubles = struct.Struct(f"<{n}d").pack
        indexes = struct.Struct(f"<{n}H").pack
        trace: bytes | list[str] = self.trace_id
        if self.trace_hex:
            joined = "".join(self.trace_id)
            try:
                raw = bytes.fromhex(joined)
            except ValueError:
                raw = b""
            # lowercase hex digits and nothing else: fromhex skips whitespace (every id
            # has 32 characters, so there would be fewer bytes) and takes upper case
            if len(raw) == 16 * n and not any(c in joined for c in _UPPER_HEX):
                trace = raw
        out: dict[str, Any] = {
            "n": n,
            "capability": capability,
            "ts": doubles(*self.ts),
            "call_id": self.call_id,
            "trace_id": trace,
            "caller": indexes(*self.caller),
            "caller_agent": indexes(*self.caller_agent),
            "callee": indexes(*self.callee),
            "latency_ms": doubles(*self.latency),
            "candidates": indexes(*self.candidates),
            "score": doubles(*self.score),
            "attempt_latency_ms": doubles(*self.attempt_latency),
            "values": self.values,
            "candidate_sets": [[list(names), count] for names, count in self.sets],
        }
        if self.any_actor:
            out["actor"] = indexes(*self.actor)
        if self.side != "caller":
            out["side"] = self.side
        return out


def _doubles(value: Any, n: int) -> tuple[float, ...]:
    if type(value) is not bytes or len(value) != 8 * n:
        raise ValueError("a column of doubles of the wrong size")
    return struct.unpack(f"<{n}d", value)


def _indexes(value: Any, n: int, table: Sequence[Any]) -> tuple[int, ...]:
    if type(value) is not bytes or len(value) != 2 * n:
        raise ValueError("a column of indexes of the wrong size")
    found: tuple[int, ...] = struct.unpack(f"<{n}H", value)
    if n and max(found) >= len(table):
        raise ValueError("an index past its table")
    return found


def _strings(value: Any, n: int) -> list[str]:
    if type(value) is not list or len(value) != n or not all(type(s) is str for s in value):
        raise ValueError("a column of strings of the wrong size or type")
    return value


def _traces(value: Any, n: int) -> list[str]:
    if type(value) is bytes and len(value) == 16 * n:
        text = value.hex()
        return [text[i : i + _TRACE_HEX] for i in range(0, len(text), _TRACE_HEX)]
    return _strings(value, n)


def _sets(value: Any) -> list[tuple[list[str], int]]:
    if type(value) is not list:
        raise ValueError("candidate sets are not a list")
    out: list[tuple[list[str], int]] = []
    for item in value:
        if type(item) is not list or len(item) != 2:
            raise ValueError("a candidate set is not [names, count]")
        names, count = item
        if type(count) is not int or count < 0:
            raise ValueError("a candidate set's count is not a count")
        out.append((_strings(names, len(names) if type(names) is list else -1), count))
    return out


class PlainPart:
    """A batch's ``plain`` map, checked, its columns decoded: every event ok at its first
    attempt, names as indexes into ``values``, candidate lists into ``sets``."""

    __slots__ = (
        "actor", "attempt_latency", "call_id", "callee", "caller", "caller_agent",
        "candidates", "capability", "latency", "score", "sets", "side", "trace_id", "ts",
        "values",
    )  # fmt: skip

    def __init__(self, plain: Any) -> None:
        """ValueError names what does not fit the format."""
        if type(plain) is not dict:
            raise ValueError("the plain part is not a map")
        n = plain.get("n")
        capability = plain.get("capability")
        if type(n) is not int or n < 0:
            raise ValueError("the plain part has no count")
        if type(capability) is not str:
            raise ValueError("the plain part has no capability")
        side = plain.get("side", "caller")
        if side not in ("caller", "callee"):
            raise ValueError("the plain part's side is neither caller nor callee")
        values = plain.get("values")
        if type(values) is not list or not all(v is None or type(v) is str for v in values):
            raise ValueError("the plain part's values are not names")
        sets = _sets(plain.get("candidate_sets"))
        self.side: str = side
        self.capability: str = capability
        self.values: list[str | None] = values
        self.sets = sets
        self.ts = _doubles(plain.get("ts"), n)
        self.latency = _doubles(plain.get("latency_ms"), n)
        self.score = _doubles(plain.get("score"), n)
        self.attempt_latency = _doubles(plain.get("attempt_latency_ms"), n)
        self.call_id = _strings(plain.get("call_id"), n)
        self.trace_id = _traces(plain.get("trace_id"), n)
        self.caller = _indexes(plain.get("caller"), n, values)
        self.caller_agent = _indexes(plain.get("caller_agent"), n, values)
        actor = plain.get("actor")
        #: None: a batch without the column (no call had an actor)
        self.actor = None if actor is None else _indexes(actor, n, values)
        self.callee = _indexes(plain.get("callee"), n, values)
        self.candidates = _indexes(plain.get("candidates"), n, sets)


def expand_plain(plain: Any) -> list[dict[str, Any]]:
    """The events of a batch's ``plain`` map as event maps (``AuditEvent``'s fields), in
    the order they were recorded; ValueError names what does not fit the format."""
    p = PlainPart(plain)
    return _event_maps(
        p.side, p.capability, p.ts, p.call_id, p.trace_id, p.caller, p.caller_agent, p.actor,
        p.callee, p.latency, p.candidates, p.score, p.attempt_latency, p.values, p.sets,
    )  # fmt: skip


def _event_maps(
    side: str,
    capability: str,
    ts: Sequence[float],
    call_id: Sequence[str],
    trace_id: Sequence[str],
    caller: Sequence[int],
    caller_agent: Sequence[int],
    actor: Sequence[int] | None,
    callee: Sequence[int],
    latency: Sequence[float],
    candidates: Sequence[int],
    score: Sequence[float],
    attempt_latency: Sequence[float],
    values: Sequence[str | None],
    sets: Sequence[tuple[Sequence[str], int]],
) -> list[dict[str, Any]]:
    """Plain events as event maps, from their columns (decoded, or being filled);
    ``actor`` None: no call had one."""
    events: list[dict[str, Any]] = []
    callee_side = side == "callee"
    for i in range(len(ts)):
        names, count = sets[candidates[i]]
        agent = values[callee[i]]
        events.append(
            {
                "side": side,
                "ts": ts[i],
                "capability": capability,
                "call_id": call_id[i],
                "trace_id": trace_id[i],
                "caller": values[caller[i]],
                "caller_agent": values[caller_agent[i]],
                "actor": None if actor is None else values[actor[i]],
                "callee": agent,
                "outcome": "ok",
                "error": None,
                "code": "",
                "description": "",
                "latency_ms": latency[i],
                "candidates": list(names),
                "n_candidates": count,
                "skipped": [],
                "attempts": []
                if callee_side
                else [
                    {
                        "agent_id": agent,
                        "score": None if math.isnan(score[i]) else score[i],
                        "outcome": "ok",
                        "latency_ms": attempt_latency[i],
                    }
                ],
                "fallback": None,
                "fallback_reason": "",
                "primary": True,
            }
        )
    return events
