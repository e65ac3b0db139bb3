"""The registrar's health policy: healthy, degraded, unhealthy or evicted, and when to probe.

A state machine on a :class:`~reach.clock.Clock` that does no I/O. The registrar's
message handlers and its sweep tell it what they heard (heartbeats, probe results, their
own trouble keeping the registry current) and ask it what an instance's record becomes;
they do the KV writes. Every decision on a record is a pure function of the record and
this policy's state, so a compare-and-set that meets a newer record asks again.

Liveness is kept apart from the record: the registrar that owns an instance's heartbeat
partition (:mod:`reach.registry.ownership`) remembers when it last heard it, and a
heartbeat rewrites the record only for a change routing reads
(:mod:`reach.registry.material`), so route caches see changes, not renewals. The record's
``last_heartbeat_at`` is the heartbeat last written, not the last one heard.

Silence is counted from the latest heartbeat this registrar knows of (heard or written),
never from before it started, last had trouble (its watch failing, a failed sweep, a
backlog of messages, its connection coming back) or took over the instance's partition:
heartbeats may have arrived then elsewhere or been lost, and an instance is not evicted
for the registrar's own trouble nor for a handover.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from reach.clock import Clock
from reach.errors import NoResponders, ReachError
from reach.registry.material import material_change
from reach.wire.models import (
    HealthStatus,
    Heartbeat,
    Instance,
    ProbeReply,
    Readiness,
    Transition,
    clip_reason,
)

__all__ = ["HealthPolicy", "ProbeOutcome", "UnwrittenProbe", "Verdict"]

log = logging.getLogger("reach.registrar")

#: while behind on its messages, a registrar says so at most this often
_BEHIND_WARNING_EVERY_SEC = 10.0

#: (when, ms) of a successful probe that changed nothing and so was not written
UnwrittenProbe = tuple[float, float]


class ProbeOutcome(Protocol):
    """What the policy reads of a probe (:class:`reach.registry.probes.ProbeResult`)."""

    @property
    def reply(self) -> ProbeReply | None: ...
    @property
    def latency_ms(self) -> float: ...
    @property
    def reason(self) -> str: ...
    @property
    def error(self) -> ReachError | None: ...


@dataclass(frozen=True, slots=True)
class Verdict:
    """What a sweep does about one instance it owns.

    ``keep``: nothing for its silence; ``evict``: remove it if the record as it is at the
    write is still silent for ``limit`` seconds; ``unhealthy``: mark it so, with ``reason``.
    """

    action: Literal["keep", "evict", "unhealthy"] = "keep"
    reason: str = ""
    limit: float = 0.0


#: what a sweep does about most instances most of the time
_KEEP = Verdict()
#: the reasons of the answers that make an instance healthy
_OK_REASONS = {"heartbeat": "heartbeat ok", "probe": "probe ok"}


class HealthPolicy:
    """Health transitions of the instances one registrar keeps, on an injected clock."""

    def __init__(
        self,
        clock: Clock,
        *,
        evict_after_intervals: float = 3.0,
        new_agent_window_sec: float = 24 * 3600.0,
        transitions_kept: int = 20,
        max_backlog: int = 1000,
    ) -> None:
        self.clock = clock
        self.evict_after_intervals = evict_after_intervals
        self.new_agent_window_sec = new_agent_window_sec
        self.transitions_kept = transitions_kept
        self.max_backlog = max_backlog
        #: when this registrar started keeping the registry (0 until it does)
        self.started_at = 0.0
        #: when it last could not keep the registry current (see the module's docstring)
        self.trouble_at = 0.0
        #: per instance: when this registrar last heard a heartbeat of it (written or not)
        self._heard: dict[str, float] = {}
        #: per instance: its latest successful probe that changed nothing and so was not
        #: written; the next heartbeat's write carries it (no write of its own)
        self._probed: dict[str, UnwrittenProbe] = {}
        #: per instance: when its latest probe started
        self._last_probe: dict[str, float] = {}

    # -- this registrar's own state ----------------------------------------------------

    def start(self) -> None:
        """The registrar starts keeping the registry: no silence is counted from before."""
        self.started_at = self.clock.time()

    def trouble(self) -> None:
        """The registrar could not keep the registry current: silence counts from now."""
        self.trouble_at = self.clock.time()

    def check_backlog(self, handling: int, now: float) -> None:
        """With more than ``max_backlog`` messages being handled the registrar is behind:
        the heartbeats that would refresh the records may be among them, so it is trouble
        (nobody is evicted or marked unhealthy for silence until it has caught up)."""
        if handling <= self.max_backlog:
            return
        if now - self.trouble_at > _BEHIND_WARNING_EVERY_SEC:
            log.warning(
                "registrar behind: %d messages being handled; no eviction until caught up",
                handling,
            )
        self.trouble()

    def forget(self, agent_id: str) -> None:
        """The record is gone: drop what this policy kept about it."""
        self._last_probe.pop(agent_id, None)
        self._probed.pop(agent_id, None)
        self._heard.pop(agent_id, None)

    # -- statuses ------------------------------------------------------------------------

    @staticmethod
    def status_from(readiness: Readiness, source: str) -> tuple[HealthStatus, str]:
        """The status an answer (``source``: heartbeat, probe) with ``readiness`` gives."""
        if readiness.ready:
            return "healthy", _OK_REASONS.get(source) or f"{source} ok"
        return "degraded", f"not ready: {readiness.reason or 'readiness check failed'}"

    @staticmethod
    def announced(readiness: Readiness) -> tuple[HealthStatus, str]:
        """The status of a freshly announced instance."""
        if readiness.ready:
            return "healthy", "announced"
        return "degraded", f"not ready: {readiness.reason}"

    def with_transition(self, transitions: list[Transition], new: Transition) -> list[Transition]:
        """``transitions`` with ``new`` appended, the latest ``transitions_kept`` kept."""
        return [*transitions, new][-self.transitions_kept :]

    def with_status(
        self, inst: Instance, status: HealthStatus, reason: str, now: float
    ) -> Instance:
        """``inst`` in ``status`` (a transition recorded), or ``inst`` itself if already so."""
        if inst.status == status:
            return inst
        reason = clip_reason(reason)
        log.info("%s: %s → %s (%s)", inst.agent_id, inst.status, status, reason)
        return inst.model_copy(
            update={
                "status": status,
                "status_reason": reason,
                "transitions": self.with_transition(
                    inst.transitions, Transition(at=now, status=status, reason=reason)
                ),
            }
        )

    # -- heartbeats ----------------------------------------------------------------------

    def unwritten_probe(self, agent_id: str) -> UnwrittenProbe | None:
        """The probe result the next heartbeat's write of ``agent_id`` carries, if any."""
        return self._probed.get(agent_id)

    def after_heartbeat(
        self, inst: Instance, hb: Heartbeat, now: float, probed: UnwrittenProbe | None
    ) -> Instance | None:
        """The record after heartbeat ``hb``: ``inst`` itself (nothing to write) unless it
        changed something routing reads (:func:`~reach.registry.material.material_change`);
        None: not this instance's record.

        A heartbeat says the process lives, not that it answers: an instance whose probes
        fail stays unhealthy until a probe succeeds, else its health would flap."""
        if inst.instance_id != hb.instance_id:
            return None
        status = inst.status
        if inst.consecutive_failures < inst.manifest.health.failures_before_unhealthy:
            status = "healthy" if hb.readiness.ready else "degraded"  # as status_from says
        changed = material_change(
            inst,
            status=status,
            readiness=hb.readiness,
            in_flight=hb.in_flight,
            max_concurrency=hb.max_concurrency,
        )
        return self._heartbeat_record(inst, hb, now, probed) if changed else inst

    def _heartbeat_record(
        self, inst: Instance, hb: Heartbeat, now: float, probed: UnwrittenProbe | None
    ) -> Instance:
        update: dict[str, Any] = {
            "last_heartbeat_at": now,
            "in_flight": hb.in_flight,
            "max_concurrency": hb.max_concurrency,
            "completed": hb.completed,
            "last_completion_at": hb.last_completion_at,
            "memory_bytes": hb.memory_bytes,
            "readiness": hb.readiness,
        }
        if probed is not None and probed[0] > (inst.last_probe_at or 0.0):
            update["last_probe_at"], update["last_probe_ms"] = probed
        updated = inst.model_copy(update=update)
        if inst.consecutive_failures >= inst.manifest.health.failures_before_unhealthy:
            return updated
        return self.with_status(updated, *self.status_from(hb.readiness, "heartbeat"), now)

    def probe_written(self, agent_id: str, probed: UnwrittenProbe | None) -> None:
        """A heartbeat's write carried ``probed``: unless a newer probe came meanwhile,
        nothing is left to write."""
        if probed is not None and self._probed.get(agent_id) == probed:
            del self._probed[agent_id]

    def heard(self, agent_id: str, now: float) -> None:
        """A heartbeat of ``agent_id`` arrived (whether or not it is written): its silence
        counts from now."""
        self._heard[agent_id] = now

    def heard_at(self, agent_id: str) -> float | None:
        """When this registrar last heard a heartbeat of ``agent_id``, if it did."""
        return self._heard.get(agent_id)

    # -- probes --------------------------------------------------------------------------

    def _probe_every(self, inst: Instance, now: float) -> float:
        """Seconds between probes of ``inst``: its health interval, half of it while it is
        younger than ``new_agent_window_sec``."""
        probe_every = inst.manifest.health.interval_sec
        if inst.age(now) < self.new_agent_window_sec:
            probe_every /= 2
        return probe_every

    def probe_due(self, inst: Instance, now: float) -> bool:
        """Whether ``inst`` is due a probe: every health interval, twice as often while it
        is younger than ``new_agent_window_sec``."""
        last = self._last_probe.get(inst.agent_id, inst.registered_at)
        return now - last >= self._probe_every(inst, now)

    def next_probe_at(self, inst: Instance, now: float) -> float:
        """When ``inst`` is next due a probe, as things stand at ``now`` (:meth:`probe_due`
        is False before then; a probe started or the instance growing older only moves
        it later)."""
        return self._last_probe.get(inst.agent_id, inst.registered_at) + self._probe_every(
            inst, now
        )

    def probe_plan(self, inst: Instance, now: float) -> tuple[bool, float]:
        """:meth:`probe_due` and :meth:`next_probe_at` in one reading, for the sweep:
        whether ``inst`` is due a probe, and when the next one is due once that probe is
        started at ``now``."""
        probe_every = self._probe_every(inst, now)
        last = self._last_probe.get(inst.agent_id, inst.registered_at)
        if now - last >= probe_every:
            return True, now + probe_every
        return False, last + probe_every

    def probe_started(self, agent_id: str, now: float) -> None:
        self._last_probe[agent_id] = now

    def after_probe(
        self, cur: Instance, instance_id: str, result: ProbeOutcome, now: float
    ) -> Instance | None:
        """The record after a probe of instance ``instance_id`` (None: nothing to write).

        A success that changes nothing is not written (unless it is the instance's first
        measured latency): the next change a heartbeat brings carries it.
        ``failures_before_unhealthy`` failures in a row make the instance unhealthy; a
        probe nobody received while the fabric settles is no failure (:meth:`settling`)."""
        if cur.instance_id != instance_id:
            return None
        if result.reply is not None:
            unchanged = cur.consecutive_failures == 0 and cur.status == (
                "healthy" if result.reply.readiness.ready else "degraded"
            )
            if unchanged and cur.last_probe_ms is not None:
                self._probed[cur.agent_id] = (now, result.latency_ms)
                return None
            status, reason = self.status_from(result.reply.readiness, "probe")
            updated = cur.model_copy(
                update={
                    "consecutive_failures": 0,
                    "last_probe_at": now,
                    "last_probe_ms": result.latency_ms,
                    "readiness": result.reply.readiness,
                    "in_flight": result.reply.in_flight,
                }
            )
            return self.with_status(updated, status, reason, now)
        if self.settling(cur, now, result):
            return None
        failures = cur.consecutive_failures + 1
        updated = cur.model_copy(update={"consecutive_failures": failures, "last_probe_at": now})
        if failures >= cur.manifest.health.failures_before_unhealthy:
            reason = f"{failures} consecutive probe failures, last: {result.reason}"
            return self.with_status(updated, "unhealthy", reason, now)
        return updated

    def settling(self, inst: Instance, now: float, result: ProbeOutcome) -> bool:
        """A probe nobody received, soon after this registrar's own trouble (its connection
        back after a server restart, say) or start: the instance may not have reconnected
        yet, which its heartbeats will show, as they do when they stop. Not a failure until
        the instance has had the time a silence would be given."""
        if not isinstance(result.error, NoResponders):
            return False
        health = inst.manifest.health
        since = max(self.trouble_at, self.started_at)
        return now - since < health.interval_sec * health.failures_before_unhealthy

    # -- silence -------------------------------------------------------------------------

    def silence(self, inst: Instance, now: float, since: float = 0.0) -> float:
        """How long the instance has not been heard from, as far as this registrar knows:
        since its last heartbeat, written or only heard, but never counting time before
        this registrar started, last had trouble keeping the registry current, or took
        the instance over (``since``: when it came to own the instance's partition)."""
        heard = max(inst.last_heartbeat_at, self._heard.get(inst.agent_id, 0.0))
        return now - max(heard, self.started_at, self.trouble_at, since)

    def review(self, inst: Instance, now: float, since: float = 0.0) -> Verdict:
        """What a sweep does about ``inst`` for its silence: evicted once silent for
        ``evict_after_intervals`` intervals, unhealthy once it missed
        ``failures_before_unhealthy`` heartbeats (``since``: see :meth:`silence`)."""
        silence = self.silence(inst, now, since)
        action = self._action_for(inst, silence)
        if action == "keep":
            return _KEEP
        interval = inst.manifest.health.interval_sec
        if action == "evict":
            evict_after = self.evict_after_intervals * interval
            return Verdict("evict", f"silent for {silence:.1f}s: evicted", evict_after)
        missed = int(silence / interval)
        return Verdict("unhealthy", f"missed {missed} heartbeats ({silence:.1f}s silent)")

    def _action_for(self, inst: Instance, silence: float) -> Literal["evict", "unhealthy", "keep"]:
        health = inst.manifest.health
        if silence >= self.evict_after_intervals * health.interval_sec:
            return "evict"
        missed = int(silence / health.interval_sec)
        if missed >= health.failures_before_unhealthy and inst.status != "unhealthy":
            return "unhealthy"
        return "keep"

    def next_review_at(self, inst: Instance, now: float, since: float = 0.0) -> float:
        """The earliest time :meth:`review` of this record may say anything but keep, as
        things stand at ``now``: a heartbeat heard, this registrar's trouble or a later
        ``since`` only move it later; a change of the record may not (ask again then)."""
        return self._review_at(inst, now, self.silence(inst, now, since))

    def _review_at(self, inst: Instance, now: float, silence: float) -> float:
        health = inst.manifest.health
        base = now - silence
        unhealthy_at = base + health.interval_sec * health.failures_before_unhealthy
        evict_at = base + self.evict_after_intervals * health.interval_sec
        if unhealthy_at > now:
            return min(unhealthy_at, evict_at)
        # missed enough heartbeats: marked already, or to be marked at every review
        return evict_at if inst.status == "unhealthy" else now

    def keep_until(self, inst: Instance, now: float, since: float) -> float | None:
        """:meth:`review` and :meth:`next_review_at` in one reading of the silence, for
        the sweep: None unless ``review`` says keep, else ``next_review_at``."""
        silence = self.silence(inst, now, since)
        if self._action_for(inst, silence) != "keep":
            return None
        return self._review_at(inst, now, silence)

    def still_silent(self, cur: Instance, now: float, limit: float, since: float = 0.0) -> bool:
        """Whether the record as it is now (a heartbeat written or heard since the review)
        is still silent for ``limit`` seconds."""
        return self.silence(cur, now, since) >= limit

    def missed_heartbeats(
        self, cur: Instance, reason: str, now: float, since: float = 0.0
    ) -> Instance:
        """The record marked unhealthy for its missed heartbeats, unless the record as it
        is now, or what this registrar heard, shows a heartbeat that came in meanwhile."""
        health = cur.manifest.health
        if self.silence(cur, now, since) < health.interval_sec * health.failures_before_unhealthy:
            return cur
        return self.with_status(cur, "unhealthy", reason, now)
