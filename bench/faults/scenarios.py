"""The fault scenarios of issue 24's table: what each does to which process, and when.

A fault function runs while the caller's load flows; it injects the fault, waits until
it is over (the process restarted or resumed) and returns a :class:`Fault` with both
times. A fault that cannot be injected (the process it needs does not exist) raises
:class:`FaultNotInjected`, which fails the run with that reason. Checks that belong to
one scenario (restart times, breaker timings, shares) are made here too.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from bench.faults.analysis import (
    Call,
    Check,
    Fault,
    all_open_since,
    attempt_share,
    breaker_opened,
    first_fair,
    share_at,
)
from bench.faults.bed import Bed, Timing
from bench.faults.fabric import FabricKind, fill, leader_port, stream_info
from bench.procs import descendants

__all__ = ["SCENARIOS", "FaultNotInjected", "Scenario"]

#: how long a process of the fabric may take to come back before the scenario says so
_BACK_TIMEOUT = 30.0


class FaultNotInjected(RuntimeError):
    """The fault could not be injected: the process it targets is not there."""


FaultFn = Callable[[Bed], Awaitable[Fault]]
ExtraChecks = Callable[[Bed, Fault, Sequence[Call], Sequence[Sequence[object]]], list[Check]]


@dataclass(frozen=True)
class Scenario:
    name: str
    #: the row's name in the table
    title: str
    fabric: FabricKind
    fault: FaultFn | None
    idempotent: bool = True
    extra: ExtraChecks | None = None
    #: load before the fault for at least ``Timing.established_sec``: a caller that has
    #: run a while (its retry budget is a share of its recent calls)
    established_caller: bool = False
    #: calls/s at least, whatever the timing's rate: enough calls to a killed instance
    #: that their retries outnumber a young caller's retry budget
    rate_at_least: float = 0.0
    #: the call deadline (default: the timing's)
    call_timeout: Callable[[Timing], float] | None = None
    #: the victim's handler raises: calls it answered so may fail
    handler_fails: bool = False
    #: each instance's max_concurrency (None: the manifest's default, 64)
    max_concurrency: int | None = None
    #: the server under the caller stalls: calls started within this of the stall's
    #: start may fail, none after
    stalled_for: Callable[[Timing], float] | None = None
    #: every instance hangs: calls under way in the fault whose every attempt timed out
    #: may fail (their retries, or the retry budget, ran out); no other call may
    timeouts_in_fault: bool = False
    #: the instances' manifest ``failures_before_unhealthy`` (default: the timing's)
    failures_before_unhealthy: int | None = None


async def _until(check: Callable[[], bool], timeout: float) -> float | None:
    """Poll ``check`` every 20 ms; the time it first held, None after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return time.monotonic()
        await asyncio.sleep(0.02)
    return None


# -- instances ------------------------------------------------------------------------


async def _kill_instance(bed: Bed) -> Fault:
    victim = bed.instances[0]
    child = bed.agents[victim]
    at = time.monotonic()
    child.proc.kill()
    await child.proc.wait()
    await asyncio.sleep(bed.timing.restart_after_sec)
    await bed.start_agent(victim)
    return Fault(
        at, time.monotonic(), victim, {"restarted_after_sec": round(time.monotonic() - at, 2)}
    )


