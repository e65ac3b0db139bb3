"""The registrar's watch of REACH_REGISTRY: every record, then every change, into its view.

Instance records feed the record view (and the alert watcher, so no record is decoded
twice); registrar records feed ownership. A watch that fails is started again, and
counts as trouble: changes may have been missed meanwhile, heartbeats among them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from reach.audit.alert_watcher import AlertWatcher
from reach.registry.instances import RecordView
from reach.registry.ownership import Ownership
from reach.registry.store import RecordChange
from reach.runtime import settle_after_load
from reach.wire import subjects

__all__ = ["RegistryWatch"]

log = logging.getLogger("reach.registrar")

#: pause before a failed watch is started again
RESTART_AFTER_SEC = 0.5


class RegistryWatch:
    """Keeps a registrar's view and ownership true to the bucket."""

    def __init__(
        self,
        view: RecordView,
        ownership: Ownership,
        *,
        alerts: AlertWatcher | None,
        on_trouble: Callable[[], None],
        running: Callable[[], bool],
    ) -> None:
        self._view = view
        self._ownership = ownership
        self._alerts = alerts
        self._on_trouble = on_trouble
        self._running = running
        #: set once the first watch has delivered every record there was
        self.synced = asyncio.Event()

    def apply(self, change: RecordChange | None) -> None:
        """Take one change of the watch (None: caught up with the bucket)."""
        if change is None:
            if not self.synced.is_set():  # the first load: its due collection now
                settle_after_load(len(self._view.by_agent))
            self.synced.set()
        elif change.key.startswith(subjects.REGISTRAR_KEY_PREFIX):
            rid = change.key[len(subjects.REGISTRAR_KEY_PREFIX) :]
            if change.registrar is not None:
                self._ownership.seen(rid, change.registrar)
            else:
                self._ownership.gone(rid)
        elif change.instance is not None:
            self._view.remember(change.instance, change.revision)
            if self._alerts is not None:
                self._alerts.registry_changed(change.agent_id, change.instance)
        elif change.deleted:
            self._view.forget(change.agent_id, change.revision)
            if self._alerts is not None:
                self._alerts.registry_changed(change.agent_id, None)

    async def run(self) -> None:
        """Follow the bucket until cancelled, starting a failed watch again."""
        while self._running():
            try:
                async for change in self._view.store.watch():
                    self.apply(change)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._on_trouble()
                log.warning("registry watch failed (%s); restarting", exc)
                await asyncio.sleep(RESTART_AFTER_SEC)
