"""The registrar: accepts announces, follows heartbeats, probes instances, evicts the dead.

State lives in the KV bucket, never only in memory: every write is a compare-and-set on
the revision this registrar last saw, so several registrars can run at once and a
restart loses nothing. Each registrar keeps a view of the bucket through a watch.
Heartbeats are split into partitions by nats-server's subject mapping; each partition
belongs to one registrar, chosen by rendezvous hashing over the live registrars, which
hears its instances' heartbeats, keeps their liveness in memory, writes a record only for
a change routing reads, and probes and evicts them: work is split, and taken over when
one joins or dies.

This module puts the parts together and runs their loops:

- :mod:`~reach.registry.handlers` answers announces, heartbeats and byes, checked by
  :mod:`~reach.registry.message_auth` and held to a budget per agent id by
  :mod:`~reach.registry.controlbudget`; they are read on an intake connection whose lag
  :mod:`~reach.registry.intake` watches;
- :mod:`~reach.registry.health` decides every status (a state machine without I/O);
- :mod:`~reach.registry.instances` holds the view and writes with compare-and-set, kept
  current by :mod:`~reach.registry.watch`;
- :mod:`~reach.registry.ownership` says which heartbeat partitions are this registrar's,
  :mod:`~reach.registry.heartbeats` subscribes to them;
- :mod:`~reach.registry.sweep` evicts, marks and probes them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging

from reach.agent.jobs import JobStore
from reach.audit.alert_watcher import AlertWatcher
from reach.audit.streams import ensure_streams
from reach.audit.writer import AuditWriter
from reach.errors import ReachError
from reach.registry.config import RegistrarConfig
from reach.registry.handlers import ControlHandlers
from reach.registry.health import HealthPolicy
from reach.registry.heartbeats import HeartbeatFeed
from reach.registry.instances import RecordView
from reach.registry.intake import IntakeLag
from reach.registry.message_auth import MessageAuth
from reach.registry.ownership import Ownership
from reach.registry.probes import STALL_SEC
from reach.registry.store import RegistryStore
from reach.registry.sweep import MAX_TICK_SEC, Sweeper
from reach.registry.watch import RegistryWatch
from reach.security.membership import FabricSecurity
from reach.tasks import cancel_and_wait
from reach.transport import Connection, Message, Subscription
from reach.wire import envelope, subjects
from reach.wire.codec import Limits
from reach.wire.models import Instance, RegistrarRecord

__all__ = ["Registrar", "RegistrarConfig"]

log = logging.getLogger("reach.registrar")

#: how long start() waits for the registry watch to deliver every record
_SYNC_TIMEOUT_SEC = 30.0
#: the longest store problem said (``RegistrarRecord.store_problem``)
_PROBLEM_MAX = 4096


class Registrar:
    """Keeps REACH_REGISTRY true to what runs. ``await start()``, ``await stop()``."""

    def __init__(
        self,
        conn: Connection,
        config: RegistrarConfig | None = None,
        *,
        intake: Connection | None = None,
    ) -> None:
        """``intake``: the connection announces, heartbeats, byes and pings are read on
        (None: ``conn``); one of its own keeps a flood of them from queueing in front of
        probe answers and registry acks (see :mod:`~reach.registry.intake`)."""
        self._conn = conn
        self._intake = intake or conn
        self.config = config or RegistrarConfig()
        self._clock = self.config.clock
        cfg = self.config
        self._limits = Limits(max_bytes=cfg.max_message_bytes)
        self._policy = HealthPolicy(
            self._clock,
            evict_after_intervals=cfg.evict_after_intervals,
            new_agent_window_sec=cfg.new_agent_window_sec,
            transitions_kept=cfg.transitions_kept,
            max_backlog=cfg.max_backlog,
        )
        self._ownership = Ownership(cfg.registrar_id, on_change=self._partitions_changed)
        self._view = RecordView(on_gone=self._gone)
        self._auth = MessageAuth(conn, self._limits)
        self._handlers = ControlHandlers(
            conn,
            cfg.registrar_id,
            view=self._view,
            policy=self._policy,
            auth=self._auth,
            limits=self._limits,
            duplicate_grace_sec=cfg.duplicate_grace_sec,
        )
        self._heartbeats = HeartbeatFeed(
            self._intake,
            self._ownership,
            self._clock,
            self._handlers.heartbeat,
        )
        self._sweeper = Sweeper(
            conn,
            view=self._view,
            policy=self._policy,
            limits=self._limits,
            max_concurrent_probes=cfg.max_concurrent_probes,
            # heartbeats queued unheard, and those being written
            backlog=lambda: self._handlers.handling + self._heartbeats.pending(),
            judged_since=self._heartbeats.judged_since,
            ownership_version=lambda: self._heartbeats.version,
        )
        self._lag = IntakeLag(self._intake, self._clock, self._policy.trouble)
        self._subs: list[Subscription] = []
        #: the watch first, then the sweep and liveness loops
        self._loops: list[asyncio.Task[None]] = []
        self._stopping = False
        self._audit: AuditWriter | None = None
        self._alerts: AlertWatcher | None = None
        #: what the fabric's servers report wrong with its JetStream store ("" for
        #: nothing), as whoever reads their health tells it (``store_changed``)
        self.store_problem = ""

    @property
    def registrar_id(self) -> str:
        return self.config.registrar_id

    @property
    def store(self) -> RegistryStore:
        return self._view.store

    @property
    def denials(self) -> int:
        """Control messages refused for their token or mandate."""
        return self._handlers.denials

    @property
    def _records(self) -> dict[str, tuple[Instance, int]]:
        """This registrar's view: agent id → (record, revision)."""
        return self._view.by_agent

    @property
    def _handling(self) -> int:
        """Announces, heartbeats and byes being handled now."""
        return self._handlers.handling

    @property
    def _trouble_at(self) -> float:
        """When this registrar last could not keep the registry current."""
        return self._policy.trouble_at

    def instances(self) -> list[Instance]:
        """This registrar's current view of the registry."""
        return self._view.instances()

    def _gone(self, agent_id: str) -> None:
        self._policy.forget(agent_id)
        self._sweeper.probes.forget(agent_id)
        self._sweeper.forget(agent_id)

    def _partitions_changed(self) -> None:
        self._heartbeats.poke()

    @property
    def partitions(self) -> frozenset[int]:
        """The heartbeat partitions this registrar hears now."""
        return frozenset(self._heartbeats.since)

    async def start(self) -> None:
        self._auth.security = await FabricSecurity.join(
            self._conn, None, verify=True, need_token=False, clock=self._clock
        )
        self._view.attach(await RegistryStore.open(self._conn, replicas=self.config.replicas))
        await self._open_buckets_and_streams()
        self._audit = AuditWriter(self._conn)
        await self._audit.start()
        self._handlers.audit = self._audit
        if self.config.alerts is not None:
            # fed by this registrar's own registry watch (no second decode of every record)
            self._alerts = AlertWatcher(self._conn, self.config.alerts, self._clock)
            await self._alerts.start()
        self._policy.start()
        # disconnected, it heard no heartbeats: silence counts from when it is back
        self._conn.on_reconnect(self._policy.trouble)
        if self._intake is not self._conn:
            self._intake.on_reconnect(self._policy.trouble)
        watch = RegistryWatch(
            self._view,
            self._ownership,
            alerts=self._alerts,
            on_trouble=self._policy.trouble,
            running=lambda: not self._stopping,
        )
        self._loops.append(asyncio.create_task(watch.run(), name="registrar-watch"))
        await asyncio.wait_for(watch.synced.wait(), _SYNC_TIMEOUT_SEC)
        # its partitions heard before its record tells the others to give them up
        await self._subscribe()
        await self._refresh_liveness()
        await self._sweeper.start()
        self._loops.append(asyncio.create_task(self._heartbeats.run(), name="registrar-partitions"))
        self._loops.append(asyncio.create_task(self._sweep_loop(), name="registrar-sweep"))
        self._loops.append(asyncio.create_task(self._liveness_loop(), name="registrar-liveness"))
        self._loops.append(
            asyncio.create_task(self._handlers.refusals.run(), name="registrar-refusals")
        )
        self._loops.append(asyncio.create_task(self._lag.run(), name="registrar-intake-lag"))
        log.info("registrar %s started with %d records", self.registrar_id, len(self._records))

    async def _open_buckets_and_streams(self) -> None:
        # async-mode agents keep job results here; the bucket's TTL is the retention time
        await JobStore.open(
            self._conn,
            create=True,
            replicas=self.config.replicas,
            retention_sec=self.config.job_retention_sec,
        )
        streams = self.config.streams
        if streams.replicas != self.config.replicas:
            streams = dataclasses.replace(streams, replicas=self.config.replicas)
        await ensure_streams(self._conn, streams)

    async def _subscribe(self) -> None:
        handlers = self._handlers
        await self._heartbeats.start()
        for subject, handler in (
            (subjects.ANNOUNCE_ALL, handlers.on_announce),
            (subjects.BYE_ALL, handlers.on_bye),
        ):
            self._subs.append(
                await self._intake.subscribe(
                    subject, handlers.spawning(handler), queue=subjects.REGISTRAR_QUEUE
                )
            )
        self._subs.append(await self._intake.subscribe(subjects.REGISTRAR_PING, self._on_ping))
        await self._intake.flush()

    async def stop(self) -> None:
        self._stopping = True
        self._handlers.stopping = True
        for sub in self._subs:
            await sub.unsubscribe()
        self._subs.clear()
        await self._heartbeats.stop()
        await cancel_and_wait([*self._loops, *self._handlers.tasks, *self._sweeper.tasks])
        self._loops.clear()
        await self._sweeper.stop()
        if self._alerts is not None:
            await self._alerts.stop()
        if self._audit is not None:
            await self._audit.stop(timeout=2.0)
        await self._auth.security.close()
        if self._view.attached and not self._conn.is_closed:
            with contextlib.suppress(ReachError):
                await self.store.delete_registrar(self.registrar_id)

    async def __aenter__(self) -> Registrar:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- the fabric's JetStream store ---------------------------------------------------

    def store_changed(self, problem: str) -> None:
        """The fabric's JetStream store takes no writes now (``problem``: what its servers
        report, a full disk above all), or takes them again (""). Said in the answer to a
        registrar ping (where clients whose writes go unanswered, and ``reach doctor``,
        read it), raised as the alert ``store_full``, and known to this registrar's own
        writes, whose errors name it."""
        problem = problem[:_PROBLEM_MAX]
        for conn in (self._conn, self._intake):
            conn.denials.store.known = problem
        began, ended = problem and not self.store_problem, self.store_problem and not problem
        self.store_problem = problem  # its words change as more streams meet the full disk
        if began:
            log.error(
                "the JetStream store takes no writes: %s; registry, audit and alert writes"
                " fail until space is freed",
                problem,
            )
        elif ended:
            log.warning("the JetStream store takes writes again")
        if (began or ended) and self._alerts is not None:
            self._alerts.store_changed(problem)

    # -- this registrar's own record ---------------------------------------------------

    def _own_record(self, store_problem: str = "") -> RegistrarRecord:
        return RegistrarRecord(
            registrar_id=self.registrar_id,
            started_at=self._policy.started_at,
            seen_at=self._clock.time(),
            interval_sec=self.config.liveness_interval_sec,
            store_problem=store_problem,
        )

    async def _on_ping(self, msg: Message) -> None:
        record = self._own_record(self.store_problem).encode()
        await self._conn.respond(msg, envelope.pack_ok(record, self.registrar_id))

    async def _refresh_liveness(self) -> None:
        record = self._own_record()
        await self.store.put_registrar(record)
        self._ownership.expire(record.seen_at)

    async def _liveness_loop(self) -> None:
        while not self._stopping:
            await asyncio.sleep(self.config.liveness_interval_sec)
            try:
                await self._refresh_liveness()
            except ReachError as exc:
                log.warning("could not refresh registrar liveness: %s", exc)

    # -- the sweep ---------------------------------------------------------------------

    async def _sweep(self) -> float:
        """One pass over owned records: evict the silent, mark missed heartbeats, start probes."""
        return await self._sweeper.sweep()

    async def _sweep_loop(self) -> None:
        while not self._stopping:
            tick = MAX_TICK_SEC
            # a registrar that stopped refreshing its record hands its partitions over
            # as soon as it is no longer live, not at this one's next refresh
            self._ownership.expire(self._clock.time())
            try:
                tick = await self._sweep()
            except ReachError as exc:
                self._policy.trouble()
                log.warning("sweep failed: %s", exc)
            loop = asyncio.get_running_loop()
            woken_at = loop.time() + tick
            await asyncio.sleep(tick)
            late = loop.time() - woken_at
            if late > STALL_SEC:
                # this process did not run (stopped, starved): the heartbeats of that
                # time wait unread in its socket, so silence counts from now
                self._policy.trouble()
                log.warning("registrar stalled for %.1fs: no verdict on silence before it", late)
