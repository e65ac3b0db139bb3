"""What a registrar is told: its id, the KV replicas, its health policy's settings, limits."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from reach.agent.jobs import JOB_RETENTION_SEC
from reach.audit.alerts import AlertRules
from reach.audit.streams import StreamSettings
from reach.clock import Clock, system_clock

__all__ = ["RegistrarConfig"]


@dataclass
class RegistrarConfig:
    registrar_id: str = field(default_factory=lambda: f"reg-{secrets.token_hex(4)}")
    #: KV replicas (3 on a NATS cluster)
    replicas: int = 1
    #: an instance silent for this many health intervals is removed from the registry
    evict_after_intervals: float = 3.0
    #: instances younger than this are probed twice as often
    new_agent_window_sec: float = 24 * 3600.0
    #: how often this registrar refreshes its own liveness record
    liveness_interval_sec: float = 1.0
    #: a record registered this recently counts as live even if it does not answer a probe yet
    duplicate_grace_sec: float = 1.0
    max_message_bytes: int = 256 * 1024
    max_concurrent_probes: int = 512
    #: heartbeats waiting to be handled or being written at once above which this registrar
    #: is behind: it then evicts nobody and marks nobody unhealthy for silence until it has
    #: caught up (their heartbeats may be among those waiting), rather than turning its own
    #: overload into evictions, re-announces and more load
    max_backlog: int = 1000
    transitions_kept: int = 20
    job_retention_sec: float = JOB_RETENTION_SEC
    #: retention and replicas of REACH_AUDIT / REACH_ALERTS (replicas follow ``replicas``)
    streams: StreamSettings = field(default_factory=StreamSettings)
    #: alert rules; None runs no alert watcher in this registrar
    alerts: AlertRules | None = field(default_factory=AlertRules)
    clock: Clock = field(default=system_clock, repr=False)