def _pause(seconds: Callable[[Timing], float]) -> FaultFn:
    async def pause(bed: Bed) -> Fault:
        victim = bed.instances[0]
        pid = bed.agents[victim].pid
        at = time.monotonic()
        os.kill(pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(seconds(bed.timing))
        finally:
            os.kill(pid, signal.SIGCONT)
        return Fault(at, time.monotonic(), victim)

    return pause


async def _hang_all(bed: Bed) -> Fault:
    """SIGSTOP of every instance for ``all_hang_sec``: attempts time out everywhere, and
    every breaker of the caller opens."""
    pids = [bed.agents[a].pid for a in bed.instances]
    at = time.monotonic()
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        await asyncio.sleep(bed.timing.all_hang_sec)
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    return Fault(at, time.monotonic())


def _misbehave(sig: signal.Signals) -> FaultFn:
    """The victim's handlers raise on every call (SIGUSR1) or crawl at 5 × the SLA
    (SIGUSR2) for ``misbehave_sec``, while the process and its probes stay healthy."""

    async def misbehave(bed: Bed) -> Fault:
        victim = bed.instances[0]
        pid = bed.agents[victim].pid
        at = time.monotonic()
        os.kill(pid, sig)
        try:
            await asyncio.sleep(bed.timing.misbehave_sec)
        finally:
            os.kill(pid, sig)
        return Fault(at, time.monotonic(), victim)

    return misbehave


async def _stall_caller_node(bed: Bed) -> Fault:
    """SIGSTOP of the nats-server the caller is connected to: a stalled process keeps its
    sockets open, so only the connection's own pings tell it from a quiet one."""
    fabric = bed.fabric
    port = int(bed.caller_url.rsplit(":", 1)[-1]) if bed.caller_url else None
    pid = fabric.nats_pids().get(port) if port is not None else None
    if port is None or pid is None:
        raise FaultNotInjected(f"no running nats-server under the caller ({bed.caller_url!r})")
    at = time.monotonic()
    os.kill(pid, signal.SIGSTOP)
    try:
        await asyncio.sleep(bed.timing.node_stall_sec)
    finally:
        os.kill(pid, signal.SIGCONT)
    return Fault(at, time.monotonic(), None, {"stalled_port": port})


async def _stall_registrar(bed: Bed) -> Fault:
    """SIGSTOP of ``reach up``'s registrar part while calls flow; once it resumes, the
    registry must show no instance turned unhealthy nor evicted since the stall began."""
    fabric = bed.fabric
    pid = fabric.registrar_pid()
    if pid is None:
        raise FaultNotInjected("no registrar part (no <store>/registrar.pid)")
    wall = time.time()
    at = time.monotonic()
    os.kill(pid, signal.SIGSTOP)
    try:
        await asyncio.sleep(bed.timing.registrar_stall_sec)
    finally:
        os.kill(pid, signal.SIGCONT)
    end = time.monotonic()
    # what the registrar decides in the heartbeats after it resumed counts too
    await asyncio.sleep(3 * bed.timing.health_interval_sec)
    verdicts = await _health_since(bed, wall)
    bed.checks.append(
        Check(
            "no instance marked unhealthy or evicted after the stall",
            all(v == "kept healthy" for v in verdicts.values()),
            ", ".join(f"{agent}: {v}" for agent, v in verdicts.items()),
        )
    )
    return Fault(at, end, None)


async def _health_since(bed: Bed, wall: float) -> dict[str, str]:
    """Each instance's record since ``wall`` (Unix time): "kept healthy", or what
    happened to it."""
    from reach.registry.store import RegistryStore
    from reach.security.membership import connect_as

    conn, _ = await connect_as(
        bed.fabric.urls, name="faults-registry", credentials=bed.fabric.admin_creds
    )
    try:
        store = await RegistryStore.open(conn, create=False)
        verdicts: dict[str, str] = {}
        for agent_id in bed.instances:
            found = await store.get(agent_id)
            if found is None:
                verdicts[agent_id] = "evicted"
                continue
            record, _ = found
            turns = [t for t in record.transitions if t.at >= wall and t.status != "healthy"]
            verdicts[agent_id] = (
                "kept healthy"
                if not turns and record.status == "healthy"
                else f"{record.status}; " + "; ".join(f"{t.status} ({t.reason})" for t in turns)
            )
        return verdicts
    finally:
        await conn.close()


def _set_aside(limit: Callable[[Timing], float]) -> ExtraChecks:
    """The victim's share of the attempts, from ``outlier_within_sec`` after the fault
    began until it ended, is below ``limit``."""

    def check(bed: Bed, fault: Fault, calls: Sequence[Call], _b: object) -> list[Check]:
        t = bed.timing
        victim = fault.victim or ""
        since = fault.at + t.outlier_within_sec
        share, sent, window = attempt_share(calls, victim, since, fault.end)
        _, early, _ = attempt_share(calls, victim, fault.at, since)
        fault.facts.update(
            share_after=round(share, 4),
            attempts_after=sent,
            attempts_before=early,
            within_sec=t.outlier_within_sec,
        )
        target = limit(t)
        return [
            Check(
                "the misbehaving instance is set aside",
                window > 0 and share < target,
                f"{victim} got {sent} attempts for {window} calls started"
                f" {t.outlier_within_sec:g}–{fault.end - fault.at:.1f}s after the fault"
                f" ({share:.2%}; target < {target:.1%}); {early} in the first"
                f" {t.outlier_within_sec:g}s",
            )
        ]

    return check


def _fair_share(bed: Bed, fault: Fault, calls: Sequence[Call], _b: object) -> list[Check]:
    t = bed.timing
    until = fault.at + t.fair_within_sec
    shares = share_at(calls, bed.instances, until, t.share_window_sec)
    fair = first_fair(calls, bed.instances, fault.end, t.share_window_sec, t.fair_share)
    fault.facts["fair_after_sec"] = None if fair is None else round(fair, 2)
    low = {i: round(s, 3) for i, s in shares.items() if s < t.fair_share}
    text = ", ".join(f"{i} {s:.0%}" for i, s in shares.items())
    detail = (
        f"shares of the calls started {t.fair_within_sec - t.share_window_sec:g}–"
        f"{t.fair_within_sec:g}s after the pause: {text} (each ≥ {t.fair_share:.0%}); a fair"
        f" {t.share_window_sec:g}s window first {'never' if fair is None else f'after {fair:.2f}s'}"
    )
    return [Check("each instance's share after the pause", not low, detail)]


def _no_breaker_opened(
    bed: Bed, fault: Fault, calls: Sequence[Call], breakers: object
) -> list[Check]:
    """The caller's breakers stay closed through a server restart: instances that have
    not reconnected yet are not failing (item 9 of the issue)."""
    samples = cast(Sequence[Sequence[Any]], breakers)
    opened = sorted({str(who) for t, who, state in samples if t >= fault.at and state == "open"})
    detail = "none opened" if not opened else f"opened: {', '.join(opened)}"
    return [Check("no breaker opens while the fabric comes back", not opened, detail)]


def _all_open(bed: Bed, fault: Fault, calls: Sequence[Call], breakers: object) -> list[Check]:
    """Every breaker was open at once (the fault did what it is for), and the calls
    started meanwhile waited for a trial instead of failing (the failed-calls check
    counts those that failed)."""
    samples = cast(Sequence[Sequence[Any]], breakers)
    since = all_open_since(samples, bed.instances, fault.at)
    if since is None:
        return [
            Check(
                "every breaker opens",
                False,
                f"never all open at once after the hang began ({len(samples)} samples)",
            )
        ]
    waited = [c for c in calls if since <= c.start < fault.end]
    failed = sum(1 for c in waited if not c.ok)
    longest = max((c.end - c.start for c in waited if c.ok), default=0.0)
    fault.facts.update(
        all_open_after_sec=round(since - fault.at, 2),
        started_all_open=len(waited),
        longest_wait_sec=round(longest, 2),
    )
    return [
        Check(
            "every breaker opens",
            True,
            f"all {len(bed.instances)} open {since - fault.at:.2f}s after the hang began",
        ),
        Check(
            "calls started with every breaker open wait for a trial",
            bool(waited) and failed == 0,
            f"{len(waited)} started then, {failed} failed; the longest served one took"
            f" {longest:.2f}s",
        ),
    ]


def _breaker_timing(bed: Bed, fault: Fault, calls: Sequence[Call], breakers: object) -> list[Check]:
    t = bed.timing
    victim = fault.victim or ""
    # its breaker opens, or the outlier detection ejects it first: either sets it aside
    opened = breaker_opened(breakers, victim, fault.at, ("open", "ejected"))  # type: ignore[arg-type]
    open_sec = None if opened is None else opened - fault.at
    back = next(
        (
            c.start - fault.end
            for c in calls
            if c.ok and c.served_by == victim and c.start >= fault.end
        ),
        None,
    )
    fault.facts.update(
        breaker_open_after_sec=None if open_sec is None else round(open_sec, 2),
        serving_again_after_sec=None if back is None else round(back, 2),
    )
    opened_in_time = open_sec is not None and open_sec <= t.breaker_within_sec
    back_in_time = back is not None and back <= t.breaker_within_sec
    return [
        Check(
            "set aside during the hang",
            opened_in_time,
            f"{victim}'s breaker opened or it was ejected "
            + ("never during the run" if open_sec is None else f"{open_sec:.2f}s after the hang")
            + f" (target ≤ {t.breaker_within_sec:g}s)",
        ),
        Check(
            "the recovered instance serves again",
            back_in_time,
            f"{victim} served a call "
            + ("never after SIGCONT" if back is None else f"{back:.2f}s after SIGCONT")
            + f" (target ≤ {t.breaker_within_sec:g}s)",
        ),
    ]


# -- servers and the login gate ------------------------------------------------------------


async def _lead_where_the_caller_is(admin: Any, bed: Bed, stream: str) -> None:
    """Move ``stream``'s leadership to the caller's node (a leader step-down naming it),
    so that killing the leader makes the caller log in again during the election."""
    import json

    from reach.errors import ReachError

    urls = bed.fabric.urls
    if bed.caller_url not in urls:
        return
    node = f"reach-{urls.index(bed.caller_url) + 1}"
    wanted = int(bed.caller_url.rsplit(":", 1)[1])
    request = json.dumps({"placement": {"preferred": node}}).encode()
    for _ in range(3):
        if await leader_port(admin, bed.fabric, stream) == wanted:
            break
        with contextlib.suppress(ReachError):
            await admin.request(f"$JS.API.STREAM.LEADER.STEPDOWN.{stream}", request, timeout=5.0)
        await asyncio.sleep(1.0)  # the new leader is elected


async def _kill_credentials_leader(bed: Bed) -> Fault:
    from reach.security.membership import connect_as
    from reach.wire import subjects

    fabric = bed.fabric
    stream = f"KV_{subjects.CREDENTIALS_BUCKET}"
    admin, _ = await connect_as(fabric.urls, name="faults-admin", credentials=fabric.admin_creds)
    try:
        # the bucket at 3 current replicas first: a kill then forces a leader election
        async def current() -> bool:
            group = (await stream_info(admin, stream)).get("cluster", {})
            followers = group.get("replicas", [])
            return (
                bool(group.get("leader"))
                and len(followers) == 2
                and all(f.get("current") for f in followers)
            )

        deadline = time.monotonic() + _BACK_TIMEOUT
        while time.monotonic() < deadline:
            if await current():
                break
            await asyncio.sleep(0.1)
        await _lead_where_the_caller_is(admin, bed, stream)
        port = await leader_port(admin, fabric, stream)
    finally:
        await admin.close()
    pid = fabric.nats_pids().get(port) if port is not None else None
    if port is None or pid is None:
        raise FaultNotInjected(f"no running nats-server leads {stream} (leader port {port})")
    at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    back = await _until(lambda: fabric.nats_pids().get(port) not in (None, pid), _BACK_TIMEOUT)
    restarted = back is not None
    bed.checks.append(
        Check(
            "the killed node is started again",
            restarted,
            f"node on port {port} "
            + (
                f"back after {back - at:.2f}s"
                if back is not None
                else f"not back in {_BACK_TIMEOUT:g}s"
            ),
        )
    )
    facts = {"killed_port": port, "caller_on_killed_node": bed.caller_url.endswith(f":{port}")}
    return Fault(at, back or time.monotonic(), None, facts)


async def _kill_server(bed: Bed) -> Fault:
    fabric = bed.fabric
    pids = fabric.nats_pids()
    if len(pids) != 1:
        raise FaultNotInjected(f"expected one nats-server below reach up, found {pids}")
    ((port, pid),) = pids.items()
    at = time.monotonic()
    os.kill(pid, signal.SIGKILL)

    def restarted() -> bool:
        return not fabric.up_alive() or fabric.nats_pids().get(port) not in (None, pid)

    back = await _until(restarted, _BACK_TIMEOUT)
    if not fabric.up_alive():
        detail = (
            f"reach up exited (rc {fabric.up.returncode}) after its nats-server was killed"
            f" instead of starting it again; its log:\n{fabric.up_log()}"
        )
        bed.checks.append(Check("reach up restarts its nats-server", False, detail))
    else:
        detail = f"back after {back - at:.2f}s" if back else f"not back in {_BACK_TIMEOUT:g}s"
        bed.checks.append(Check("reach up restarts its nats-server", back is not None, detail))
    return Fault(at, back or time.monotonic(), None)


def _said_since(log: Path, offset: int) -> str:
    """What ``reach up`` wrote to ``log`` past ``offset``."""
    try:
        with log.open("rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")
    except OSError:
        return ""


async def _fill_disk(bed: Bed) -> Fault:
    """A file takes every free byte of the store's disk while calls flow; once ``reach
    up`` said so, the disk stays full ``disk_full_sec``, then the file is deleted. The
    fault ends when ``reach up`` says its store takes writes again (it starts its
    nats-server again: only a start reopens a store that met a write error)."""
    fabric = bed.fabric
    t = bed.timing
    if fabric.disk is None:
        raise FaultNotInjected("the store is on no disk of its own (a small-disk fabric)")
    log = fabric.workdir / "up.err"
    offset = log.stat().st_size if log.exists() else 0
    at = time.monotonic()
    filler = await asyncio.to_thread(fill, fabric.disk)
    try:
        named = await _until(
            lambda: "its JetStream store takes no writes" in _said_since(log, offset),
            t.store_named_sec,
        )
        await asyncio.sleep(t.disk_full_sec)
    finally:
        await asyncio.to_thread(filler.unlink)
    freed = time.monotonic()
    back = await _until(lambda: "takes writes again" in _said_since(log, offset), _BACK_TIMEOUT)
    said = _said_since(log, offset)
    named_sec = None if named is None else named - at
    back_sec = None if back is None else back - freed
    bed.checks += [
        Check(
            "reach up names the full store",
            named_sec is not None and "no space left on device" in said,
            ("never" if named_sec is None else f"{named_sec:.2f}s after the disk filled")
            + f" (target ≤ {t.store_named_sec:g}s)",
        ),
        Check(
            "the store takes writes again",
            back_sec is not None and back_sec <= t.store_back_sec,
            ("not" if back_sec is None else f"{back_sec:.2f}s after the disk had room")
            + f" (target ≤ {t.store_back_sec:g}s)",
        ),
    ]
    facts = {
        "named_after_sec": None if named_sec is None else round(named_sec, 2),
        "writes_again_after_sec": None if back_sec is None else round(back_sec, 2),
    }
    return Fault(at, back or time.monotonic(), None, facts)


async def _gate_down_across_server_restart(bed: Bed) -> Fault:
    """The operator's layout: reach up (registrar and login gate) dies, the nats-server
    it answers logins for restarts meanwhile, reach up is back ``gate_down_sec`` later."""
    fabric = bed.fabric
    up_pids = [fabric.up.pid, *descendants(fabric.up.pid)]
    at = time.monotonic()
    for pid in up_pids:  # reach up and whatever it started, by id
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    await asyncio.to_thread(fabric.up.wait)
    await asyncio.sleep(1.0)
    fabric.server.kill()
    await fabric.server.start()
    server_back = time.monotonic()
    await asyncio.sleep(max(0.0, at + bed.timing.gate_down_sec - time.monotonic()))
    await fabric.restart_up()
    facts = {
        "server_back_sec": round(server_back - at, 2),
        "gate_back_sec": round(time.monotonic() - at, 2),
    }
    return Fault(at, time.monotonic(), None, facts)


async def _kill_registrar(bed: Bed) -> Fault:
    fabric = bed.fabric
    pid = fabric.registrar_pid()
    if pid is None:
        raise FaultNotInjected(
            f"no running registrar part: {fabric.store / 'registrar.pid'} names no live"
            " process (reach up runs its registrar, issuer and login gate in its own process)"
        )
    servers = fabric.nats_pids()
    at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    back = await _until(lambda: fabric.registrar_pid() not in (None, pid), _BACK_TIMEOUT)
    limit = bed.timing.registrar_back_sec
    took = None if back is None else back - at
    bed.checks += [
        Check(
            "the registrar part is back",
            took is not None and took <= limit,
            ("not back" if took is None else f"back after {took:.2f}s") + f" (target ≤ {limit:g}s)",
        ),
        Check(
            "nats-server keeps running",
            fabric.up_alive() and fabric.nats_pids() == servers,
            f"nats-server pids {servers} before, {fabric.nats_pids()} after",
        ),
    ]
    return Fault(at, back or time.monotonic(), None)


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario("baseline", "baseline", "single", None),
        Scenario(
            "kill-instance",
            "SIGKILL 1 of 3 idempotent instances",
            "single",
            _kill_instance,
            established_caller=True,
        ),
        Scenario(
            "cluster-kill-credentials-leader",
            "`--cluster 3`, SIGKILL the node leading KV_REACH_CREDENTIALS",
            "cluster",
            _kill_credentials_leader,
        ),
        Scenario(
            "gate-down-server-restart",
            "single node: nats-server restarts while the login gate is down",
            "operator",
            _gate_down_across_server_restart,
            call_timeout=lambda t: t.gate_down_sec + t.call_timeout_sec,
        ),
        Scenario(
            "kill-server",
            "single node: SIGKILL nats-server",
            "single",
            _kill_server,
            extra=_no_breaker_opened,
        ),
        Scenario(
            "kill-server-herd",
            "single node: SIGKILL nats-server, instances of max_concurrency 2",
            "single",
            _kill_server,
            # the calls held while the server is away come back at once, many times what
            # three instances admit
            max_concurrency=2,
            rate_at_least=200.0,
        ),
        Scenario(
            "pause-short",
            "a 150 ms SIGSTOP of 1 of 3 instances",
            "single",
            _pause(lambda t: t.short_pause_sec),
            extra=_fair_share,
        ),
        Scenario(
            "hang-long",
            "a 10 s SIGSTOP of 1 of 3",
            "single",
            _pause(lambda t: t.long_pause_sec),
            extra=_breaker_timing,
            # the rate: how soon failures add up to an open breaker depends on it
            rate_at_least=200.0,
        ),
        Scenario(
            "all-breakers-open",
            "every instance hangs 1.5 s: every breaker of the caller opens",
            "single",
            _hang_all,
            extra=_all_open,
            established_caller=True,
            timeouts_in_fault=True,
            # the registrar's verdict comes after the hang: the breakers alone set the
            # instances aside (with every instance unhealthy a call fails at once with
            # NoHealthyInstance, which names why)
            failures_before_unhealthy=6,
        ),
        Scenario(
            "kill-non-idempotent",
            "SIGKILL of a non-idempotent instance, young caller",
            "single",
            _kill_instance,
            idempotent=False,
            rate_at_least=100.0,
        ),
        Scenario(
            "kill-registrar", "SIGKILL of reach up's registrar part", "single", _kill_registrar
        ),
        Scenario(
            "disk-full",
            "the store's disk fills, then has room again",
            "small-disk",
            _fill_disk,
        ),
        Scenario(
            "stall-caller-node",
            "`--cluster 3`, SIGSTOP of the node under the caller",
            "cluster",
            _stall_caller_node,
            stalled_for=lambda t: t.stall_recover_sec,
        ),
        Scenario(
            "stall-registrar",
            "SIGSTOP of reach up's registrar part",
            "single",
            _stall_registrar,
        ),
        Scenario(
            "crash-instance",
            "1 of 3 raises on every call, its probes passing",
            "single",
            _misbehave(signal.SIGUSR1),
            extra=_set_aside(lambda t: t.crash_share),
            handler_fails=True,
        ),
        Scenario(
            "crawl-instance",
            "1 of 3 answers at 5 × its SLA, its probes passing",
            "single",
            _misbehave(signal.SIGUSR2),
            extra=_set_aside(lambda t: t.crawl_share),
        ),
    )
}
