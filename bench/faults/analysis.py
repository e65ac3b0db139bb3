"""What a fault scenario's calls and audit events say, checked against the targets.

Every check is a :class:`Check` (name, passed, detail); the tests assert that all pass,
the benchmark writes them beside its table. Times are seconds of ``time.monotonic()``
(system-wide), as both the caller process and the engine record them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Call",
    "Check",
    "Fault",
    "all_open_since",
    "attempt_share",
    "audit_match",
    "calls_of",
    "check_calls",
    "handler_failed_at",
    "share_at",
]


@dataclass(frozen=True)
class Check:
    name: str
    passed: bool
    detail: str

    def line(self) -> str:
        return f"{'ok ' if self.passed else 'FAIL'} {self.name}: {self.detail}"


@dataclass
class Fault:
    """When the fault began (``at``) and ended (the process back: restarted, resumed)."""

    at: float
    end: float
    #: the instance the fault hit, if it hit one
    victim: str | None = None
    #: facts measured while injecting it (restart times, pids), for the report
    facts: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Call:
    call_id: str
    start: float
    end: float
    error: str | None
    served_by: str
    #: (instance, sent, ended, outcome) per attempt; ended 0.0: never ended
    attempts: tuple[tuple[str, float, float, str], ...]

    @property
    def ok(self) -> bool:
        return self.error is None


def calls_of(rows: Sequence[Sequence[Any]]) -> list[Call]:
    """The caller's JSON rows as :class:`Call`, in start order."""
    calls = [
        Call(str(r[0]), float(r[1]), float(r[2]), r[3], str(r[4]), tuple(tuple(a) for a in r[5]))
        for r in rows
    ]
    return sorted(calls, key=lambda c: c.start)


def in_flight_on(call: Call, victim: str, at: float, grace: float) -> bool:
    """Whether an attempt of ``call`` was with ``victim`` when it died at ``at``: sent
    before ``at + grace`` (the server takes a moment to see the process gone) and not
    answered before ``at``."""
    return any(
        target == victim and sent <= at + grace and (ended == 0.0 or ended >= at)
        for target, sent, ended, _ in call.attempts
    )


def handler_failed_at(call: Call, victim: str) -> bool:
    """Whether ``call`` failed because its handler raised at ``victim``."""
    return (
        (call.error or "").startswith("InternalError")
        and bool(call.attempts)
        and call.attempts[-1][0] == victim
    )


def timed_out_in(call: Call, fault: Fault) -> bool:
    """Whether ``call`` was under way during ``fault`` and failed with every attempt
    timed out."""
    return (
        call.start < fault.end
        and call.end > fault.at
        and (call.error or "").startswith(("ReachTimeout", "RetriesExhausted"))
        and bool(call.attempts)
        and all(outcome == "TimeoutError" for _, _, _, outcome in call.attempts)
    )


def check_calls(
    calls: Sequence[Call],
    fault: Fault,
    *,
    idempotent: bool,
    grace: float,
    handler_fails: bool = False,
    stalled_for: float | None = None,
    timeouts_in_fault: bool = False,
) -> tuple[Check, list[Call]]:
    """Failed calls: none for an idempotent capability; otherwise only those in flight
    on the instance that died; with ``handler_fails`` (its handler raised on every call)
    only those it answered with its handler's failure; with ``stalled_for`` (the server
    under the caller stalled) only calls started before that many seconds after the
    stall began; with ``timeouts_in_fault`` (every instance hung) only calls under way
    during the fault whose every attempt timed out (their retries ran out, or the retry
    budget refused more). Returns the check and the failed calls not allowed."""
    failed = [c for c in calls if not c.ok]
    if timeouts_in_fault:
        wrong = [c for c in failed if not timed_out_in(c, fault)]
        rule = "only calls under way in the hang whose every attempt timed out may fail"
    elif stalled_for is not None:
        wrong = [c for c in failed if c.start >= fault.at + stalled_for]
        rule = f"0 failed among the calls started {stalled_for:g}s after the stall began or later"
    elif handler_fails and fault.victim is not None:
        victim = fault.victim
        wrong = [c for c in failed if not handler_failed_at(c, victim)]
        rule = f"only calls whose handler failed at {victim} may fail"
    elif idempotent or fault.victim is None:
        wrong = failed
        rule = "0 failed (idempotent)"
    else:
        victim = fault.victim
        wrong = [c for c in failed if not in_flight_on(c, victim, fault.at, grace)]
        rule = f"only calls in flight on {victim} may fail"
    errors = Counter((c.error or "").split(":", 1)[0] for c in wrong)
    detail = f"{len(failed)} of {len(calls)} failed, {len(wrong)} not allowed ({rule})"
    if wrong:
        first = wrong[0]
        detail += f"; {dict(errors)}; first at {first.start - fault.at:+.2f}s: {first.error}"
    return Check("failed calls", not wrong, detail), wrong


