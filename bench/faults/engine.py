"""One fault scenario from start to verdict; the tests and ``python -m bench.faults`` run this.

1. start the fabric (``reach up``, ``reach up --cluster 3``, or nats-server and
   ``reach up --auth-callout`` apart), three instances in three processes and the caller
   in a fourth;
2. start the caller's open-loop load; after ``pre_sec`` inject the fault; go on for
   ``post_sec`` after it ended;
3. stop the load, let every call end, flush the caller's audit writer;
4. read REACH_AUDIT with the admin credentials and match the caller events to the calls
   by call id;
5. check: failed calls, audit events, every instance back in rotation, the scenario's
   own targets; measure the time to recover.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from bench.faults.analysis import (
    Call,
    Check,
    Fault,
    audit_match,
    back_in_rotation,
    calls_of,
    check_calls,
)
from bench.faults.bed import Bed, Timing
from bench.faults.caller import CallerSettings
from bench.faults.fabric import Fabric, start_fabric
from bench.faults.scenarios import SCENARIOS, FaultNotInjected, Scenario
from bench.procs import Child

__all__ = ["Progress", "report", "run_scenario"]

Progress = Callable[[str], None]

#: how long the audit stream may take to show every event the caller flushed
_AUDIT_SETTLE = 10.0
#: reading the stream makes a consumer: a cluster without a meta leader cannot, for a moment
_AUDIT_READ_TIMEOUT = 30.0


class _Unreadable(RuntimeError):
    """REACH_AUDIT could not be read after the run."""


async def _caller_event_ids(bed: Bed, expected: int) -> list[str]:
    """Call ids of the caller events of the run's capability in REACH_AUDIT, read until
    there are ``expected`` of them or ``_AUDIT_SETTLE`` passed."""
    from reach.audit import read_events
    from reach.audit.reader import AuditFilter
    from reach.errors import ReachError
    from reach.security.membership import connect_as

    fabric = bed.fabric
    try:
        conn, _ = await connect_as(fabric.urls, name="faults-audit", credentials=fabric.admin_creds)
    except ReachError as exc:
        raise _Unreadable(f"cannot connect to read REACH_AUDIT: {exc}") from exc
    flt = AuditFilter(capability=bed.capability)
    settle = time.monotonic() + _AUDIT_SETTLE
    deadline = time.monotonic() + _AUDIT_READ_TIMEOUT
    try:
        while True:
            try:
                ids = [e.call_id async for e in read_events(conn, flt) if e.side == "caller"]
            except ReachError as exc:
                if time.monotonic() > deadline:
                    raise _Unreadable(f"cannot read REACH_AUDIT: {exc}") from exc
                await asyncio.sleep(0.2)
                continue
            if len(ids) >= expected or time.monotonic() > settle:
                return ids
            await asyncio.sleep(0.5)
    finally:
        await conn.close()


def _post_sec(scenario: Scenario, timing: Timing, fault: Fault) -> float:
    post = timing.post_sec
    if scenario.name == "pause-short":  # the shares are read fair_within_sec after the fault
        post = max(post, fault.at + timing.fair_within_sec + 0.5 - fault.end)
    return post


async def _load_and_fault(
    bed: Bed, scenario: Scenario, caller: Child, progress: Progress
) -> tuple[Fault, float]:
    """Start the load, inject the fault, stop the load; the fault and the load's start."""
    assert caller.proc.stdin is not None
    caller.proc.stdin.write(b"start\n")
    await caller.proc.stdin.drain()
    began = time.monotonic()
    pre = bed.timing.pre_sec
    if scenario.established_caller:
        pre = max(pre, bed.timing.established_sec)
    await asyncio.sleep(pre)
    fault = Fault(time.monotonic(), time.monotonic())
    if scenario.fault is not None:
        try:
            fault = await scenario.fault(bed)
        except FaultNotInjected as exc:
            bed.checks.append(Check("fault injected", False, str(exc)))
        progress(f"{scenario.name}: fault over after {fault.end - fault.at:.2f}s")
    await asyncio.sleep(_post_sec(scenario, bed.timing, fault))
    caller.proc.stdin.write(b"stop\n")
    await caller.proc.stdin.drain()
    return fault, began


