"""Call figures of the console, kept as time buckets rather than as events.

The console follows the audit stream for as long as it runs; on a busy fabric, the last
minutes hold hundreds of thousands of calls. Each call is folded into a bucket of its
capability and of the instances it went to (counts, error kinds, a bounded sample of
latencies) and dropped, so memory and the cost of a page stay bounded by the number of
capabilities and instances, not by the call rate.

Figures are those of ``reach.audit.stats`` (its primary events, attempts per instance,
``AuditEvent.answer_ms`` as the latency): the same calls give the same counts as
``reach top``; percentiles come from a sample of at most ``SAMPLES`` latencies per bucket.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from reach.audit.eventmodels import AuditEvent
from reach.audit.stats import percentile

__all__ = ["BUCKET_SEC", "MAX_KEYS", "SAMPLES", "Bucket", "Rollup", "Summary"]

#: width of a bucket (a bar of the capability page's charts)
BUCKET_SEC = 5.0
#: latencies kept per bucket and key at most (a uniform sample beyond)
SAMPLES = 256
#: capabilities and instances kept at most (audit events are written by participants:
#: names beyond it, within the window, are not counted, and ``overflow`` says how many)
MAX_KEYS = 20_000


@dataclass(slots=True)
class Bucket:
    """The calls of one key (capability or instance) that started within one bucket."""

    calls: int = 0
    ok: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    latencies: list[float] = field(default_factory=list)
    seen_ok: int = 0

    def count(self, ok: bool, kind: str, latency_ms: float, rng: random.Random) -> None:
        if not ok:
            self.calls += 1
            self.errors[kind] = self.errors.get(kind, 0) + 1
            return
        self.count_ok(latency_ms, rng)

    def count_ok(self, latency_ms: float, rng: random.Random) -> None:
        """A successful call."""
        self.calls += 1
        self.ok += 1
        self.seen_ok += 1
        if len(self.latencies) < SAMPLES:
            self.latencies.append(latency_ms)
        else:  # reservoir sampling: every latency has the same chance to be kept
            slot = rng.randrange(self.seen_ok)
            if slot < SAMPLES:
                self.latencies[slot] = latency_ms


@dataclass(frozen=True, slots=True)
class Summary:
    """A key's calls over the last ``seconds``."""

    calls: int
    ok: int
    errors: dict[str, int]
    p50: float | None
    p99: float | None
    seconds: float
    #: mean latency of the sampled successful calls (what routing's latency term reads)
    mean: float | None = None

    @property
    def per_sec(self) -> float:
        return self.calls / self.seconds

    @property
    def success_rate(self) -> float | None:
        return self.ok / self.calls if self.calls else None


def _number(value: object) -> float:
    """``value`` as a finite float; ValueError when it is no number or not finite."""
    if type(value) is not float and type(value) is not int:
        raise ValueError(value)
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(value)
    return number