def audit_match(calls: Sequence[Call], event_ids: Sequence[str]) -> tuple[Check, int]:
    """Caller events of REACH_AUDIT against calls, by call id: one each, none missing,
    none twice, none unknown. A call that failed before it took an id has an event
    without one; those are matched by number. Returns the check and the calls with an
    event."""
    counts = Counter(event_ids)
    blank = counts.pop("", 0)
    with_id = [c for c in calls if c.call_id]
    without = len(calls) - len(with_id)
    ours = {c.call_id for c in with_id}
    lost = sum(1 for c in with_id if counts.get(c.call_id, 0) == 0) + max(0, without - blank)
    twice = sum(1 for c in with_id if counts.get(c.call_id, 0) > 1)
    strange = sum(n for cid, n in counts.items() if cid not in ours) + max(0, blank - without)
    kept = len(calls) - lost
    passed = lost == 0 and twice == 0 and strange == 0
    detail = (
        f"{kept} of {len(calls)} calls have their event; {lost} missing, {twice} twice,"
        f" {strange} not of a call"
    )
    return Check("audit events by call id", passed, detail), kept


def served(calls: Sequence[Call], since: float, until: float) -> Counter[str]:
    """Calls served per instance among those started in [since, until)."""
    return Counter(c.served_by for c in calls if c.ok and since <= c.start < until)


def back_in_rotation(
    calls: Sequence[Call], instances: Sequence[str], fault: Fault, tail: float
) -> tuple[Check, float | None]:
    """Every instance served calls in the last ``tail`` seconds of the load; returns the
    check and the latest of the instances' first call served after the fault ended
    (seconds after ``fault.end``), None if one never served again."""
    if not calls:
        return Check("every instance back in rotation", False, "no calls"), None
    last = calls[-1].start
    tail_counts = served(calls, last - tail, last + 1.0)
    absent = [i for i in instances if tail_counts.get(i, 0) == 0]
    firsts: list[float] = []
    for instance in instances:
        first = next(
            (c.start for c in calls if c.ok and c.served_by == instance and c.start >= fault.end),
            None,
        )
        if first is not None:
            firsts.append(first - fault.end)
    back = max(firsts) if len(firsts) == len(instances) else None
    shares = ", ".join(f"{i} {tail_counts.get(i, 0)}" for i in instances)
    detail = f"calls served in the last {tail:g}s: {shares}"
    if absent:
        detail += f"; not serving: {', '.join(absent)}"
    return Check("every instance back in rotation", not absent, detail), back


def attempt_share(
    calls: Sequence[Call], victim: str, since: float, until: float
) -> tuple[float, int, int]:
    """The attempts sent to ``victim`` per call, among the calls started in
    [since, until): the share, the attempts, the calls."""
    window = [c for c in calls if since <= c.start < until]
    sent = sum(1 for c in window for a in c.attempts if a[0] == victim)
    return (sent / len(window) if window else 0.0), sent, len(window)


def share_at(
    calls: Sequence[Call], instances: Sequence[str], until: float, window: float
) -> dict[str, float]:
    """Each instance's share of the calls served that started in [until - window, until)."""
    counts = served(calls, until - window, until)
    total = sum(counts[i] for i in instances)
    return {i: (counts[i] / total if total else 0.0) for i in instances}


def first_fair(
    calls: Sequence[Call],
    instances: Sequence[str],
    since: float,
    window: float,
    floor: float,
    step: float = 0.25,
) -> float | None:
    """Seconds after ``since`` at which a ``window`` of calls first gave every instance at
    least ``floor`` of them; None if it never did."""
    if not calls:
        return None
    end = since + window
    while end <= calls[-1].start + step:
        shares = share_at(calls, instances, end, window)
        if all(s >= floor for s in shares.values()):
            return end - since
        end += step
    return None


def breaker_opened(
    breakers: Sequence[Sequence[Any]], target: str, since: float, states: Sequence[str] = ("open",)
) -> float | None:
    """Time of the first sampled change of ``target``'s breaker to open (or to another of
    ``states``: "ejected", the caller's outlier detection setting it aside) at or after
    ``since``."""
    return next(
        (
            float(t)
            for t, who, state in breakers
            if who == target and t >= since and state in states
        ),
        None,
    )


def all_open_since(
    breakers: Sequence[Sequence[Any]], targets: Sequence[str], since: float
) -> float | None:
    """The first sampled moment at or after ``since`` when the breaker of every one of
    ``targets`` was open at once (ejections are not breaker states and are skipped)."""
    state: dict[str, str] = {}
    for t, who, now in breakers:
        if now in ("ejected", "admitted"):
            continue
        state[str(who)] = str(now)
        if float(t) >= since and all(state.get(x) == "open" for x in targets):
            return float(t)
    return None
