"""``reach doctor``: the troubleshooting order of docs/architecture.md, walked step by step.

1. registry — does the target exist, is it healthy, why was it marked down?
2. route log — which instances did calls go to, with what score, any retries?
3. connectivity — does each instance answer a probe now, and how fast?
4. the agent — did requests arrive, did the handler fail or stall?
5. dependencies — the agent's readiness report (pools, queues)
6. the fabric — registrar alive, its JetStream store taking writes (a full disk stops
   them: the registrars say so), registry records kept, breaker states, audit events
   dropped (``audit_dropped`` alerts) or waiting in spools on this machine

Each step gives a verdict (ok / warn / fail / skip) with its evidence; the diagnosis
ends with the layer most likely at fault. The logic is a pure function of what was
gathered (:func:`conclude`), so every rule is testable without a fabric.
"""

from __future__ import annotations

import asyncio
import difflib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from reach.audit.alerts import Alert, decode_alert
from reach.audit.eventmodels import AuditEvent
from reach.audit.reader import AuditFilter, read_events
from reach.audit.spool import SpoolSurvey, survey
from reach.audit.stats import CallStats
from reach.errors import (
    ConfigurationError,
    NoResponders,
    PermissionDenied,
    ReachError,
    ReachTimeout,
)
from reach.registry.probes import ProbeResult, probe
from reach.registry.store import RegistryStore
from reach.settings import resolve_audit_spool
from reach.transport import Connection
from reach.transport.storestate import problem_in_ping_answer
from reach.transport.streamreads import read_stream
from reach.wire import subjects
from reach.wire.models import Instance, RegistrarRecord

__all__ = ["LAYERS", "Diagnosis", "Evidence", "Step", "conclude", "diagnose"]

Verdict = Literal["ok", "warn", "fail", "skip"]
#: the layers a diagnosis can blame, in troubleshooting order
LAYERS = ("registry", "routing", "connectivity", "agent", "dependencies", "fabric")
Layer = Literal["registry", "routing", "connectivity", "agent", "dependencies", "fabric", "none"]


@dataclass(frozen=True, slots=True)
class Step:
    number: int
    name: str
    verdict: Verdict
    findings: list[str]


@dataclass
class Evidence:
    """Everything the six steps look at, gathered once."""

    target: str
    now: float
    instances: list[Instance] = field(default_factory=list)
    #: the target is a capability (else an agent id, or unknown)
    capability: str | None = None
    #: audit events of the target in the window (caller side and denials)
    events: list[AuditEvent] = field(default_factory=list)
    audit_error: str = ""
    probes: dict[str, ProbeResult] = field(default_factory=dict)
    registrars: list[RegistrarRecord] = field(default_factory=list)
    registrar_answered: bool = False
    #: what the registrars say is wrong with the fabric's JetStream store ("" for nothing)
    store_problem: str = ""
    window_sec: float = 600.0
    #: ``audit_dropped`` alerts in the window: writers that lost events
    audit_drops: list[Alert] = field(default_factory=list)
    #: audit spools on this machine holding events REACH_AUDIT has not acked
    spools: list[SpoolSurvey] = field(default_factory=list)
    #: every capability and agent id in the registry (for the names close to an unknown one)
    known: list[str] = field(default_factory=list)


#: ``audit_dropped`` alerts doctor reads at most (the latest)
DROP_ALERTS_READ = 100


@dataclass(frozen=True, slots=True)
class Diagnosis:
    target: str
    steps: list[Step]
    layer: Layer
    conclusion: str


async def diagnose(
    conn: Connection,
    target: str,
    *,
    window_sec: float = 600.0,
    probe_timeout: float = 2.0,
    servers: Sequence[str] | None = None,
) -> Diagnosis:
    """Gather the evidence for ``target`` (a capability or an agent id) and conclude;
    ``servers``: the fabric's URLs, whose audit spools on this machine are looked at
    (None: every fabric's)."""
    evidence = await gather(
        conn, target, window_sec=window_sec, probe_timeout=probe_timeout, servers=servers
    )
    return conclude(evidence)


