"""Alert rules over the audit stream and the registry, written to REACH_ALERTS.

Rules (docs/operations.md lists them under "Alerts"; every threshold is an :class:`AlertRules`
field):

* ``retry_storm`` — one caller retried one callee more than 10 times within a minute
  (a retry is counted against the instance whose failed attempt was retried);
* ``unhealthy`` — an instance turned unhealthy (the registrar's reason included);
* ``breaker_rejections`` — breaker rejections above 10 % of a capability's calls in a
  minute (at least 20 calls): a warning while the success rate still looks fine;
* ``instance_errors`` — one instance's handler failed (``InternalError``) on more than
  10 calls within a minute while it passes its probes: what callers' outlier detection
  sets aside (``reach.resilience.outliers``), said to the operator;
* ``new_agent_probe_failed`` — an agent in its first 24 h failed a probe;
* ``audit_dropped`` — an audit writer dropped events (REACH_AUDIT did not ack for longer
  than its memory and spool could hold, or events could not be packed): raised from the
  writer's report (a notice with a ``dropped`` count), one alert per report;
* ``store_full`` — the fabric's JetStream store takes no writes (its disk is full, or a
  server disabled JetStream after a store error), as the servers' health says: raised
  when it begins, and stored once the store takes writes again.

The engine is pure (clock injected, no I/O);
:class:`reach.audit.alert_watcher.AlertWatcher` feeds it from the audit writers' notices
and the registry watch, and publishes what it returns. Alerts carry a message id derived
from the rule, its subject and the time bucket, so several watchers (one per registrar)
store each alert once.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import msgpack
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from reach.audit.batch import NOTABLE_ERRORS
from reach.audit.decode import decode_raw, read_counts
from reach.audit.rulenames import RULES, RuleName
from reach.clock import Clock, system_clock
from reach.errors import ConfigurationError
from reach.wire import subjects
from reach.wire.models import Instance

__all__ = [
    "RULES",
    "STORE_KEY",
    "Alert",
    "AlertEngine",
    "AlertRules",
    "decode_alert",
    "encode_alert",
]

log = logging.getLogger("reach.alerts")

_K = TypeVar("_K")

#: what a ``store_full`` alert is about: the fabric's JetStream store, whichever server
#: reported it (the details say)
STORE_KEY = "jetstream"
#: names (capabilities, caller→callee pairs) one rule tracks at most at a time
MAX_TRACKED = 10_000
#: how often windows that emptied are forgotten
PRUNE_EVERY_SEC = 10.0


class Alert(BaseModel):
    """One alert (stream REACH_ALERTS, subject ``reach.v1.alert.<rule>``)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    rule: RuleName
    #: what it is about: ``caller→callee``, an agent id or a capability
    key: str
    ts: float = Field(description="when it fired, Unix seconds")
    severity: Literal["warning", "critical"] = "warning"
    summary: str
    details: dict[str, Any] = Field(default_factory=dict)

    def msg_id(self, bucket_sec: float) -> str:
        seq, dropped = self.details.get("seq"), self.details.get("dropped")
        if self.rule == "audit_dropped":
            # one per report, whichever registrar heard it (a report asked again after
            # a lost answer is the same one)
            return f"{self.rule}.{self.key}.{seq}.{dropped}"
        return f"{self.rule}.{self.key}.{int(self.ts // bucket_sec)}"


def encode_alert(alert: Alert) -> bytes:
    data: bytes = msgpack.packb(alert.model_dump(mode="json"), use_bin_type=True)
    return data


def decode_alert(data: bytes) -> Alert | None:
    try:
        return Alert.model_validate(msgpack.unpackb(data, raw=False))
    except (ValidationError, ValueError, msgpack.UnpackException, TypeError):
        return None


@dataclass(frozen=True, slots=True)
class AlertRules:
    #: more than this many retries by one caller against one callee in ``retry_window_sec``
    retry_threshold: int = 10
    retry_window_sec: float = 60.0
    #: breaker rejections above this share of a capability's calls in ``breaker_window_sec``
    breaker_share: float = 0.10
    breaker_min_calls: int = 20
    breaker_window_sec: float = 60.0
    #: more than this many calls whose handler failed at one instance in ``errors_window_sec``
    errors_threshold: int = 10
    errors_window_sec: float = 60.0
    #: agents younger than this that fail a probe raise ``new_agent_probe_failed``
    new_agent_sec: float = 24 * 3600.0
    #: one alert per rule and subject within this time (then it may fire again)
    repeat_after_sec: float = 60.0

    def __post_init__(self) -> None:
        if self.retry_threshold < 0 or not 0 < self.breaker_share <= 1:
            raise ConfigurationError(
                "alert rules: retry_threshold must be >= 0 and breaker_share in (0, 1]"
            )


