"""Audit events and alerts: what the fabric did, and what an operator should look at.

The names below are imported on first use: an agent or a client, which import the
audit writer, do not load the reader, the alert rules and their watcher with it.
"""

import typing as _typing

from reach import lazy as _lazy

if _typing.TYPE_CHECKING:
    from reach.audit.alert_watcher import AlertWatcher as AlertWatcher
    from reach.audit.alerts import Alert as Alert
    from reach.audit.alerts import AlertEngine as AlertEngine
    from reach.audit.alerts import AlertRules as AlertRules
    from reach.audit.eventmodels import AuditAttempt as AuditAttempt
    from reach.audit.eventmodels import AuditEvent as AuditEvent
    from reach.audit.events import error_class as error_class
    from reach.audit.reader import AuditFilter as AuditFilter
    from reach.audit.reader import format_event as format_event
    from reach.audit.reader import read_events as read_events
    from reach.audit.streams import StreamSettings as StreamSettings
    from reach.audit.streams import ensure_streams as ensure_streams
    from reach.audit.writer import AuditWriter as AuditWriter
    from reach.audit.writerconfig import WriterConfig as WriterConfig

#: each public name and the module it is imported from
_EXPORTS: dict[str, str] = {
    "Alert": "reach.audit.alerts",
    "AlertEngine": "reach.audit.alerts",
    "AlertRules": "reach.audit.alerts",
    "AlertWatcher": "reach.audit.alert_watcher",
    "AuditAttempt": "reach.audit.eventmodels",
    "AuditEvent": "reach.audit.eventmodels",
    "AuditFilter": "reach.audit.reader",
    "AuditWriter": "reach.audit.writer",
    "StreamSettings": "reach.audit.streams",
    "WriterConfig": "reach.audit.writerconfig",
    "ensure_streams": "reach.audit.streams",
    "error_class": "reach.audit.events",
    "format_event": "reach.audit.reader",
    "read_events": "reach.audit.reader",
}
__all__ = list(_EXPORTS)

if not _typing.TYPE_CHECKING:  # type checkers read the imports above instead
    __getattr__, __dir__ = _lazy.exports(__name__, _EXPORTS, globals(), __all__)
