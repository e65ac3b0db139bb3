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

import random
from collections import deque
from dataclasses import dataclass, field

from reach.audit.records import AuditEvent
from reach.audit.stats import percentile

__all__ = ["BUCKET_SEC", "SAMPLES", "Bucket", "Rollup", "Summary"]

#: width of a bucket (a bar of the capability page's charts)
BUCKET_SEC = 5.0
#: latencies kept per bucket and key at most (a uniform sample beyond)
SAMPLES = 256


@dataclass(slots=True)
class Bucket:
    """The calls of one key (capability or instance) that started within one bucket."""

    calls: int = 0
    ok: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    latencies: list[float] = field(default_factory=list)
    seen_ok: int = 0

    def count(self, ok: bool, kind: str, latency_ms: float, rng: random.Random) -> None:
        self.calls += 1
        if not ok:
            self.errors[kind] = self.errors.get(kind, 0) + 1
            return
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


class Rollup:
    """Buckets of ``bucket_sec`` per capability and per instance over ``window_sec``."""

    def __init__(self, window_sec: float = 300.0, bucket_sec: float = BUCKET_SEC) -> None:
        self.window_sec = window_sec
        self.bucket_sec = bucket_sec
        self._caps: dict[str, dict[int, Bucket]] = {}
        self._insts: dict[str, dict[int, Bucket]] = {}
        #: instance → when a caller last passed it over because its breaker was open
        self.breaker_skips: dict[str, float] = {}
        #: denials by callees or the registrar: (ts, capability)
        self.denials: deque[tuple[float, str]] = deque(maxlen=10_000)
        self.newest = 0.0
        self._rng = random.Random(0)

    def _bucket(self, table: dict[str, dict[int, Bucket]], key: str, ts: float) -> Bucket:
        slots = table.get(key)
        if slots is None:
            slots = table[key] = {}
        index = int(ts // self.bucket_sec)
        bucket = slots.get(index)
        if bucket is None:
            bucket = slots[index] = Bucket()
        return bucket

    def add(self, event: AuditEvent) -> None:
        """One audit event (not forged: ``read_events`` gives those)."""
        ts = event.ts
        if event.outcome == "denied" and event.side != "caller":
            self.denials.append((ts, event.capability))
            return
        if not event.primary:
            return
        self.newest = max(self.newest, ts)
        rng = self._rng
        kind = event.error or event.outcome
        cap = self._bucket(self._caps, event.capability, ts)
        cap.count(event.outcome == "ok", kind, event.answer_ms, rng)
        tried = [a for a in event.attempts if a.agent_id]
        for attempt in tried:
            inst = self._bucket(self._insts, attempt.agent_id, ts)
            inst.count(attempt.outcome == "ok", attempt.outcome, attempt.latency_ms, rng)
        if not tried and event.callee:
            inst = self._bucket(self._insts, event.callee, ts)
            inst.count(event.outcome == "ok", kind, event.answer_ms, rng)
        for agent_id in event.skipped:
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
