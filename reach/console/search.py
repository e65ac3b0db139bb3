"""The calls page's search of the audit stream: by call id, caller, callee, capability,
outcome and time range, each call's events merged (``reach.audit.merge``) as
``reach audit tail`` shows them.

A search reads the stream from the start of its range, so it is bounded: ``MAX_SCANNED``
events at most, ``MAX_SHOWN`` calls shown (the newest), and it says when it stopped at a
bound.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from reach.audit.merge import MergedCall, merged
from reach.audit.reader import AuditFilter, AuditRecord, parse_since, read_records
from reach.errors import ConfigurationError, ReachError
from reach.security.credentials import CredentialStore
from reach.transport import Connection

__all__ = ["KINDS", "MAX_SCANNED", "MAX_SHOWN", "CallQuery", "SearchResult", "search"]

#: what the outcome field takes (as ``reach audit tail --kind``)
KINDS = (
    "ok", "error", "fallback", "denied", "retry", "connect", "timeout", "business",
    "breaker", "contract", "unavailable", "discovery", "internal",
)  # fmt: skip
MAX_SCANNED = 500_000
MAX_SHOWN = 200
#: where a search starts when its form names no time
DEFAULT_SINCE = "1h"


@dataclass(frozen=True)
class CallQuery:
    """A search as the form states it; ``parse`` checks it."""

    call_id: str = ""
    caller: str = ""
    callee: str = ""
    capability: str = ""
    kind: str = ""
    since: str = DEFAULT_SINCE
    until: str = ""

    @classmethod
    def parse(cls, params: dict[str, str]) -> CallQuery:
        query = cls(
            **{
                name: params.get(name, "").strip()[:200]
                for name in ("call_id", "caller", "callee", "capability", "kind", "until")
            },
            since=params.get("since", "").strip()[:200] or DEFAULT_SINCE,
        )
        if query.kind and query.kind not in KINDS:
            raise ConfigurationError(f"outcome {query.kind!r}: expected one of {', '.join(KINDS)}")
        return query

    def bounds(self, now: float) -> tuple[float, float | None]:
        """(since, until) in Unix seconds; ConfigurationError naming a bad one."""
        since = parse_since(self.since, now)
        until = parse_since(self.until, now) if self.until else None
        if until is not None and until < since:
            raise ConfigurationError(f"until {self.until!r} is before since {self.since!r}")
        return since, until

    @property
    def filter(self) -> AuditFilter:
        return AuditFilter(self.caller, self.callee, self.capability, self.kind)


@dataclass
class SearchResult:
    calls: list[MergedCall] = field(default_factory=list)
    scanned: int = 0
    #: why the result may be incomplete ("" when it is not)
    stopped: str = ""


async def _agents_of(conn: Connection) -> dict[str, str | None] | None:
    """Client id → bound agent id, when the credential may read REACH_CREDENTIALS (what
    verifies a callee's denial, as in ``reach audit tail``); else None."""
    try:
        store = await CredentialStore.open(conn, create=False)
        return {record.client_id: record.agent_id for record in await store.list()}
    except ReachError:
        return None


async def search(conn: Connection, query: CallQuery, now: float | None = None) -> SearchResult:
    """The calls matching ``query``, oldest first (the newest ``MAX_SHOWN``)."""
    since, until = query.bounds(time.time() if now is None else now)
    result = SearchResult()
    agents = await _agents_of(conn)
    #: call id → its records, in the order of each call's first record; the oldest
    #: calls are let go beyond twice what is shown (a call's later events come soon after
    #: its first, so the calls kept are whole)
    groups: dict[str, list[AuditRecord]] = {}
    lone = 0
    async for record in read_records(conn, query.filter, since=since, agents=agents):
        result.scanned += 1
        if result.scanned > MAX_SCANNED:
            result.stopped = f"stopped after {MAX_SCANNED} events: narrow the search"
            break
        event = record.event
        if (query.call_id and event.call_id != query.call_id) or (
            until is not None and event.ts > until
        ):
            continue
        key = event.call_id
        if not key:  # an event without a call id is a call of its own
            lone += 1
            key = f"\0{lone}"
        groups.setdefault(key, []).append(record)
        if len(groups) > 2 * MAX_SHOWN:
            del groups[next(iter(groups))]
            result.stopped = f"the newest {MAX_SHOWN} calls shown"
    calls = [merged(group) for group in groups.values()]
    if len(calls) > MAX_SHOWN:
        result.stopped = result.stopped or f"the newest {MAX_SHOWN} calls shown"
        calls = calls[-MAX_SHOWN:]
    result.calls = calls
    return result