@dataclass
class _Window:
    """Timestamps within a sliding window."""

    span: float
    times: deque[float] = field(default_factory=deque)

    def add(self, now: float) -> int:
        self.times.append(now)
        return self.count(now)

    def count(self, now: float) -> int:
        while self.times and self.times[0] <= now - self.span:
            self.times.popleft()
        return len(self.times)


@dataclass
class _Counts:
    """How many within a sliding window, counted in one-second buckets (cheap per add)."""

    span: float
    buckets: deque[list[float]] = field(default_factory=deque)
    total: int = 0

    def add(self, now: float, n: int = 1) -> int:
        second = float(int(now))
        if self.buckets and self.buckets[-1][0] == second:
            self.buckets[-1][1] += n
        else:
            self.buckets.append([second, n])
        self.total += n
        return self.count(now)

    def count(self, now: float) -> int:
        while self.buckets and self.buckets[0][0] <= now - self.span:
            self.total -= int(self.buckets.popleft()[1])
        return self.total


def _drop_empty(table: dict[_K, _Window] | dict[_K, _Counts], now: float) -> None:
    for key in [k for k, window in table.items() if not window.count(now)]:
        del table[key]


class AlertEngine:
    """Turns audit events and registry records into alerts (no I/O)."""

    def __init__(self, rules: AlertRules | None = None, clock: Clock = system_clock) -> None:
        self.rules = rules or AlertRules()
        self._clock = clock
        self._retries: dict[tuple[str, str], _Window] = {}
        self._calls: dict[str, _Counts] = {}
        self._rejections: dict[str, _Window] = {}
        self._errors: dict[str, _Window] = {}
        self._last_fired: dict[tuple[str, str], float] = {}
        self._status: dict[str, tuple[str, int]] = {}
        self._pruned_at = 0.0
        self._full_warned = False

    def _fire(self, rule: RuleName, key: str, now: float, **fields: Any) -> Alert | None:
        last = self._last_fired.get((rule, key))
        if last is not None and now - last < self.rules.repeat_after_sec:
            return None
        self._last_fired[(rule, key)] = now
        return Alert(rule=rule, key=key, ts=now, **fields)

    def observe(self, event: dict[str, Any], writer: str | None = None) -> list[Alert]:
        """Alerts one audit event (a map, see ``AuditEvent``) raises; usually none.
        ``writer``: the writer token of its subject (None: not read from the stream)."""
        capability = event.get("capability")
        if not isinstance(capability, str) or not capability:
            return []  # not an event any writer of ours makes
        side = event.get("side", "caller")
        if side != "caller":
            if _counted_callee(event):
                self._count_calls(capability, 1)  # a call only its callee recorded
            return []
        caller = _caller_of(event, writer)
        if caller is None:
            return []  # written by someone else than the caller it names: nobody's call
        self._count_calls(capability, 1)
        attempts = event.get("attempts")
        tried = [
            a.get("agent_id")
            for a in (attempts if isinstance(attempts, list) else ())
            if isinstance(a, dict)
        ]
        error = "breaker" if event.get("skipped") else event.get("error")
        return self._observe_call(capability, caller, tried, error)

    def observe_batch(self, data: bytes, writer: str | None = None) -> list[Alert]:
        """Alerts one stream message (a batch of events) raises. Only rows with retries
        or breaker rejections need a closer look; the rest are only counted. ``writer``:
        the writer token of its subject; rows of calls by another caller are skipped.
        ``BatchVersionError`` for a batch of another version."""
        counts = read_counts(data)
        if counts is not None:  # nothing to look at: count without unpacking the events
            self.count_calls(counts)
            return []
        counted: dict[str, int] = {}
        special: list[dict[str, Any]] = []
        for event in decode_raw(data):
            capability = event.get("capability")
            if not isinstance(capability, str) or not capability:
                continue
            if event.get("side") != "caller":
                if _counted_callee(event):
                    counted[capability] = counted.get(capability, 0) + 1
                continue
            caller = _caller_of(event, writer)
            if caller is None:
                continue
            event["caller"] = caller  # what the rules below key retries by
            counted[capability] = counted.get(capability, 0) + 1
            attempts = event.get("attempts")
            retried = isinstance(attempts, list) and len(attempts) > 1
            error = event.get("error")
            if retried or error in NOTABLE_ERRORS or event.get("skipped"):
                special.append(event)
        self.count_calls(counted)
        alerts: list[Alert] = []
        for event in special:
            attempts = event.get("attempts")
            tried = (
                [a.get("agent_id") for a in attempts if isinstance(a, dict)]
                if isinstance(attempts, list)
                else []
            )
            caller = str(event["caller"])
            # a call that passed an open breaker over was refused by it there, even if
            # another instance then served it (the success rate still looks fine)
            error = "breaker" if event.get("skipped") else event.get("error")
            alerts += self._observe_call(event["capability"], caller, tried, error)
        return alerts

    def count_calls(self, counts: Mapping[str, int]) -> None:
        """Calls by capability of a batch in which no row needs a closer look."""
        for capability, n in counts.items():
            self._count_calls(capability, n)

    def _count_calls(self, capability: str, n: int) -> None:
        now = self._clock.time()
        calls = self._calls.get(capability)
        if calls is None:
            if not self._room(self._calls, now):
                return
            calls = self._calls[capability] = _Counts(self.rules.breaker_window_sec)
        calls.add(now, n)

    def _room(self, table: Mapping[Any, Any], now: float) -> bool:
        """Whether ``table`` may take one more key: what it tracks comes from notices any
        caller may publish, so it stays bounded (``MAX_TRACKED``), emptied windows first."""
        # a prune walks every table: at most every PRUNE_EVERY_SEC, full or not (a flood of
        # new names must not turn into a walk per name)
        if now - self._pruned_at >= PRUNE_EVERY_SEC:
            self.prune(now)
        if len(table) < MAX_TRACKED:
            return True
        if not self._full_warned:
            self._full_warned = True
            log.warning(
                "alerts: tracking %d names already; calls of new ones are not counted", MAX_TRACKED
            )
        return False

    def prune(self, now: float) -> None:
        """Forget windows that emptied and alerts that may fire again."""
        self._pruned_at = now
        _drop_empty(self._calls, now)
        _drop_empty(self._retries, now)
        _drop_empty(self._rejections, now)
        _drop_empty(self._errors, now)
        repeat = self.rules.repeat_after_sec
        for key in [k for k, at in self._last_fired.items() if now - at >= repeat]:
            del self._last_fired[key]
        tables = (self._calls, self._retries, self._rejections, self._errors)
        if max(len(t) for t in tables) < MAX_TRACKED:
            self._full_warned = False  # room again: a later flood is worth a line again

    def _observe_call(
        self, capability: str, caller: str, tried: list[Any], error: Any
    ) -> list[Alert]:
        now = self._clock.time()
        alerts: list[Alert] = []
        # every attempt but the last failed and was retried
        for agent_id in tried[:-1]:
            callee = str(agent_id or capability)
            window = self._retries.get((caller, callee))
            if window is None:
                if not self._room(self._retries, now):
                    continue
                window = self._retries[(caller, callee)] = _Window(self.rules.retry_window_sec)
            count = window.add(now)
            if count > self.rules.retry_threshold:
                alert = self._fire(
                    "retry_storm",
                    f"{caller}→{callee}",
                    now,
                    summary=(
                        f"{caller} retried {callee} {count} times in the last"
                        f" {self.rules.retry_window_sec:.0f}s (capability {capability})"
                    ),
                    details={
                        "caller": caller,
                        "callee": callee,
                        "capability": capability,
                        "retries": count,
                    },
                )
                if alert is not None:
                    alerts.append(alert)
        if error == "InternalError" and tried:
            alert = self._handler_failed(capability, str(tried[-1] or capability), now)
            if alert is not None:
                alerts.append(alert)
        if error != "breaker":
            return alerts
        calls = self._calls.get(capability)
        total = calls.count(now) if calls is not None else 0
        rejections = self._rejections.get(capability)
        if rejections is None:
            if not self._room(self._rejections, now):
                return alerts
            rejections = self._rejections[capability] = _Window(self.rules.breaker_window_sec)
        rejected = rejections.add(now)
        if total >= self.rules.breaker_min_calls and rejected / total > self.rules.breaker_share:
            alert = self._fire(
                "breaker_rejections",
                capability,
                now,
                summary=(
                    f"{rejected} of {total} calls to {capability} rejected by open"
                    f" breakers in the last {self.rules.breaker_window_sec:.0f}s"
                    f" ({rejected / total:.0%})"
                ),
                details={"capability": capability, "rejected": rejected, "calls": total},
            )
            if alert is not None:
                alerts.append(alert)
        return alerts

    def _handler_failed(self, capability: str, callee: str, now: float) -> Alert | None:
        """A call whose handler failed at ``callee``: an alert once they are too many."""
        window = self._errors.get(callee)
        if window is None:
            if not self._room(self._errors, now):
                return None
            window = self._errors[callee] = _Window(self.rules.errors_window_sec)
        count = window.add(now)
        if count <= self.rules.errors_threshold:
            return None
        return self._fire(
            "instance_errors",
            callee,
            now,
            severity="critical",
            summary=(
                f"{callee}'s handler failed {count} calls in the last"
                f" {self.rules.errors_window_sec:.0f}s (capability {capability}): callers"
                " set it aside for a while, its probes may still pass"
            ),
            details={"agent_id": callee, "capability": capability, "failures": count},
        )

    def registry_change(self, inst: Instance) -> list[Alert]:
        """Alerts a new version of an instance record raises."""
        now = self._clock.time()
        alerts: list[Alert] = []
        before = self._status.get(inst.agent_id)
        self._status[inst.agent_id] = (inst.status, inst.consecutive_failures)
        if before is None:
            return alerts  # first sight (also after a restart): no transition seen
        status, failures = before
        if inst.status == "unhealthy" and status != "unhealthy":
            alert = self._fire(
                "unhealthy",
                inst.agent_id,
                now,
                severity="critical",
                summary=f"{inst.agent_id} turned unhealthy: {inst.status_reason}",
                details={"agent_id": inst.agent_id, "reason": inst.status_reason, "was": status},
            )
            if alert is not None:
                alerts.append(alert)
        if inst.consecutive_failures > failures and inst.age(now) < self.rules.new_agent_sec:
            alert = self._fire(
                "new_agent_probe_failed",
                inst.agent_id,
                now,
                summary=(
                    f"{inst.agent_id} (registered {inst.age(now) / 60:.0f} min ago) failed"
                    f" {inst.consecutive_failures} probe(s) in a row"
                ),
                details={
                    "agent_id": inst.agent_id,
                    "failures": inst.consecutive_failures,
                    "age_sec": round(inst.age(now), 1),
                },
            )
            if alert is not None:
                alerts.append(alert)
        return alerts

    def forget(self, agent_id: str) -> None:
        self._status.pop(agent_id, None)

    def audit_dropped(self, writer: str, dropped: int, seq: int) -> Alert:
        """The alert for ``dropped`` events a writer reported with its notice of batch
        ``seq``: always raised (each report counts drops of its own)."""
        return Alert(
            rule="audit_dropped",
            key=writer,
            ts=self._clock.time(),
            severity="critical",
            summary=(
                f"{writer} dropped {dropped} audit event(s): {subjects.AUDIT_STREAM} did not"
                " ack for longer than its memory and spool hold (or events could not be"
                " packed); see `reach doctor` and the writer's log"
            ),
            details={"writer": writer, "dropped": dropped, "seq": seq},
        )

    def store_full(self, problem: str) -> Alert | None:
        """The alert for the fabric's JetStream store taking no writes (``problem``: what
        its servers report); None within ``repeat_after_sec`` of the last one."""
        return self._fire(
            "store_full",
            STORE_KEY,
            self._clock.time(),
            severity="critical",
            summary=(
                f"the JetStream store takes no writes: {problem}; writes to the registry,"
                f" {subjects.AUDIT_STREAM} and {subjects.ALERTS_STREAM} fail until space is"
                " freed (audit events wait in their writers' memory and spools)"
            ),
            details={"problem": problem},
        )


def _caller_of(event: Mapping[str, Any], writer: str | None) -> str | None:
    """Who the rules count a caller-side event against; None when its writer is not the
    caller it names, nor the gateway it names as calling for that caller (``actor``): a
    forgery, counted for nobody. A named writer is the key itself: an agent id the event
    claims (``caller_agent``) or a client a gateway calls for is not the writer's to
    choose, and a gateway's retries are its own. On an open fabric (anonymous writer) or
    off the stream there is nothing to check."""
    caller = event.get("caller")
    if writer is None or writer in ("", subjects.ANONYMOUS):
        return str(event.get("caller_agent") or caller or subjects.ANONYMOUS)
    actor = event.get("actor")
    return writer if (actor or caller) == writer else None


def _counted_callee(event: dict[str, Any]) -> bool:
    """A callee's event that is its call's record (``primary``): counted as the call."""
    return event.get("side") == "callee" and event.get("primary") is True
