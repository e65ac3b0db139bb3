"""Shared by the audit tests: audit events with sensible defaults, writing them to
REACH_AUDIT, waiting for a client's events to be written, and for the alert watcher to
fire."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from reach.audit import AuditWriter, WriterConfig
from reach.audit.alert_watcher import AlertWatcher
from reach.audit.events import CallEvent, attempt
from reach.caller.client import ReachClient
from reach.transport import Connection

from .poll_helpers import until


def make_event(**fields: Any) -> CallEvent:
    """A ``CallEvent`` from test-friendly fields: attempts may be maps of
    ``reach.audit.events.attempt``'s fields, candidates and skipped names lists."""
    attempts = fields.get("attempts", ())
    fields["attempts"] = tuple(a if isinstance(a, tuple) else attempt(**a) for a in attempts)
    for name in ("candidates", "skipped"):
        if name in fields:
            fields[name] = tuple(fields[name])
    return CallEvent(**fields)


def event(n: int, capability: str = "echo", **fields: Any) -> CallEvent:
    """Call ``c-<n>`` of ``capability`` from "tester" to echo-1, answered at once."""
    values: dict[str, Any] = {
        "ts": time.time(),
        "capability": capability,
        "call_id": f"c-{n}",
        "caller": "tester",
        "callee": "echo-1",
        "outcome": "ok",
        "latency_ms": 1.0,
        "candidates": ["echo-1"],
        "n_candidates": 1,
        "attempts": [{"agent_id": "echo-1", "score": 0.9, "outcome": "ok", "latency_ms": 1.0}],
    }
    return make_event(**{**values, **fields})


async def until_fired(watcher: AlertWatcher, timeout: float = 10.0) -> None:
    """Wait until the watcher has fired an alert."""
    await until(lambda: watcher.fired, "the watcher fired an alert", timeout=timeout)


#: how many names the alert rules keep counts for (reach.audit.alerts.MAX_TRACKED)
MAX_TRACKED = 10_000


async def write(conn: Connection, *rows: CallEvent) -> None:
    """Rows into REACH_AUDIT through a real writer (flushed before it returns)."""
    writer = AuditWriter(conn, WriterConfig(flush_interval=0.01))
    await writer.start()
    for row in rows:
        writer.record(row)
    await writer.stop()


async def flushed(client: ReachClient) -> None:
    """Wait until the client's audit writer has written every event it holds."""
    assert client.audit is not None
    await asyncio.wait_for(client.audit.flush(), 10)