async def gather(
    conn: Connection,
    target: str,
    *,
    window_sec: float = 600.0,
    probe_timeout: float = 2.0,
    servers: Sequence[str] | None = None,
) -> Evidence:
    now = time.time()
    ev = Evidence(target=target, now=now, window_sec=window_sec)
    spool_root = resolve_audit_spool()
    ev.spools = survey(spool_root, servers) if spool_root is not None else []
    ev.audit_drops = await _audit_drops(conn, now - window_sec)
    try:
        store = await RegistryStore.open(conn, create=False)
    except ConfigurationError:
        return ev  # no registry at all: step 6 says so
    everything, ev.registrars = await store.snapshot()
    ev.known = sorted(
        {c.name for i in everything for c in i.manifest.capabilities}
        | {i.agent_id for i in everything}
    )
    by_id = [i for i in everything if i.agent_id == target]
    if by_id:
        ev.instances = by_id
    else:
        ev.capability = target
        ev.instances = [i for i in everything if i.manifest.capability(target) is not None]
    flt = AuditFilter(capability=target) if ev.capability else AuditFilter(callee=target)
    try:
        ev.events = [e async for e in read_events(conn, flt, since=now - window_sec, follow=False)]
        if not ev.instances and not ev.events and ev.capability:
            # not registered and no calls to it as a capability: an agent id that left?
            flt = AuditFilter(callee=target)
            since = now - window_sec
            ev.events = [e async for e in read_events(conn, flt, since=since, follow=False)]
            if ev.events:
                ev.capability = None
    except ReachError as exc:
        ev.audit_error = f"{type(exc).__name__}: {exc}"
    results = await asyncio.gather(
        *(probe(conn, inst, timeout=probe_timeout) for inst in ev.instances)
    )
    ev.probes = {inst.agent_id: r for inst, r in zip(ev.instances, results, strict=True)}
    try:
        answer = await conn.request(subjects.REGISTRAR_PING, b"", timeout=probe_timeout)
        ev.registrar_answered = True
        ev.store_problem = problem_in_ping_answer(answer) or ""
    except ReachError:
        ev.registrar_answered = False
    return ev


async def _audit_drops(conn: Connection, since: float) -> list[Alert]:
    """The ``audit_dropped`` alerts since ``since`` (none if REACH_ALERTS is unreadable)."""
    found: list[Alert] = []
    try:
        alerts = subjects.alert("audit_dropped")
        async for msg in read_stream(conn, subjects.ALERTS_STREAM, alerts, since=since):
            alert = decode_alert(msg.data)
            if alert is not None:
                found.append(alert)
    except ReachError:
        pass
    return found[-DROP_ALERTS_READ:]


def _ago(seconds: float) -> str:
    """How long ago, said plainly (a moment from another process's clock may be a
    little ahead of this one's: just now)."""
    if seconds < 1:
        return "just now"
    if seconds < 90:
        return f"{seconds:.0f}s ago"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago"


def conclude(ev: Evidence) -> Diagnosis:
    """The six verdicts and the layer most likely at fault."""
    blame: list[tuple[Layer, str]] = []
    stats = CallStats(window_sec=ev.window_sec)  # steps 2 and 6 read the same calls
    for event in ev.events:
        stats.add(event)
    # what the calls' failures suggest (step 2) counts only when no step found its cause
    hints: list[tuple[Layer, str]] = []
    steps = [
        _registry_step(ev, blame),
        _route_step(ev, stats, hints),
        _connectivity_step(ev, blame),
        _agent_step(ev, blame),
        _dependencies_step(ev, blame),
        _fabric_step(ev, stats, blame),
    ]
    blame += hints
    if ev.store_problem:
        # nothing the fabric keeps can be written: first, whatever else went wrong after it
        blame.insert(0, ("fabric", f"the JetStream store takes no writes: {ev.store_problem}"))
    if blame:
        layer, why = blame[0]
    else:
        layer, why = "none", "every step passed: calls to it should succeed"
    return Diagnosis(ev.target, steps, layer, why)


