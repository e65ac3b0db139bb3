"""A scenario's test bed: the fabric, three instances in three processes and the timings.

The instances serve one echo capability (``bench.failover``'s agent child, one process
each, with the run's credentials); the caller is :mod:`bench.faults.caller`.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.failover import echo_manifest
from bench.faults.analysis import Check
from bench.faults.fabric import Fabric, base_env
from bench.procs import Child

__all__ = ["BENCH", "QUICK", "TESTS", "Bed", "Timing"]


@dataclass(frozen=True)
class Timing:
    """Load and fault durations of a run (the tests' and the benchmark's differ)."""

    #: calls started per second (open loop)
    rate: float = 200.0
    #: seconds of load before the fault (the caller's age at the fault)
    pre_sec: float = 10.0
    #: seconds of load before the fault in scenarios about a caller that has run a while
    established_sec: float = 10.0
    #: seconds of load after the fault ended
    post_sec: float = 20.0
    #: a call's deadline: covers a single-node server restart, so idempotent calls can
    #: wait it out; with the login gate down, the gate's outage is added
    call_timeout_sec: float = 10.0
    #: the instances' latency SLA: one attempt waits 1.5 × this
    latency_sla_ms: float = 200.0
    #: the instances' health checks (manifest ``health``), as in ``bench.failover``
    health_interval_sec: float = 1.0
    probe_timeout_sec: float = 0.5
    failures_before_unhealthy: int = 2
    #: a killed instance is started again after this
    restart_after_sec: float = 2.0
    short_pause_sec: float = 0.15
    long_pause_sec: float = 10.0
    #: the store's disk stays full this long after ``reach up`` said so
    disk_full_sec: float = 10.0
    #: ``reach up`` names a full store within this of the disk filling ...
    store_named_sec: float = 30.0
    #: ... and takes writes again within this of the disk having room again
    store_back_sec: float = 10.0
    #: every instance hangs (SIGSTOP) this long: every breaker of the caller opens
    all_hang_sec: float = 1.5
    #: how long the login gate stays down across a nats-server restart
    gate_down_sec: float = 8.0
    #: after a short pause each instance has ``fair_share`` of the calls within this
    fair_within_sec: float = 10.0
    fair_share: float = 0.20
    #: the calls over which a share is counted
    share_window_sec: float = 2.0
    #: every instance must serve calls in this last stretch of the load
    tail_sec: float = 2.0
    #: a hung instance's breaker opens within this; a recovered one serves again within it
    breaker_within_sec: float = 1.0
    #: the registrar part of ``reach up`` is back within this
    registrar_back_sec: float = 2.0
    #: attempts sent to a killed instance this soon after the kill count as in flight
    #: (the server sees the process gone only once the kernel closed its socket)
    in_flight_grace_sec: float = 0.25
    #: how long the node under the caller (SIGSTOP) and the registrar part stall
    node_stall_sec: float = 15.0
    registrar_stall_sec: float = 15.0
    #: with the node under the caller stalled, calls started this long after the stall
    #: began succeed (the connection gave the node up and went to another)
    stall_recover_sec: float = 3.0
    #: how long an instance raises on every call, or crawls at 5 × its SLA, while its
    #: probes pass
    misbehave_sec: float = 8.0
    #: from this long after such a fault began, the instance's share of the attempts ...
    outlier_within_sec: float = 5.0
    #: ... is below this when it raises on every call, and below ``crawl_share`` when it
    #: crawls
    crash_share: float = 0.02
    crawl_share: float = 0.005
    instances: int = 3


BENCH = Timing()
QUICK = Timing(
    rate=50.0,
    pre_sec=2.0,
    post_sec=3.0,
    gate_down_sec=4.0,
    long_pause_sec=3.0,
    node_stall_sec=5.0,
    registrar_stall_sec=5.0,
    disk_full_sec=3.0,
)
#: the tests': a few seconds of load each, the targets of the issue unchanged
TESTS = Timing(
    rate=40.0,
    pre_sec=2.0,
    post_sec=5.0,
    gate_down_sec=6.0,
    established_sec=8.0,
    node_stall_sec=5.0,
    registrar_stall_sec=5.0,
    misbehave_sec=6.0,
    disk_full_sec=3.0,
)


@dataclass
class Bed:
    name: str
    fabric: Fabric
    timing: Timing
    capability: str
    idempotent: bool
    logs: Path
    #: each instance's max_concurrency (None: 64, the manifest's default)
    max_concurrency: int | None = None
    manifests: dict[str, dict[str, Any]] = field(default_factory=dict)
    agents: dict[str, Child] = field(default_factory=dict)
    #: the server the caller is connected to (from its READY line)
    caller_url: str = ""
    #: checks made while the fault was injected (restart times, pids)
    checks: list[Check] = field(default_factory=list)

    @property
    def instances(self) -> list[str]:
        return list(self.manifests)

    def env(self, name: str) -> dict[str, str]:
        env = base_env(self.fabric.workdir, name)
        env["REACH_CREDS"] = str(self.fabric.creds)
        return env

    async def start_agent(self, agent_id: str) -> Child:
        """The instance ``agent_id`` in a process of its own (again, after a kill)."""
        child = await Child.launch(
            f"agent-{agent_id}-{int(time.monotonic() * 1000)}",
            "bench.failover",
            ["agents", ",".join(self.fabric.urls), json.dumps([self.manifests[agent_id]])],
            self.logs,
            env=self.env(agent_id),
        )
        self.agents[agent_id] = child
        return child

    async def start_agents(self) -> None:
        for i in range(self.timing.instances):
            agent_id = f"fi-{self.name}-{i}"
            self.manifests[agent_id] = echo_manifest(
                agent_id,
                self.capability,
                latency_sla_ms=self.timing.latency_sla_ms,
                interval_sec=self.timing.health_interval_sec,
                probe_timeout_sec=self.timing.probe_timeout_sec,
                failures_before_unhealthy=self.timing.failures_before_unhealthy,
                idempotent=self.idempotent,
                max_concurrency=self.max_concurrency or 64,
            )
        await asyncio.gather(*(self.start_agent(a) for a in self.manifests))

    async def stop_agents(self) -> None:
        for child in self.agents.values():
            if child.proc.returncode is None:
                # a paused one must be able to stop
                os.kill(child.pid, signal.SIGCONT)
        await asyncio.gather(*(c.stop() for c in self.agents.values()), return_exceptions=True)
