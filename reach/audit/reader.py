"""Reading the audit stream: history and live, filtered, one readable line per event."""

from __future__ import annotations

import datetime
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass

from reach import subjects
from reach.audit.records import AuditEvent, decode_batch
from reach.errors import ConfigurationError
from reach.transport import Connection

__all__ = ["AuditFilter", "format_event", "parse_duration", "parse_since", "read_events"]

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNIT = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text: str) -> float:
    """``500ms``, ``30s``, ``10m``, ``2h``, ``7d`` (a bare number is seconds) → seconds."""
    match = _DURATION.match(text)
    if not match:
        raise ConfigurationError(f"{text!r}: expected a duration like 30s, 10m, 2h or 7d")
    return float(match.group(1)) * _UNIT[match.group(2) or "s"]


def parse_since(text: str, now: float) -> float:
    """``10m``, ``2h``, ``30s``, ``1d`` (ago) or an ISO time → Unix seconds."""
    if _DURATION.match(text):
        return now - parse_duration(text)
    try:
        when = datetime.datetime.fromisoformat(text)
    except ValueError:
        raise ConfigurationError(
            f"--since {text!r}: expected a duration like 10m, 2h, 30s or an ISO time"
        ) from None
    if when.tzinfo is None:
        when = when.astimezone()
    return when.timestamp()


@dataclass(frozen=True, slots=True)
class AuditFilter:
    """Which events to show; empty fields match everything."""

    caller: str = ""
    callee: str = ""
    capability: str = ""
    #: an outcome (ok, error, fallback, denied), an error class (timeout, breaker, ...)
    #: or ``retry`` (calls that needed more than one attempt)
    kind: str = ""

    def subject(self) -> str:
        return subjects.audit(self.capability or "*")

    def matches(self, event: AuditEvent) -> bool:
        if self.capability and event.capability != self.capability:
            return False
        if self.caller and self.caller not in (event.caller, event.caller_agent):
            return False
        if self.callee and self.callee not in {
            # served, tried, or passed over because its breaker was open
            event.callee,
            *(a.agent_id for a in event.attempts),
            *event.skipped,
        }:
            return False
        if self.kind == "retry":
            return event.retries > 0
        if self.kind == "breaker" and event.skipped:
            return True  # an open breaker was passed over, even if another instance served
        return not self.kind or self.kind in (event.outcome, event.error)


async def read_events(
    conn: Connection,
    flt: AuditFilter | None = None,
    *,
    since: float | None = None,
    follow: bool = False,
    new_only: bool = False,
) -> AsyncIterator[AuditEvent]:
    """Events of calls started since ``since`` (all history when None); then, with
    ``follow``, live ones. Events are in call order per capability (a stream message
    holds a batch of one capability's events). Malformed entries are skipped."""
    flt = flt or AuditFilter()
    stream = await conn.stream(subjects.AUDIT_STREAM)
    async for msg in stream.read(flt.subject(), since=since, follow=follow, new_only=new_only):
        events, _bad = decode_batch(msg.data)
        for event in events:
            # the stream's time bounds when an event was written; ``since`` is about the call
            if flt.matches(event) and (since is None or event.ts >= since):
                yield event


_COLOURS = {"ok": "green", "fallback": "yellow", "error": "red", "denied": "magenta"}


def format_event(event: AuditEvent, *, colour: bool = False) -> str:
    """One line: time, outcome, caller → callee/capability, latency, route, error."""
    import click  # the CLI's styling; only readers format lines

    when = datetime.datetime.fromtimestamp(event.ts).strftime("%H:%M:%S.%f")[:-3]
    outcome = event.outcome.upper() if event.outcome != "ok" else "ok"
    label = f"{outcome:<8}"
    if colour:
        label = click.style(label, fg=_COLOURS.get(event.outcome, "white"), bold=True)
    who = event.caller_agent or event.caller or "-"
    where = f"{event.capability}@{event.callee or '?'}"
    parts = [when, label, f"{who} → {where}", f"{event.latency_ms:.1f}ms"]
    if event.attempts:
        last = event.attempts[-1]
        score = f"score {last.score:.3f}, " if last.score is not None else ""
        parts.append(f"({score}{event.n_candidates} candidate{'s' * (event.n_candidates != 1)})")
    if event.retries:
        tried = ",".join(f"{a.agent_id or 'queue'}:{a.outcome}" for a in event.attempts)
        parts.append(f"retries {event.retries} [{tried}]")
    if event.skipped:
        parts.append(f"breaker-open {','.join(event.skipped)}")
    if event.error:
        detail = f" {event.code}" if event.code else ""
        parts.append(f"{event.error}{detail}: {event.description}")
    if event.fallback:
        parts.append(f"fallback={event.fallback}")
    parts.append(f"call {event.call_id}")
    return "  ".join(parts)
