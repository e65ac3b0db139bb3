"""What an audit writer tells the alert rules: where each batch it wrote is stored, and
how many events it dropped.

The notices go on ``reach.v1.audited.<capability>.<writer>`` (``AuditNotice`` in
``reach.audit.eventmodels``), which a registrar's alert watcher reads
(``reach.audit.alert_watcher``) instead of a consumer on the stream.
"""

from __future__ import annotations

import logging
import time

from reach.audit.batch import RowSummary, encode_notice
from reach.audit.spool import Batch
from reach.errors import ReachError
from reach.transport import Connection
from reach.wire import subjects

__all__ = ["Notices"]

log = logging.getLogger("reach.audit")


class Notices:
    """One writer's notices to the alert rules, and the drops not reported yet."""

    __slots__ = ("_conn", "_last_capability", "_last_seq", "_report_at", "_timeout", "unreported")

    def __init__(self, conn: Connection, timeout: float) -> None:
        self._conn = conn
        self._timeout = timeout
        #: dropped events the alert rules have not been told of, and when to tell them
        #: (after a notice of the last batch acked: its sequence and capability)
        self.unreported = 0
        self._report_at = 0.0
        self._last_seq = 0
        self._last_capability = ""

    async def stored(self, batch: Batch, seq: int) -> None:
        """Tell the alert rules where the stream holds ``batch`` (core NATS, best effort:
        the events are stored either way; a notice lost with the connection only leaves
        its calls out of the last minute's counts). After a resend whose first ack was
        lost the notice goes out once, with the first copy's sequence."""
        self._last_seq, self._last_capability = seq, batch.capability
        try:
            await self._conn.publish(
                subjects.audited(batch.capability, self._conn.writer),
                encode_notice(seq, batch.summary),
            )
        except ReachError as exc:
            log.debug("audit: no notice of batch %d of %s: %s", seq, batch.capability, exc)

    def drops_due(self) -> bool:
        """Drops wait to be reported, a batch was acked since, and it is time to ask."""
        return bool(self.unreported and self._last_seq and time.monotonic() >= self._report_at)

    async def report_drops(self) -> None:
        """Tell the alert rules how many events were dropped, once the stream acks again
        and nothing waits: a notice of the last batch with its ``dropped`` count, as a
        request that a registrar's alert watcher answers once it has raised the alert.
        Unanswered (no registrar), it is asked again a second later."""
        dropped = self.unreported
        notice = encode_notice(self._last_seq, RowSummary(), dropped)
        subject = subjects.audited(self._last_capability, self._conn.writer)
        try:
            await self._conn.request(subject, notice, timeout=self._timeout)
        except ReachError as exc:
            self._report_at = time.monotonic() + 1.0
            log.debug("audit: %d dropped event(s) not reported yet: %s", dropped, exc)
            return
        self.unreported -= dropped
