"""Audit events and alerts: what the fabric did, and what an operator should look at.

The names below are imported on first use: an agent or a client, which import the
audit writer, do not load the reader, the alert rules and their watcher with it.
"""

import typing as _typing

from reach import lazy as _lazy

if _typing.TYPE_CHECKING:
    from reach.audit.alert_watcher import AlertWatcher
    from reach.audit.alerts import Alert, AlertEngine, AlertRules
    from reach.audit.config import WriterConfig
    from reach.audit.events import error_class
    from reach.audit.reader import AuditFilter, format_event, read_events
    from reach.audit.records import AuditAttempt, AuditEvent
    from reach.audit.streams import StreamSettings, ensure_streams
    from reach.audit.writer import AuditWriter

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

#: each public name and the module it is imported from
_EXPORTS: dict[str, str] = {
    "Alert": "reach.audit.alerts",
    "AlertEngine": "reach.audit.alerts",
    "AlertRules": "reach.audit.alerts",
    "AlertWatcher": "reach.audit.alert_watcher",
    "AuditAttempt": "reach.audit.records",
    "AuditEvent": "reach.audit.records",
    "AuditFilter": "reach.audit.reader",
    "AuditWriter": "reach.audit.writer",
    "StreamSettings": "reach.audit.streams",
    "WriterConfig": "reach.audit.config",
    "ensure_streams": "reach.audit.streams",
    "error_class": "reach.audit.events",
    "format_event": "reach.audit.reader",
    "read_events": "reach.audit.reader",
}

if not _typing.TYPE_CHECKING:  # type checkers read the imports above instead
    __getattr__, __dir__ = _lazy.exports(__name__, _EXPORTS, globals(), __all__)
