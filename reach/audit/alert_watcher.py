"""The alert rules at work: audit notices and registry changes in, alerts to REACH_ALERTS.

:class:`AlertWatcher` feeds the pure :class:`~reach.audit.alerts.AlertEngine` from the
audit writers' notices (``reach.v1.audited.<capability>.<writer>``: a batch is stored,
its summary, and the batch itself from REACH_AUDIT when some rows need a look), from
the registry watch of whoever runs it (the registrar) and from what it learns of the
JetStream store, and publishes what it returns. An alert that a full store cannot take
is tried again until it is stored.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Coroutine
from typing import Any

from reach.audit.alerts import Alert, AlertEngine, AlertRules, encode_alert
from reach.audit.decode import BatchVersionError
from reach.audit.eventmodels import decode_notice
from reach.clock import Clock, system_clock
from reach.errors import ReachError
from reach.tasks import cancel_and_wait
from reach.transport import Connection, Message, Stream, Subscription
from reach.wire import subjects
from reach.wire.models import Instance

__all__ = ["FIRED_KEPT", "AlertWatcher"]

log = logging.getLogger("reach.alerts")

#: alerts an AlertWatcher keeps in ``fired``
FIRED_KEPT = 1000
#: an alert the store did not take is tried again this often
STORE_AGAIN_SEC = 2.0


class AlertWatcher:
    """Runs the engine on live audit events and registry changes; publishes alerts.

    Registry changes come from whoever already watches the registry (the registrar)
    through :meth:`registry_changed`, so no record is decoded twice in one process.
    """

    def __init__(
        self, conn: Connection, rules: AlertRules | None = None, clock: Clock = system_clock
    ) -> None:
        self._conn = conn
        self.engine = AlertEngine(rules, clock)
        self._sub: Subscription | None = None
        self._publishing: set[asyncio.Task[None]] = set()
        self._alerts: Stream | None = None
        self._audit: Stream | None = None
        #: the alerts this watcher raised, the latest ``FIRED_KEPT``
        self.fired: deque[Alert] = deque(maxlen=FIRED_KEPT)

    async def start(self) -> None:
        self._alerts = await self._conn.stream(subjects.ALERTS_STREAM)
        self._audit = await self._conn.stream(subjects.AUDIT_STREAM)
        # the writers' notices, not a consumer on the stream: the server delivers nothing
        # per batch but a few bytes, and only notable batches are read (a consumer, even
        # one of headers only, costs the nats-server and the registrar CPU for every batch)
        self._sub = await self._conn.subscribe(subjects.audited("*", "*"), self._on_notice)
        await self._conn.flush()  # in place at the server before start() returns

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None
        await cancel_and_wait(list(self._publishing))

    def registry_changed(self, agent_id: str, instance: Instance | None) -> None:
        """A registry record changed (None: deleted); alerts it raises are published."""
        if instance is None:
            self.engine.forget(agent_id)
            return
        alerts = self.engine.registry_change(instance)
        if alerts and self._alerts is not None:
            self._spawn(self._publish(alerts))

    def store_changed(self, problem: str) -> None:
        """The JetStream store takes no writes (``problem``, what the servers report) or
        takes them again (""): ``store_full`` is raised as it begins, and tried until
        stored (the store that cannot take it is the one it is about)."""
        alert = self.engine.store_full(problem) if problem else None
        if alert is not None and self._alerts is not None:
            self._spawn(self._publish_until_stored(alert))

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._publishing.add(task)
        task.add_done_callback(self._publishing.discard)

    async def _publish(self, alerts: list[Alert]) -> None:
        for alert in alerts:
            self._fired(alert)
            await self._store(alert)

    def _fired(self, alert: Alert) -> None:
        self.fired.append(alert)
        log.warning("alert %s: %s", alert.rule, alert.summary)

    async def _publish_until_stored(self, alert: Alert) -> None:
        self._fired(alert)
        while True:
            if await self._store(alert, quiet=True):
                return
            await asyncio.sleep(STORE_AGAIN_SEC)  # the store says nothing when it is back

    async def _store(self, alert: Alert, *, quiet: bool = False) -> bool:
        """Whether REACH_ALERTS took ``alert`` (``quiet``: a refusal is not logged)."""
        assert self._alerts is not None
        try:
            await self._alerts.publish(
                subjects.alert(alert.rule),
                encode_alert(alert),
                msg_id=alert.msg_id(self.engine.rules.repeat_after_sec),
                timeout=5.0,
            )
        except ReachError as exc:
            if not quiet:
                log.warning("could not store alert %s: %s", alert.rule, exc)
            return False
        return True

    async def _on_notice(self, msg: Message) -> None:
        """One batch stored in REACH_AUDIT (a writer's notice): its calls are counted; its
        rows are fetched from the stream only when the notice says some need a look."""
        # the writer is who the server let publish here, never what the notice says
        writer = subjects.writer_of(msg.subject)
        if not writer:
            log.warning("alerts: a notice on %s names no writer: ignored", msg.subject)
            return
        try:
            notice = decode_notice(msg.data)
        except ValueError as exc:  # not one of ours, or damaged: never the watcher's end
            log.warning("alerts: a notice on %s not understood: %s", msg.subject, exc)
            return
        if notice.dropped:
            # a writer's report of events it dropped: answered once the alert is stored
            await self._publish([self.engine.audit_dropped(writer, notice.dropped, notice.seq)])
            if msg.reply:
                await self._conn.respond(msg, b"")
        if notice.notable == 0:
            self.engine.count_calls(notice.calls)
            return
        assert self._audit is not None
        try:
            subject, data = await self._audit.get_message(notice.seq)
        except ReachError as exc:  # gone (retention) or no answer: skip this one
            log.warning("alerts: audit batch %d not read: %s", notice.seq, exc)
            return
        if subjects.writer_of(subject) != writer:
            # a notice of someone else's batch: its rows are not this writer's calls, and
            # their own writer's notice has counted them already
            log.warning(
                "alerts: a notice on %s names batch %d of %s: ignored",
                msg.subject,
                notice.seq,
                subject,
            )
            return
        try:
            alerts = self.engine.observe_batch(data, writer)
        except BatchVersionError as exc:
            log.warning("alerts: audit batch %d not read: %s", notice.seq, exc)
            return
        except Exception:  # a batch nobody of ours wrote: never the watcher's end
            log.exception("alerts: audit batch %d not understood", notice.seq)
            return
        if alerts:
            await self._publish(alerts)
