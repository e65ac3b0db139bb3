"""How far behind the registrar reads what agents send: a round trip on its intake
connection, and trouble while it is slow.

Announces, heartbeats, byes and pings come on the registrar's intake connection; a
flood there (one agent credential sending as fast as it can) queues at the server in
front of honest heartbeats, so an instance could look silent while its heartbeat waits
to be read. A PING sent on the connection comes back only after everything queued before
it has been read, so its round trip is how far behind the reading is. While a round trip
takes more than ``LAG_LIMIT_SEC`` the registrar is in trouble
(:meth:`HealthPolicy.trouble`): nobody is marked unhealthy or evicted for a silence that
may only be unread heartbeats, until the intake has caught up.

With an intake connection of its own (``reach up`` gives the registrar one), such a flood
delays only what comes on it: the answers to probes, the acks of registry writes and the
registry watch come on the registrar's main connection, behind nothing an agent sent.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from reach.clock import Clock
from reach.errors import ReachError
from reach.transport import Connection

__all__ = ["CHECK_EVERY_SEC", "LAG_LIMIT_SEC", "IntakeLag"]

log = logging.getLogger("reach.registrar")

#: how often the intake's round trip is measured
CHECK_EVERY_SEC = 0.1
#: a round trip longer than this: the registrar is behind what agents send
LAG_LIMIT_SEC = 0.2
#: seconds between two warnings that the intake is behind
_WARN_EVERY_SEC = 10.0
#: how long a round trip may take before the connection is taken for lost: the lag is
#: what is measured, so its PING is waited for far longer than a flush's usual seconds
_TRIP_TIMEOUT_SEC = 120


class IntakeLag:
    """Measures the intake connection's round trip; ``behind()`` while it is too long."""

    def __init__(self, conn: Connection, clock: Clock, behind: Callable[[], None]) -> None:
        self._conn = conn
        self._clock = clock
        self._behind = behind
        #: the longest round trip measured since the registrar started (seconds)
        self.worst = 0.0
        self._warned_at = -_WARN_EVERY_SEC

    async def run(self) -> None:
        """Measure until cancelled."""
        while True:
            await asyncio.sleep(CHECK_EVERY_SEC)
            await self.measure()

    async def measure(self) -> float:
        """One round trip on the intake (seconds); trouble for as long as it is slow."""
        started = self._clock.monotonic()
        trip = asyncio.ensure_future(self._conn.flush(timeout=_TRIP_TIMEOUT_SEC))
        try:
            while True:
                done, _ = await asyncio.wait({trip}, timeout=LAG_LIMIT_SEC)
                if done:
                    break
                self._behind()
                self._warn(self._clock.monotonic() - started)
            trip.result()
        except ReachError:  # disconnected: the reconnect counts as trouble of its own
            pass
        finally:
            trip.cancel()
        took = self._clock.monotonic() - started
        self.worst = max(self.worst, took)
        return took

    def _warn(self, behind: float) -> None:
        now = self._clock.monotonic()
        if now - self._warned_at >= _WARN_EVERY_SEC:
            self._warned_at = now
            log.warning(
                "registrar reads what agents send %.1fs late: no eviction until caught up",
                behind,
            )