def _registry_step(ev: Evidence, blame: list[tuple[Layer, str]]) -> Step:
    findings: list[str] = []
    if not ev.instances:
        if ev.capability is None:  # an agent id that left: what its own attempts saw
            outcomes = [a.outcome for e in ev.events for a in e.attempts if a.agent_id == ev.target]
            gone = [ev.target] if outcomes else []
        else:
            outcomes = [e.error or e.outcome for e in ev.events]
            gone = sorted(
                {e.callee for e in ev.events if e.callee}
                | {a.agent_id for e in ev.events for a in e.attempts if a.agent_id}
            )
        what = "capability or agent id"
        findings.append(f"no registered instance: no agent offers {ev.target!r} and no {what}")
        if gone:
            findings.append(f"calls went to {', '.join(gone)} earlier: evicted since")
        last: dict[str, int] = {}
        for outcome in outcomes[-5:]:
            last[outcome] = last.get(outcome, 0) + 1
        told = ", ".join(f"{n} {kind}" for kind, n in last.items())
        why = f"; of its last {sum(last.values())} calls: {told}" if last else ""
        blame.append(
            (
                "registry",
                f"{ev.target} is not in the registry"
                + (f" (evicted{why})" if gone else f" (unknown name?{_close_to(ev)})"),
            )
        )
        return Step(1, "registry", "fail", findings)
    healthy = 0
    for inst in ev.instances:
        line = f"{inst.agent_id} v{inst.manifest.version}: {inst.status}"
        if inst.status != "healthy":
            line += f" — {inst.status_reason}"
        else:
            healthy += 1
        findings.append(line)
        for t in inst.transitions[-3:]:
            findings.append(f"  {_ago(ev.now - t.at)}: → {t.status} ({t.reason})")
    verdict: Verdict = "ok" if healthy == len(ev.instances) else "warn" if healthy else "fail"
    return Step(1, "registry", verdict, findings)


def _close_to(ev: Evidence) -> str:
    """The registered names close to the unknown target, as " did you mean …?"."""
    close = difflib.get_close_matches(ev.target, ev.known, n=3, cutoff=0.6)
    return f" did you mean {' or '.join(close)}?" if close else ""


def _route_step(ev: Evidence, stats: CallStats, blame: list[tuple[Layer, str]]) -> Step:
    if ev.audit_error:
        return Step(2, "route log", "skip", [f"audit stream unreadable: {ev.audit_error}"])
    calls = stats.events
    if not calls:
        findings = [f"no calls in the last {ev.window_sec / 60:.0f} min"]
        if stats.denials:
            findings.append(f"{len(stats.denials)} call(s) denied by the callee (security)")
            blame.append(("fabric", f"{len(stats.denials)} call(s) denied: check clearance"))
            return Step(2, "route log", "warn", findings)
        return Step(2, "route log", "ok", findings)
    failed = [e for e in calls if e.outcome != "ok"]
    retried = sum(e.retries for e in calls)
    findings = [
        f"{len(calls)} call(s) in the last {ev.window_sec / 60:.0f} min:"
        f" {len(calls) - len(failed)} ok, {len(failed)} failed, {retried} retries"
    ]
    for agent_id, tally in sorted(stats.by_instance().items()):
        p99 = tally.p(0.99)
        findings.append(
            f"  {agent_id}: {tally.calls} call(s), {tally.ok} ok"
            + (f", p99 {p99:.1f} ms" if p99 is not None else "")
            + (f", breaker skipped it {tally.breaker_skips}×" if tally.breaker_skips else "")
            + (f", last error {tally.last_error}" if tally.last_error else "")
        )
    for event in calls[-3:]:
        route = ", ".join(
            f"{a.agent_id or 'queue'}"
            + (f" (score {a.score:.3f})" if a.score is not None else "")
            + f" → {a.outcome}"
            for a in event.attempts
        )
        findings.append(
            f"  {_ago(ev.now - event.ts)}: {event.outcome} via {route or 'no instance'}"
        )
    if stats.denials:
        findings.append(f"{len(stats.denials)} call(s) denied by the callee (security)")
    # what the calls' own failures point at: weaker evidence than a probe or a record, so
    # the other steps' findings come first (conclude)
    counts: dict[str, int] = {}
    for event in failed:
        error_kind: str = event.error or event.outcome
        counts[error_kind] = counts.get(error_kind, 0) + 1
    latest = failed[-1] if failed and failed[-1] is calls[-1] else None
    for error_kind, n in sorted(counts.items(), key=lambda kv: -kv[1]):
        hint = _FAILURE_HINTS.get(error_kind)
        # a stray failure long ago says little: a fair share of the calls, or the latest
        current = latest is not None and (latest.error or latest.outcome) == error_kind
        if hint is not None and (n >= HINT_SHARE * len(calls) or current):
            blame.append((hint[0], f"{n} of {len(calls)} recent call(s): {hint[1]}"))
    if stats.denials and "denied" not in counts:
        blame.append(("fabric", f"{len(stats.denials)} call(s) denied: check clearance"))
    verdict: Verdict = "ok" if not failed else "warn" if len(failed) < len(calls) else "fail"
    return Step(2, "route log", verdict, findings)


