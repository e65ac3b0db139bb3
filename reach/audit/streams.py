"""The two record streams: REACH_AUDIT (calls, denials) and REACH_ALERTS (alerts)."""

from __future__ import annotations

from dataclasses import dataclass

from reach.transport import Connection, Stream
from reach.wire import subjects

__all__ = ["StreamSettings", "ensure_streams"]

_DAY = 24 * 3600.0


@dataclass(frozen=True, slots=True)
class StreamSettings:
    """Retention and replication of the record streams (made by ``reach up``/a registrar)."""

    #: how long audit events are kept
    audit_max_age: float = 7 * _DAY
    #: how long alerts are kept
    alerts_max_age: float = 30 * _DAY
    #: size cap of the audit stream (oldest dropped first); -1 = none. Made on a store
    #: without room for it (and as much again free), the stream gets the largest half,
    #: quarter, … of it that fits, down to ``audit_min_bytes``; below that the registrar
    #: does not start (StoreFull names the space needed). A stream keeps the cap it was
    #: made with.
    audit_max_bytes: int = 1 << 30
    audit_min_bytes: int = 64 << 20
    #: copies in a JetStream cluster (3 for ``reach up --cluster 3``)
    replicas: int = 1
    #: a resend of the same batch within this window is stored once (writers resend
    #: unacked batches with the same message id until NATS is back)
    duplicate_window: float = 600.0


async def ensure_streams(
    conn: Connection, settings: StreamSettings | None = None
) -> tuple[Stream, Stream]:
    """Create or update REACH_AUDIT and REACH_ALERTS (file storage, delete/purge denied)."""
    s = settings or StreamSettings()
    audit = await conn.stream(
        subjects.AUDIT_STREAM,
        # every capability and writer; a store made when subjects had no writer token
        # (``reach.v1.audit.*``) is widened to this on start, its old batches kept
        [subjects.AUDIT_ALL],
        create=True,
        max_age=s.audit_max_age,
        max_bytes=s.audit_max_bytes,
        min_bytes=s.audit_min_bytes,
        replicas=s.replicas,
        duplicate_window=s.duplicate_window,
    )
    alerts = await conn.stream(
        subjects.ALERTS_STREAM,
        [subjects.alert("*")],
        create=True,
        max_age=s.alerts_max_age,
        replicas=s.replicas,
        duplicate_window=s.duplicate_window,
    )
    return audit, alerts
