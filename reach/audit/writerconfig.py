"""The audit writer's settings (``reach.audit.writer.AuditWriter``)."""

from __future__ import annotations

from dataclasses import dataclass
from os import PathLike

__all__ = ["WriterConfig"]


@dataclass(frozen=True, slots=True)
class WriterConfig:
    #: events held in memory while the stream cannot be written (then the oldest go to
    #: the spool; with none, or a full one, new events are dropped and counted)
    max_buffer: int = 100_000
    #: events per stream message at most: every message costs the writer, the server and
    #: each reader (the registrar's alert watcher, `reach audit tail`) a fixed price, so
    #: fewer, larger messages are cheaper for all of them, the registrar's alert rules
    #: above all (the benchmark's audit figures show what it costs at full load)
    batch_max: int = 8192
    #: bytes per stream message at most (and never over half the server's max_payload:
    #: with nats-server's default of 1 MiB, this is what ends a batch at full load)
    batch_max_bytes: int = 512 * 1024
    #: how long an event may wait for company before its batch is written: every reader
    #: pays per message, and a caller spreading its calls over many capabilities writes a
    #: message per capability per interval, so half a second rather than less; events
    #: then reach `reach audit tail -f` and the console within about a second
    flush_interval: float = 0.5
    #: wait for a stream ack
    ack_timeout: float = 2.0
    #: back-off between failed writes: doubles from ``retry_min`` up to ``retry_max``
    retry_min: float = 0.05
    retry_max: float = 1.0
    #: where events go past ``max_buffer`` and at shutdown until the stream acks them: a
    #: directory, or "off" (None: ``REACH_AUDIT_SPOOL``, else a directory per user, see
    #: ``reach.settings.resolve_audit_spool``)
    spool: str | PathLike[str] | None = None
    #: bytes this writer's spool file may hold (None: ``REACH_AUDIT_SPOOL_MAX_MB``, else
    #: 256 MiB); past it events are dropped, counted and alerted
    spool_max_bytes: int | None = None