#: share of the recent calls a failure class needs to be named as the likely cause
#: (unless the latest call failed so)
HINT_SHARE = 0.1

#: what a recent call's error class suggests, and in which layer
_FAILURE_HINTS: dict[str, tuple[Layer, str]] = {
    "business": ("agent", "rejected by the handler (business)"),
    "contract": ("agent", "refused by the contract (payload or output schema)"),
    "internal": ("agent", "the handler failed (internal error)"),
    "timeout": ("agent", "timed out: the handler is slower than the SLA, or hung"),
    "connect": ("connectivity", "reached no instance (no responders)"),
    "unavailable": ("dependencies", "instances alive but not taking calls (not ready, full)"),
    "breaker": ("fabric", "refused by open circuit breakers"),
    "denied": ("fabric", "denied: the caller's clearance or token (security)"),
    "discovery": ("registry", "no instance found to route to"),
}


def _connectivity_step(ev: Evidence, blame: list[tuple[Layer, str]]) -> Step:
    if not ev.instances:
        return Step(3, "connectivity", "skip", ["nothing to probe"])
    findings: list[str] = []
    answered = refused = 0
    for inst in ev.instances:
        result = ev.probes.get(inst.agent_id)
        if result is None:
            continue
        if result.ok:
            answered += 1
            findings.append(f"{inst.agent_id}: answered a probe in {result.latency_ms:.1f} ms")
            continue
        if isinstance(result.error, PermissionDenied):
            # these credentials may not probe: nothing is known of the agent from here
            refused += 1
            findings.append(
                f"{inst.agent_id}: not probed: NATS refused these credentials its probe"
                " subject (run doctor with an admin's credentials)"
            )
            continue
        findings.append(f"{inst.agent_id}: no answer: {result.reason}")
        if isinstance(result.error, NoResponders):
            blame.append(
                (
                    "connectivity",
                    f"{inst.agent_id} is gone: nothing subscribes to its probe subject"
                    " (process dead or disconnected)",
                )
            )
        elif isinstance(result.error, ReachTimeout):
            blame.append(
                (
                    "agent",
                    f"{inst.agent_id} is hung: connected (NATS delivers to it) but it does not"
                    f" answer within {result.latency_ms / 1000:.1f}s",
                )
            )
        else:
            blame.append(("connectivity", f"{inst.agent_id}: {result.reason}"))
    failed = len(ev.instances) - answered - refused
    verdict: Verdict = (
        "fail"
        if failed and not answered
        else "warn"
        if failed
        else "skip"
        if refused and not answered
        else "ok"
    )
    return Step(3, "connectivity", verdict, findings)


def _agent_step(ev: Evidence, blame: list[tuple[Layer, str]]) -> Step:
    if not ev.instances:
        return Step(4, "agent", "skip", ["no instance"])
    findings: list[str] = []
    verdict: Verdict = "ok"
    for inst in ev.instances:
        result = ev.probes.get(inst.agent_id)
        # the probe's answer is now; the record is written only when a figure callers
        # route on moved, so its counts may be old
        reply = result.reply if result else None
        in_flight = reply.in_flight if reply else inst.in_flight
        last = (reply.last_completion_at if reply else None) or inst.last_completion_at
        completed = reply.completed if reply and reply.completed is not None else inst.completed
        done = f"last completion {_ago(ev.now - last)}" if last else "no completion yet"
        findings.append(
            f"{inst.agent_id}: {in_flight}/{inst.max_concurrency} in flight,"
            f" {completed} completed, {done};"
            f" record last written {_ago(ev.now - inst.last_heartbeat_at)}"
        )
        sla = max((c.latency_sla_ms for c in inst.manifest.capabilities), default=1000.0)
        stalled_for = ev.now - (last or inst.registered_at)
        if in_flight > 0 and stalled_for > max(30.0, 3 * sla / 1000):
            verdict = "fail"
            blame.append(
                (
                    "agent",
                    f"{inst.agent_id} has {in_flight} call(s) in flight and completed nothing"
                    f" for {stalled_for:.0f}s: its handler stalls",
                )
            )
    return Step(4, "agent", verdict, findings)


