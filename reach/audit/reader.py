"""Reading the audit stream: history and live, filtered, one readable line per event."""

from __future__ import annotations

import datetime
import logging
import re
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

from reach.audit.decode import BatchVersionError
from reach.audit.eventmodels import AuditEvent, decode_batch
from reach.audit.provenance import Verdict, verdict
from reach.errors import ConfigurationError
from reach.transport import Connection
from reach.transport.streamreads import read_stream
from reach.wire import subjects

__all__ = [
    "AuditFilter",
    "AuditRecord",
    "format_event",
    "parse_duration",
    "parse_since",
    "read_events",
    "read_records",
]

log = logging.getLogger("reach.audit")

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
    #: the gateway that made calls for their callers (``AuditEvent.actor``)
    actor: str = ""
    #: an outcome (ok, error, fallback, denied), an error class (timeout, breaker, ...)
    #: or ``retry`` (calls that needed more than one attempt)
    kind: str = ""

    def subject(self) -> str:
        # batches stored before subjects named their writer (``reach.v1.audit.<cap>``)
        # are read by the unfiltered form only
        return subjects.audit(self.capability, "*") if self.capability else subjects.AUDIT_ALL

    def matches(self, event: AuditEvent) -> bool:
        if self.capability and event.capability != self.capability:
            return False
        if self.caller and self.caller not in (event.caller, event.caller_agent):
            return False
        if self.actor and self.actor != event.actor:
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


@dataclass(frozen=True, slots=True)
class AuditRecord:
    """An event as stored: what it says, who wrote it (its subject's writer token) and
    whether that writer is who the event says recorded it (``reach.audit.provenance``)."""

    event: AuditEvent
    writer: str
    verdict: Verdict

    @property
    def verified(self) -> bool:
        return self.verdict == "verified"


async def read_records(
    conn: Connection,
    flt: AuditFilter | None = None,
    *,
    since: float | None = None,
    follow: bool = False,
    new_only: bool = False,
    agents: Mapping[str, str | None] | None = None,
) -> AsyncIterator[AuditRecord]:
    """Events of calls started since ``since`` (all history when None); then, with
    ``follow``, live ones, each with its writer and verdict, forged ones too. Events are in
    call order per capability (a stream message holds a batch of one capability's
    events). Malformed entries are skipped, and so is a batch of another version (said
    in the log). ``agents`` (client id → bound agent id, from
    REACH_CREDENTIALS) lets callee-side denials be verified. A stream that does not
    answer for a moment is asked again (``reach.transport.streamreads``)."""
    flt = flt or AuditFilter()
    reading = read_stream(
        conn, subjects.AUDIT_STREAM, flt.subject(), since=since, follow=follow, new_only=new_only
    )
    async for msg in reading:
        writer = subjects.writer_of(msg.subject)
        try:
            events, _bad = decode_batch(msg.data)
        except BatchVersionError as exc:
            log.warning("audit: batch %d on %s skipped: %s", msg.seq, msg.subject, exc)
            continue
        for event in events:
            # the stream's time bounds when an event was written; ``since`` is about the call
            if flt.matches(event) and (since is None or event.ts >= since):
                found = verdict(event.side, event.caller, event.callee, writer, agents, event.actor)
                yield AuditRecord(event, writer, found)


async def read_events(
    conn: Connection,
    flt: AuditFilter | None = None,
    *,
    since: float | None = None,
    follow: bool = False,
    new_only: bool = False,
) -> AsyncIterator[AuditEvent]:
    """The events of ``read_records`` that are not forged: what statistics and the doctor
    count (an event whose writer is not who it names is nobody's call)."""
    async for record in read_records(conn, flt, since=since, follow=follow, new_only=new_only):
        if record.verdict != "forged":
            yield record.event


_COLOURS = {"ok": "green", "fallback": "yellow", "error": "red", "denied": "magenta"}


#: the whole call's time is shown beside the answer's when it took this much longer (a
#: token fetch, a retry, a wait for the connection), not for the caller's own few steps
_CALL_SHOWN_MS = 1.0


def _latency(event: AuditEvent) -> str:
    """The answering attempt's round trip (``reach.audit.stats.LATENCY``), and the whole
    call's time when that was longer; a callee's own event: its handling time, so marked."""
    if event.side == "callee" and not event.attempts:
        return f"{event.latency_ms:.1f}ms handling"
    answer = f"{event.answer_ms:.1f}ms"
    if event.latency_ms - event.answer_ms < _CALL_SHOWN_MS:
        return answer
    return f"{answer} (call {event.latency_ms:.1f}ms)"


def format_event(
    event: AuditEvent,
    *,
    colour: bool = False,
    writer: str | None = None,
    found: Verdict = "verified",
) -> str:
    """One line: time, outcome, caller (``via`` the gateway that called for it, if one
    did) → callee/capability, latency, route, error. With ``writer``: a forged event is
    marked ``FORGED? writer=<id>`` before what it claims, an unverified one (but an open
    fabric's) ``unverified writer=<id>`` at the end."""
    import click  # the CLI's styling; only readers format lines

    when = datetime.datetime.fromtimestamp(event.ts).strftime("%H:%M:%S.%f")[:-3]
    outcome = event.outcome.upper() if event.outcome != "ok" else "ok"
    label = f"{outcome:<8}"
    if colour:
        label = click.style(label, fg=_COLOURS.get(event.outcome, "white"), bold=True)
    who = event.caller_agent or event.caller or "-"
    if event.actor:
        who = f"{who} via {event.actor}"
    where = f"{event.capability}@{event.callee or '?'}"
    parts = [when, label]
    if writer is not None and found == "forged":
        mark = f"FORGED? writer={writer or '?'}"
        parts.append(click.style(mark, fg="red", bold=True) if colour else mark)
    parts += [f"{who} → {where}", _latency(event)]
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
    if writer is not None and found == "unverified" and writer != subjects.ANONYMOUS:
        parts.append(f"unverified writer={writer or '?'}")
    return "  ".join(parts)