async def _run(bed: Bed, scenario: Scenario, progress: Progress) -> dict[str, Any]:
    timing = bed.timing
    await bed.start_agents()
    timeout = scenario.call_timeout(timing) if scenario.call_timeout else timing.call_timeout_sec
    settings = CallerSettings(
        servers=bed.fabric.urls,
        credentials=str(bed.fabric.creds),
        capability=bed.capability,
        instances=timing.instances,
        rate=max(timing.rate, scenario.rate_at_least),
        call_timeout_sec=timeout,
    )
    out = bed.logs / "caller.json"
    caller = await Child.launch(
        "caller",
        "bench.faults.caller",
        [json.dumps(asdict(settings)), str(out)],
        bed.logs,
        env=bed.env("caller"),
    )
    bed.caller_url = caller.said
    try:
        progress(f"{scenario.name}: load at {settings.rate:g}/s")
        fault, began = await _load_and_fault(bed, scenario, caller, progress)
        await caller.expect("DONE", timeout + 60.0)
    finally:
        await caller.stop()
    record = json.loads(out.read_text())
    calls = calls_of(record["calls"])
    try:
        ids = await _caller_event_ids(bed, len(calls))
    except _Unreadable as exc:
        bed.checks.append(Check("audit stream readable", False, str(exc)))
        ids = []
    return _verdict(bed, scenario, fault, calls, record, ids, began)


def _verdict(
    bed: Bed,
    scenario: Scenario,
    fault: Fault,
    calls: list[Call],
    record: dict[str, Any],
    event_ids: list[str],
    began: float,
) -> dict[str, Any]:
    timing = bed.timing
    failed_check, _ = check_calls(
        calls,
        fault,
        idempotent=scenario.idempotent,
        grace=timing.in_flight_grace_sec,
        handler_fails=scenario.handler_fails,
        stalled_for=scenario.stalled_for(timing) if scenario.stalled_for else None,
        timeouts_in_fault=scenario.timeouts_in_fault,
    )
    audit_check, kept = audit_match(calls, event_ids)
    rotation_check, back = back_in_rotation(calls, bed.instances, fault, timing.tail_sec)
    checks = [failed_check, audit_check, rotation_check, *bed.checks]
    if scenario.extra is not None:
        checks += scenario.extra(bed, fault, calls, record["breakers"])
    if record["harness_errors"]:
        checks.append(Check("harness", False, "; ".join(record["harness_errors"][:5])))
    failed = [c for c in calls if not c.ok]
    last_failure = max((c.end - fault.at for c in failed), default=None)
    recovered = None if back is None else max(back + fault.end - fault.at, last_failure or 0.0)
    return {
        "scenario": scenario.name,
        "title": scenario.title,
        "fabric": scenario.fabric,
        "idempotent": scenario.idempotent,
        "sent": len(calls),
        "ok": len(calls) - len(failed),
        "audit_kept": kept,
        "audit_events": len(event_ids),
        "fault_at_sec": round(fault.at - began, 2),
        "fault_sec": round(fault.end - fault.at, 2),
        "last_failure_sec": None if last_failure is None else round(last_failure, 2),
        "back_in_rotation_sec": None if back is None else round(back, 2),
        "recovered_sec": None if recovered is None else round(recovered, 2),
        "facts": fault.facts,
        "errors": _error_kinds(failed),
        "first_error": failed[0].error if failed else None,
        "late_starts": record["late_starts"],
        "caller_audit": record["audit"],
        "passed": all(c.passed for c in checks),
        "checks": [asdict(c) for c in checks],
    }


def _error_kinds(failed: list[Call]) -> dict[str, int]:
    kinds: dict[str, int] = {}
    for call in failed:
        kind = (call.error or "").split(":", 1)[0]
        kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


async def run_scenario(
    name: str,
    timing: Timing,
    workdir: Path,
    progress: Progress = lambda _: None,
    fabric: Fabric | None = None,
) -> dict[str, Any]:
    """Run scenario ``name`` in ``workdir`` (its stores and logs stay there), on
    ``fabric`` if given (of the scenario's kind; the caller stops it), else on one of its
    own."""
    scenario = SCENARIOS[name]
    if scenario.failures_before_unhealthy is not None:
        timing = replace(timing, failures_before_unhealthy=scenario.failures_before_unhealthy)
    if fabric is not None and fabric.kind != scenario.fabric:
        raise ValueError(f"{name} runs on a {scenario.fabric} fabric, not {fabric.kind}")
    logs = workdir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    own = fabric is None
    if fabric is None:
        fabric = await start_fabric(scenario.fabric, workdir)
    progress(f"{name}: {scenario.fabric} fabric at {','.join(fabric.urls)}")
    bed = Bed(
        name=name,
        fabric=fabric,
        timing=timing,
        capability=f"faults_{name.replace('-', '_')}_{secrets.token_hex(3)}",
        idempotent=scenario.idempotent,
        max_concurrency=scenario.max_concurrency,
        logs=logs,
    )
    try:
        return await _run(bed, scenario, progress)
    finally:
        await bed.stop_agents()
        if own:
            await fabric.stop()


def report(outcome: dict[str, Any]) -> str:
    """The checks of one outcome, one per line (what a failed test prints)."""
    lines = [
        f"{outcome['scenario']}: {outcome['sent']} sent, {outcome['ok']} ok,"
        f" {outcome['audit_kept']} audit events kept"
    ]
    lines += [Check(**c).line() for c in outcome["checks"]]
    return "\n".join(lines)