class Rollup:
    """Buckets of ``bucket_sec`` per capability and per instance over ``window_sec``."""

    def __init__(self, window_sec: float = 300.0, bucket_sec: float = BUCKET_SEC) -> None:
        self.window_sec = window_sec
        self.bucket_sec = bucket_sec
        self._caps: dict[str, dict[int, Bucket]] = {}
        self._insts: dict[str, dict[int, Bucket]] = {}
        #: instance → when a caller last passed it over because its breaker was open
        self.breaker_skips: dict[str, float] = {}
        #: calls that passed an instance over because of its open breaker, counted
        self.skips = 0
        #: denials by callees or the registrar: (ts, capability)
        self.denials: deque[tuple[float, str]] = deque(maxlen=10_000)
        self.newest = 0.0
        #: calls not counted because their capability or instance was one too many
        self.overflow = 0
        self._rng = random.Random(0)

    def _bucket(self, table: dict[str, dict[int, Bucket]], key: str, ts: float) -> Bucket | None:
        """The bucket of ``key`` at ``ts``; None for a new key beyond ``MAX_KEYS``."""
        slots = table.get(key)
        if slots is None:
            if len(table) >= MAX_KEYS:
                self.overflow += 1
                return None
            slots = table[key] = {}
        index = int(ts // self.bucket_sec)
        bucket = slots.get(index)
        if bucket is None:
            bucket = slots[index] = Bucket()
        return bucket

    def add(self, event: AuditEvent) -> None:
        """One audit event (not forged: ``read_events`` gives those)."""
        attempts = [(a.agent_id, a.outcome, a.latency_ms) for a in event.attempts]
        self._fold(
            event.ts, event.capability, event.side, event.primary, event.outcome,
            event.error or event.outcome, event.answer_ms, attempts, event.callee,
            event.skipped,
        )  # fmt: skip

    def add_map(self, item: Mapping[str, Any]) -> bool:
        """One event as ``reach.audit.decode.decode_events`` gives it (a map, unvalidated:
        what the console reads on a busy fabric, a few times cheaper than a model per
        event); False, and nothing counted, when a field is not of its type."""
        try:
            ts = _number(item["ts"])
            capability = item["capability"]
            outcome = item["outcome"]
            side = item.get("side", "caller")
            error = item.get("error") or outcome
            latency = _number(item.get("latency_ms", 0.0))
            callee = item.get("callee", "")
            skipped = item.get("skipped") or []
            if type(skipped) is not list:
                return False
            attempts = []
            for a in item.get("attempts") or ():
                attempt = (
                    a.get("agent_id", ""),
                    a.get("outcome", "ok"),
                    _number(a.get("latency_ms", 0.0)),
                )
                if type(attempt[0]) is not str or type(attempt[1]) is not str:
                    return False
                attempts.append(attempt)
        except (KeyError, TypeError, ValueError, AttributeError):
            return False
        for text in (capability, outcome, side, error, callee, *skipped):
            if type(text) is not str:
                return False
        answer = attempts[-1][2] if attempts and attempts[-1][1] == "ok" else latency
        primary = item.get("primary", True) is not False
        self._fold(
            ts, capability, side, primary, outcome, error, answer, attempts,
            callee, skipped,
        )  # fmt: skip
        return True

    def add_plain(self, capability: str, calls: Iterable[tuple[float, str, float]]) -> None:
        """Plain calls of ``capability`` (``reach.audit.split.ColumnPart``: ok at the first
        attempt), checked by the reader: (start, the instance that answered, "" for none,
        latency). What ``add_map`` counts of the same events, without a map per call."""
        rng = self._rng
        newest = self.newest
        width = self.bucket_sec
        cap: Bucket | None = None
        cap_index = -1
        insts = self._insts
        for ts, agent_id, latency_ms in calls:
            if ts > newest:
                newest = ts
            index = int(ts // width)
            if cap is None or index != cap_index:
                cap, cap_index = self._bucket(self._caps, capability, ts), index
            if cap is not None:
                cap.count_ok(latency_ms, rng)
            if agent_id:
                slots = insts.get(agent_id)
                inst = slots.get(index) if slots is not None else None
                if inst is None:
                    inst = self._bucket(insts, agent_id, ts)
                if inst is not None:
                    inst.count_ok(latency_ms, rng)
        self.newest = newest

    def _fold(
        self,
        ts: float,
        capability: str,
        side: str,
        primary: bool,
        outcome: str,
        kind: str,
        answer_ms: float,
        attempts: Sequence[tuple[str, str, float]],
        callee: str,
        skipped: Sequence[str],
    ) -> None:
        if outcome == "denied" and side != "caller":
            self.denials.append((ts, capability))
            return
        if not primary:
            return
        self.newest = max(self.newest, ts)
        rng = self._rng
        cap = self._bucket(self._caps, capability, ts)
        if cap is not None:
            cap.count(outcome == "ok", kind, answer_ms, rng)
        tried = [a for a in attempts if a[0]]
        for agent_id, attempt_outcome, latency_ms in tried:
            inst = self._bucket(self._insts, agent_id, ts)
            if inst is not None:
                inst.count(attempt_outcome == "ok", attempt_outcome, latency_ms, rng)
        if not tried and callee:
            inst = self._bucket(self._insts, callee, ts)
            if inst is not None:
                inst.count(outcome == "ok", kind, answer_ms, rng)
        self.skips += len(skipped)
        for agent_id in skipped:
            if agent_id in self.breaker_skips or len(self.breaker_skips) < MAX_KEYS:
                self.breaker_skips[agent_id] = max(self.breaker_skips.get(agent_id, 0.0), ts)

    def trim(self, now: float) -> None:
        """Forget buckets older than the window (and instances and capabilities without
        any left)."""
        oldest = int((now - self.window_sec) // self.bucket_sec)
        for table in (self._caps, self._insts):
            for key in list(table):
                slots = table[key]
                for index in [i for i in slots if i < oldest]:
                    del slots[index]
                if not slots:
                    del table[key]
        for agent_id, ts in list(self.breaker_skips.items()):
            if ts < now - self.window_sec:
                del self.breaker_skips[agent_id]

    def capability(self, name: str, now: float, seconds: float = 60.0) -> Summary:
        return self._summary(self._caps.get(name), now, seconds)

    def instance(self, agent_id: str, now: float, seconds: float = 60.0) -> Summary:
        return self._summary(self._insts.get(agent_id), now, seconds)

    def capabilities(self) -> list[str]:
        return sorted(self._caps)

    def _summary(self, slots: dict[int, Bucket] | None, now: float, seconds: float) -> Summary:
        if not slots:
            return Summary(0, 0, {}, None, None, seconds)
        oldest = int((now - seconds) // self.bucket_sec)
        calls = ok = 0
        errors: dict[str, int] = {}
        latencies: list[float] = []
        for index, bucket in slots.items():
            if index <= oldest:  # a bucket counts when it lies wholly within the seconds
                continue
            calls += bucket.calls
            ok += bucket.ok
            latencies.extend(bucket.latencies)
            for kind, n in bucket.errors.items():
                errors[kind] = errors.get(kind, 0) + n
        mean = sum(latencies) / len(latencies) if latencies else None
        return Summary(
            calls, ok, errors, percentile(latencies, 0.5), percentile(latencies, 0.99), seconds,
            mean,
        )  # fmt: skip

    def series(self, name: str, now: float) -> list[tuple[float, Bucket]]:
        """A capability's buckets over the window, oldest first, empty ones included:
        (start of the bucket, its calls)."""
        slots = self._caps.get(name, {})
        last = int(now // self.bucket_sec)
        count = int(self.window_sec // self.bucket_sec)
        return [
            (index * self.bucket_sec, slots.get(index) or Bucket())
            for index in range(last - count + 1, last + 1)
        ]
