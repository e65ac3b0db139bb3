"""Audit events and alerts: what the fabric did, and what an operator should look at."""

from reach.audit.alert_watcher import AlertWatcher
from reach.audit.alerts import Alert, AlertEngine, AlertRules
from reach.audit.events import error_class
from reach.audit.reader import AuditFilter, format_event, read_events
from reach.audit.records import AuditAttempt, AuditEvent
from reach.audit.streams import StreamSettings, ensure_streams
from reach.audit.writer import AuditWriter, WriterConfig

__all__ = [
    "Alert",
    "AlertEngine",
    "AlertRules",
    "AlertWatcher",
    "AuditAttempt",
    "AuditEvent",
    "AuditFilter",
    "AuditWriter",
    "StreamSettings",
    "WriterConfig",
    "ensure_streams",
    "error_class",
    "format_event",
    "read_events",
]
