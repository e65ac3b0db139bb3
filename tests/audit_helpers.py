"""Shared by the audit tests: audit events with sensible defaults, and waiting for a
condition (the alert watcher to fire, a line to be logged)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from reach.audit.alert_watcher import AlertWatcher
from reach.audit.events import CallEvent, attempt


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


async def until(condition: Callable[[], object], timeout: float = 10.0) -> None:
    """Wait until ``condition()`` holds, for what has no event to wait on (TimeoutError
    after ``timeout``)."""
    async with asyncio.timeout(timeout):
        while not condition():  # noqa: ASYNC110 - polled, bounded by the timeout
            await asyncio.sleep(0.02)


async def until_fired(watcher: AlertWatcher, timeout: float = 10.0) -> None:
    """Wait until the watcher has fired an alert."""
    await until(lambda: watcher.fired, timeout)
