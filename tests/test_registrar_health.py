"""The registrar's health policy, driven directly on a ManualClock: no NATS, no waiting.

Each test feeds the policy what a registrar hears (announces, heartbeats, probe results,
its own trouble) and checks the record it decides, as the registrar would write it.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest

import reach
from reach.clock import ManualClock
from reach.errors import NoResponders, ReachTimeout
from reach.registry import health, material, ownership, partitions
from reach.registry.health import HealthPolicy
from reach.registry.probes import ProbeResult
from reach.wire.models import (
    HealthStatus,
    Heartbeat,
    Instance,
    Manifest,
    ProbeReply,
    Readiness,
    Transition,
)

INTERVAL = 2.0
FAILURES = 2


def _manifest(agent_id: str = "svc-1") -> Manifest:
    return Manifest.model_validate(
        {
            "agent_id": agent_id,
            "agent_name": "svc",
            "version": "1.0.0",
            "capabilities": [{"name": "echo", "latency_sla_ms": 500}],
            "health": {
                "interval_sec": INTERVAL,
                "timeout_sec": 1.0,
                "failures_before_unhealthy": FAILURES,
            },
        }
    )


def _record(at: float, **update: object) -> Instance:
    inst = Instance(
        manifest=_manifest(),
        instance_id="svc-1-a",
        registered_at=at,
        last_heartbeat_at=at,
        transitions=[Transition(at=at, status="healthy", reason="announced")],
    )
    return inst.model_copy(update=update) if update else inst


def _heartbeat(at: float, *, ready: bool = True, instance_id: str = "svc-1-a") -> Heartbeat:
    return Heartbeat(
        agent_id="svc-1",
        instance_id=instance_id,
        seq=1,
        sent_at=at,
        in_flight=2,
        max_concurrency=8,
        completed=5,
        readiness=Readiness(ready=ready, reason="" if ready else "warming up"),
    )


def _answered(ready: bool = True, ms: float = 3.0) -> ProbeResult:
    reply = ProbeReply(
        agent_id="svc-1",
        instance_id="svc-1-a",
        in_flight=1,
        max_concurrency=8,
        readiness=Readiness(ready=ready, reason="" if ready else "draining"),
    )
    return ProbeResult(reply, ms)


def _nobody() -> ProbeResult:
    return ProbeResult(None, 0.1, "NoResponders: nobody", NoResponders("nobody"))


def _timed_out() -> ProbeResult:
    return ProbeResult(None, 1000.0, "ReachTimeout: no reply", ReachTimeout("no reply"))


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(wall=1_700_000_000.0)


@pytest.fixture
def policy(clock: ManualClock) -> HealthPolicy:
    p = HealthPolicy(clock, evict_after_intervals=3.0, transitions_kept=5, max_backlog=10)
    p.start()
    return p


# -- announces and heartbeats ---------------------------------------------------------


def test_an_announced_instance_is_healthy_when_ready_and_degraded_when_not() -> None:
    assert HealthPolicy.announced(Readiness()) == ("healthy", "announced")
    status, reason = HealthPolicy.announced(Readiness(ready=False, reason="loading model"))
    assert (status, reason) == ("degraded", "not ready: loading model")


def test_a_heartbeat_refreshes_the_record_and_its_readiness_sets_the_status(
    policy: HealthPolicy, clock: ManualClock
) -> None:
    inst = _record(clock.time())
    clock.advance(INTERVAL)
    now = clock.time()
    degraded = policy.after_heartbeat(inst, _heartbeat(now, ready=False), now, None)
    assert degraded is not None
    assert (degraded.status, degraded.status_reason) == ("degraded", "not ready: warming up")
    assert degraded.last_heartbeat_at == now
    assert (degraded.in_flight, degraded.max_concurrency, degraded.completed) == (2, 8, 5)
    assert degraded.transitions[-1] == Transition(
        at=now, status="degraded", reason="not ready: warming up"
    )
    clock.advance(INTERVAL)
    healthy = policy.after_heartbeat(degraded, _heartbeat(clock.time()), clock.time(), None)
    assert healthy is not None
    assert (healthy.status, healthy.status_reason) == ("healthy", "heartbeat ok")


def test_a_heartbeat_of_another_instance_changes_nothing(
    policy: HealthPolicy, clock: ManualClock
) -> None:
    inst = _record(clock.time())
    hb = _heartbeat(clock.time(), instance_id="svc-1-b")
    assert policy.after_heartbeat(inst, hb, clock.time(), None) is None


def test_an_instance_whose_probes_fail_stays_unhealthy_on_heartbeats(
    policy: HealthPolicy, clock: ManualClock
) -> None:
    """A heartbeat says the process lives, not that it answers: only a probe that
    succeeds clears the failures, else health would flap."""
    failing = _record(clock.time(), status="unhealthy", consecutive_failures=FAILURES)
    clock.advance(INTERVAL)
    after = policy.after_heartbeat(failing, _heartbeat(clock.time()), clock.time(), None)
    assert after is not None
    assert after.status == "unhealthy"
    recovered = policy.after_probe(after, "svc-1-a", _answered(), clock.time())
    assert recovered is not None
    assert (recovered.status, recovered.consecutive_failures) == ("healthy", 0)
    assert recovered.transitions[-1].reason == "probe ok"


# -- probes -----------------------------------------------------------------------------


def test_a_probe_that_changes_nothing_is_written_by_the_next_heartbeat_written(
    policy: HealthPolicy, clock: ManualClock
) -> None:
    inst = _record(clock.time(), last_probe_at=clock.time(), last_probe_ms=1.0)
    clock.advance(1.0)
    probed_at = clock.time()
    assert policy.after_probe(inst, "svc-1-a", _answered(ms=4.5), probed_at) is None
    probed = policy.unwritten_probe("svc-1")
    assert probed == (probed_at, 4.5)
    clock.advance(1.0)
    after = policy.after_heartbeat(inst, _heartbeat(clock.time()), clock.time(), probed)
    assert after is not None
    assert (after.last_probe_at, after.last_probe_ms) == (probed_at, 4.5)
    policy.probe_written("svc-1", probed)
    assert policy.unwritten_probe("svc-1") is None


def test_a_newer_probe_noted_while_a_heartbeat_was_written_is_kept(
    policy: HealthPolicy, clock: ManualClock
) -> None:
    inst = _record(clock.time(), last_probe_at=clock.time(), last_probe_ms=1.0)
    policy.after_probe(inst, "svc-1-a", _answered(ms=1.0), clock.time())
    carried = policy.unwritten_probe("svc-1")
    clock.advance(1.0)
    policy.after_probe(inst, "svc-1-a", _answered(ms=2.0), clock.time())
    policy.probe_written("svc-1", carried)
    assert policy.unwritten_probe("svc-1") == (clock.time(), 2.0)


def test_the_first_latency_a_probe_measures_is_written(
    policy: HealthPolicy, clock: ManualClock
) -> None:
    """Written once (tools show it); later ones ride along with the next change."""
    after = policy.after_probe(_record(clock.time()), "svc-1-a", _answered(ms=4.5), 1.0)
    assert after is not None
    assert (after.last_probe_at, after.last_probe_ms) == (1.0, 4.5)
    assert policy.after_probe(after, "svc-1-a", _answered(ms=5.0), 2.0) is None


def test_an_older_unwritten_probe_does_not_replace_a_recorded_one(
    policy: HealthPolicy, clock: ManualClock
) -> None:
    inst = _record(clock.time(), last_probe_at=clock.time() + 5, last_probe_ms=9.0)
    after = policy.after_heartbeat(inst, _heartbeat(clock.time()), clock.time(), (clock.time(), 1))
    assert after is not None
    assert after.last_probe_ms == 9.0


def test_probe_failures_make_an_instance_unhealthy_after_failures_before_unhealthy(
    policy: HealthPolicy, clock: ManualClock
) -> None:
    clock.advance(INTERVAL * FAILURES)  # past the settling window after start
    inst = _record(clock.time())
    for n in range(1, FAILURES):
        after = policy.after_probe(inst, "svc-1-a", _timed_out(), clock.time())
        assert after is not None
        assert (after.status, after.consecutive_failures) == ("healthy", n)
        inst = after
    after = policy.after_probe(inst, "svc-1-a", _timed_out(), clock.time())
    assert after is not None
    assert (after.status, after.consecutive_failures) == ("unhealthy", FAILURES)
    assert after.status_reason == (
        f"{FAILURES} consecutive probe failures, last: ReachTimeout: no reply"
    )
    assert after.last_probe_at == clock.time()


def test_a_probe_of_a_replaced_instance_changes_nothing(
    policy: HealthPolicy, clock: ManualClock
) -> None:
    assert policy.after_probe(_record(clock.time()), "svc-1-old", _timed_out(), 0.0) is None


def test_a_probe_saying_not_ready_degrades_and_records_its_readiness(
    policy: HealthPolicy, clock: ManualClock
) -> None:
    after = policy.after_probe(
        _record(clock.time()), "svc-1-a", _answered(ready=False), clock.time()
    )
    assert after is not None
    assert (after.status, after.status_reason) == ("degraded", "not ready: draining")
    assert after.readiness.ready is False
    assert after.in_flight == 1


def test_a_probe_nobody_received_just_after_start_is_no_failure(
    policy: HealthPolicy, clock: ManualClock
) -> None:
    """Right after the registrar starts, an instance may not have (re)connected yet: a
    probe nobody received counts only once the instance has had the time a silence
    would be given (interval x failures_before_unhealthy)."""
    inst = _record(clock.time() - 100)
    clock.advance(INTERVAL * FAILURES - 0.1)
    assert policy.settling(inst, clock.time(), _nobody())
    assert policy.after_probe(inst, "svc-1-a", _nobody(), clock.time()) is None
    # a probe that timed out was received by somebody: it counts at once
    timed_out = policy.after_probe(inst, "svc-1-a", _timed_out(), clock.time())
    assert timed_out is not None
    assert timed_out.consecutive_failures == 1
    clock.advance(0.1)
    assert not policy.settling(inst, clock.time(), _nobody())
    failed = policy.after_probe(inst, "svc-1-a", _nobody(), clock.time())
    assert failed is not None
    assert failed.consecutive_failures == 1


def test_trouble_opens_the_settling_window_again(policy: HealthPolicy, clock: ManualClock) -> None:
    inst = _record(clock.time())
    clock.advance(100.0)
    assert not policy.settling(inst, clock.time(), _nobody())
    policy.trouble()  # its connection came back after a server restart, say
    assert policy.trouble_at == clock.time()
    clock.advance(1.0)
    assert policy.settling(inst, clock.time(), _nobody())
    assert policy.after_probe(inst, "svc-1-a", _nobody(), clock.time()) is None


def test_young_instances_are_probed_twice_as_often(clock: ManualClock) -> None:
    policy = HealthPolicy(clock, new_agent_window_sec=60.0)
    policy.start()
    young = _record(clock.time())
    clock.advance(INTERVAL / 2)
    assert policy.probe_due(young, clock.time())
    policy.probe_started("svc-1", clock.time())
    assert not policy.probe_due(young, clock.time())
    old = _record(clock.time() - 120)
    assert not policy.probe_due(old, clock.time() + INTERVAL / 2)
    assert policy.probe_due(old, clock.time() + INTERVAL)


# -- silence and eviction ---------------------------------------------------------------


def test_silence_marks_unhealthy_after_missed_heartbeats_then_evicts(
    policy: HealthPolicy, clock: ManualClock
) -> None:
    inst = _record(clock.time())
    clock.advance(INTERVAL * FAILURES - 0.1)
    assert policy.review(inst, clock.time()).action == "keep"
    clock.advance(0.1)
    verdict = policy.review(inst, clock.time())
    assert verdict.action == "unhealthy"
    assert verdict.reason == f"missed {FAILURES} heartbeats ({INTERVAL * FAILURES:.1f}s silent)"
    marked = policy.missed_heartbeats(inst, verdict.reason, clock.time())
    assert (marked.status, marked.status_reason) == ("unhealthy", verdict.reason)
    assert policy.review(marked, clock.time()).action == "keep"  # already unhealthy
    clock.advance(INTERVAL)  # evict_after_intervals (3) intervals silent
    verdict = policy.review(marked, clock.time())
    assert verdict.action == "evict"
    assert verdict.limit == 3 * INTERVAL
    assert verdict.reason == f"silent for {3 * INTERVAL:.1f}s: evicted"


def test_eviction_is_checked_again_on_the_record_as_it_is_at_the_write(
    policy: HealthPolicy, clock: ManualClock
) -> None:
    inst = _record(clock.time())
    clock.advance(10 * INTERVAL)
    verdict = policy.review(inst, clock.time())
    assert verdict.action == "evict"
    assert policy.still_silent(inst, clock.time(), verdict.limit)
    # another registrar wrote a heartbeat this one's view had not shown yet
    heard = inst.model_copy(update={"last_heartbeat_at": clock.time() - 1})
    assert not policy.still_silent(heard, clock.time(), verdict.limit)
    # so also for marking it unhealthy
    assert policy.missed_heartbeats(heard, "missed", clock.time()) is heard


def test_no_silence_is_counted_from_before_the_registrar_started(clock: ManualClock) -> None:
    inst = _record(clock.time())
    clock.advance(100 * INTERVAL)  # the record is old, the registrar new
    policy = HealthPolicy(clock)
    policy.start()
    assert policy.silence(inst, clock.time()) == 0.0
    assert policy.review(inst, clock.time()).action == "keep"
    clock.advance(3 * INTERVAL)
    assert policy.review(inst, clock.time()).action == "evict"


def test_no_silence_is_counted_from_before_the_registrar_s_trouble(
    policy: HealthPolicy, clock: ManualClock
) -> None:
    inst = _record(clock.time())
    clock.advance(2 * INTERVAL)
    policy.trouble()  # its watch failed: heartbeats may have been lost
    clock.advance(INTERVAL)  # 3 intervals since the heartbeat, 1 since the trouble
    assert policy.silence(inst, clock.time()) == INTERVAL
    assert policy.review(inst, clock.time()).action == "keep"


def test_heartbeats_heard_and_not_written_still_count(
    policy: HealthPolicy, clock: ManualClock
) -> None:
    inst = _record(clock.time())
    clock.advance(5 * INTERVAL)
    policy.heard("svc-1", clock.time())  # arrived, nothing to write (or it failed)
    clock.advance(INTERVAL)
    assert policy.silence(inst, clock.time()) == INTERVAL
    assert policy.review(inst, clock.time()).action == "keep"
    policy.forget("svc-1")  # the record is gone: what was kept of it too
    assert policy.silence(inst, clock.time()) == 6 * INTERVAL


def test_a_backlog_of_messages_counts_as_trouble(policy: HealthPolicy, clock: ManualClock) -> None:
    inst = _record(clock.time())
    clock.advance(10 * INTERVAL)
    policy.check_backlog(10, clock.time())  # at the limit: not behind
    assert policy.review(inst, clock.time()).action == "evict"
    policy.check_backlog(11, clock.time())
    assert policy.trouble_at == clock.time()
    assert policy.review(inst, clock.time()).action == "keep"


# -- transitions ------------------------------------------------------------------------


def test_only_the_latest_transitions_are_kept(policy: HealthPolicy, clock: ManualClock) -> None:
    inst = _record(clock.time())
    for n in range(10):
        clock.advance(1.0)
        status: HealthStatus = "degraded" if n % 2 == 0 else "healthy"
        inst = policy.with_status(inst, status, f"step {n}", clock.time())
    assert len(inst.transitions) == 5
    assert [t.reason for t in inst.transitions] == [f"step {n}" for n in range(5, 10)]


def test_a_status_already_held_records_no_transition(
    policy: HealthPolicy, clock: ManualClock
) -> None:
    inst = _record(clock.time())
    assert policy.with_status(inst, "healthy", "again", clock.time()) is inst


def test_a_long_reason_is_clipped(policy: HealthPolicy, clock: ManualClock) -> None:
    after = policy.with_status(_record(clock.time()), "degraded", "x" * 5000, clock.time())
    assert 0 < len(after.status_reason) < 5000
    assert after.transitions[-1].reason == after.status_reason


# -- no I/O -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "module", [health, ownership, material, partitions], ids=lambda m: m.__name__
)
def test_the_policies_import_nothing_that_does_io(module: object) -> None:
    """The health policy and ownership depend on the clock, the models and the errors
    only: no NATS, no asyncio, no other part of the registrar."""
    # its source, also when it is compiled (then its __file__ names the extension)
    root = Path(str(reach.__file__)).parent.parent
    path = root / (str(getattr(module, "__name__", "")).replace(".", "/") + ".py")
    imported: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
    allowed = {"__future__", "collections.abc", "dataclasses", "functools", "hashlib"}
    allowed |= {"logging", "typing", "reach", "reach.clock", "reach.errors", "reach.wire"}
    allowed |= {"reach.wire.models"}
    # the pure parts of the policy: what a change is worth, which partition an id is in
    allowed |= {"reach.registry.material", "reach.registry.partitions"}
    assert imported <= allowed, sorted(imported - allowed)


# -- liveness apart from the record ---------------------------------------------------


def _beat(in_flight: int, max_concurrency: int = 10, **readiness: Any) -> Heartbeat:
    return Heartbeat(
        agent_id="svc-1",
        instance_id="svc-1-a",
        seq=1,
        sent_at=0.0,
        in_flight=in_flight,
        max_concurrency=max_concurrency,
        completed=in_flight * 100,
        readiness=Readiness(**readiness),
    )


def test_a_heartbeat_that_changes_nothing_routing_reads_is_not_written(
    policy: HealthPolicy, clock: ManualClock
) -> None:
    written = _record(clock.time(), in_flight=2, max_concurrency=10)
    clock.advance(INTERVAL)
    # completed calls, memory, a load drift under a tenth: the record itself (no write)
    assert policy.after_heartbeat(written, _beat(2), clock.time(), None) is written
    drift = _beat(2).model_copy(update={"memory_bytes": 10**9})
    assert policy.after_heartbeat(written, drift, clock.time(), None) is written
    bigger = _record(clock.time(), in_flight=2, max_concurrency=20)
    assert policy.after_heartbeat(bigger, _beat(3, 20), clock.time(), None) is bigger
    assert policy.after_heartbeat(written, _beat(2, details={"pool": 0.4}), 1.0, None) is written


@pytest.mark.parametrize(
    ("beat", "why"),
    [
        (_beat(3), "load"),  # a tenth of max_concurrency
        (_beat(10), "saturation"),
        (_beat(2, max_concurrency=12), "max_concurrency"),
        (_beat(2, ready=False, reason="pool full"), "readiness"),
        (_beat(2, reason="warming"), "readiness"),
    ],
)
def test_a_heartbeat_that_changes_what_routing_reads_is_written(
    policy: HealthPolicy, clock: ManualClock, beat: Heartbeat, why: str
) -> None:
    written = _record(clock.time(), in_flight=2, max_concurrency=10)
    clock.advance(INTERVAL)
    after = policy.after_heartbeat(written, beat, clock.time(), None)
    assert after is not None
    assert after is not written
    assert after.last_heartbeat_at == clock.time()
    assert (after.in_flight, after.max_concurrency, after.completed) == (
        beat.in_flight,
        beat.max_concurrency,
        beat.completed,
    )
    assert material.material_change(
        written,
        status=after.status,
        readiness=beat.readiness,
        in_flight=beat.in_flight,
        max_concurrency=beat.max_concurrency,
    ) in (why, "status")


def test_a_load_step_under_a_tenth_stays_inside_the_routing_tie_band() -> None:
    """What is not written moves the load term of the score by less than the band in
    which instances count as equally good."""
    from reach.caller import routing

    assert routing.W_LOAD * material.LOAD_STEP < routing.TIE_BAND


def test_silence_is_counted_from_a_takeover_never_from_before(
    policy: HealthPolicy, clock: ManualClock
) -> None:
    inst = _record(clock.time())
    clock.advance(10 * INTERVAL)  # heard by another registrar meanwhile, not by this one
    taken = clock.time()
    assert policy.review(inst, clock.time(), since=taken).action == "keep"
    clock.advance(INTERVAL * FAILURES)
    assert policy.review(inst, clock.time(), since=taken).action == "unhealthy"


# -- when the sweep needs to look again ------------------------------------------------


@pytest.mark.parametrize("status", ["healthy", "degraded", "unhealthy"])
def test_nothing_is_due_before_the_times_the_policy_gives_and_something_is_at_them(
    policy: HealthPolicy, clock: ManualClock, status: HealthStatus
) -> None:
    """The sweep passes over a record until ``next_review_at`` / ``next_probe_at``: before
    then ``review`` keeps it and ``probe_due`` is False, whatever the record's status;
    heartbeats heard meanwhile only move both later."""
    start = clock.time()
    inst = _record(start, status=status)
    policy.probe_started(inst.agent_id, start + 0.3)
    now = start + 0.5
    review_at = policy.next_review_at(inst, now)
    probe_at = policy.next_probe_at(inst, now)
    assert review_at > now
    assert probe_at > now
    steps = 400
    for n in range(steps + 1):
        t = now + (review_at + 1.0 - now) * n / steps
        verdict = policy.review(inst, t)
        if t < review_at:
            assert verdict.action == "keep", (t - start, verdict)
        if t < probe_at:
            assert not policy.probe_due(inst, t), t - start
    assert policy.review(inst, review_at).action != "keep" or status == "unhealthy"
    assert policy.probe_due(inst, probe_at)
    policy.heard(inst.agent_id, now + 1.0)
    assert policy.next_review_at(inst, now + 1.0) > review_at