def _dependencies_step(ev: Evidence, blame: list[tuple[Layer, str]]) -> Step:
    if not ev.instances:
        return Step(5, "dependencies", "skip", ["no instance"])
    findings: list[str] = []
    verdict: Verdict = "ok"
    for inst in ev.instances:
        result = ev.probes.get(inst.agent_id)
        readiness = result.reply.readiness if result and result.reply else inst.readiness
        source = "now" if result and result.reply else "last reported"
        details = ", ".join(f"{k}={v}" for k, v in sorted(readiness.details.items()))
        state = "ready" if readiness.ready else f"NOT READY: {readiness.reason}"
        findings.append(
            f"{inst.agent_id} ({source}): {state}" + (f" [{details}]" if details else "")
        )
        if not readiness.ready:
            verdict = "fail"
            blame.append(
                (
                    "dependencies",
                    f"{inst.agent_id} reports itself not ready: {readiness.reason}"
                    + (f" [{details}]" if details else ""),
                )
            )
    return Step(5, "dependencies", verdict, findings)


def _fabric_step(ev: Evidence, stats: CallStats, blame: list[tuple[Layer, str]]) -> Step:
    findings: list[str] = []
    verdict: Verdict = "ok"
    live = [r for r in ev.registrars if ev.now - r.seen_at < 3 * r.interval_sec]
    if ev.registrar_answered or live:
        ids = ", ".join(r.registrar_id for r in live) or "(answered a ping)"
        findings.append(f"registrar alive: {ids}")
    else:
        verdict = "fail"
        findings.append("no registrar answers and none refreshed its record: health is unkept")
        blame.append(("fabric", "no registrar is running: nothing probes or evicts instances"))
    if ev.store_problem:
        verdict = "fail"
        findings.append(
            f"JetStream store takes NO WRITES: {ev.store_problem}; registry records, audit"
            " events and alerts are not stored until space is freed on the disk of the"
            " server's store (audit events wait in their writers' memory and spools)"
        )
    # records change on a change only; a running registrar marks and evicts the silent
    kept = "kept" if ev.registrar_answered or live else "UNKEPT (no registrar)"
    for inst in ev.instances:
        interval = inst.manifest.health.interval_sec
        age = ev.now - inst.last_heartbeat_at
        findings.append(
            f"{inst.agent_id}: registry record {kept} (last written {age:.1f}s ago, on a"
            f" change; heartbeats every {interval:g}s)"
        )
    open_now = stats.open_breakers(ev.now, within_sec=60.0)
    rejected = [e for e in stats.events if e.error == "breaker" and ev.now - e.ts < 60.0]
    for agent_id, seen in sorted(open_now.items()):
        findings.append(f"breaker OPEN for {agent_id} at a caller (seen {_ago(ev.now - seen)})")
    if rejected:
        findings.append(f"{len(rejected)} call(s) rejected by open breakers in the last minute")
    if open_now or rejected:
        verdict = "fail" if verdict == "ok" else verdict
        who = ", ".join(sorted(open_now)) or ev.target
        blame.append(
            (
                "fabric",
                f"circuit breaker open for {who}: callers skip it until a half-open trial succeeds",
            )
        )
    elif not ev.events:
        findings.append("no recent calls: breaker states unknown (all closed as far as seen)")
    else:
        findings.append("no breaker open in recent calls")
    audit = _audit_findings(ev)
    if audit:
        findings += audit
        verdict = "warn" if verdict == "ok" else verdict
    return Step(6, "fabric", verdict, findings)


def _audit_findings(ev: Evidence) -> list[str]:
    """Audit events lost (``audit_dropped`` alerts) or still on local disk (spools)."""
    findings: list[str] = []
    if ev.audit_drops:
        by_writer: dict[str, int] = {}
        for alert in ev.audit_drops:
            dropped = alert.details.get("dropped")
            by_writer[alert.key] = by_writer.get(alert.key, 0) + (
                dropped if isinstance(dropped, int) else 0
            )
        told = ", ".join(f"{n} by {writer}" for writer, n in sorted(by_writer.items()))
        findings.append(
            f"audit events DROPPED in the last {ev.window_sec / 60:.0f} min: {told}"
            f" ({subjects.AUDIT_STREAM} did not ack for longer than the writers' memory and"
            " spool hold): those calls have no audit event"
        )
    for spool in ev.spools:
        owner = (
            "a running writer is sending them"
            if spool.live
            else "the next start of a writer of that user sends them"
        )
        line = f"audit spool {spool.directory}: {spool.events} event(s) not yet in"
        line += f" {subjects.AUDIT_STREAM} ({owner})"
        if spool.dropped:
            line += f"; {spool.dropped} dropped event(s) not yet alerted"
        findings.append(line)
    return findings
