"""A fabric `reach up` started (tokens on) for the conformance kit, the capability both
kinds of agent serve, and reading REACH_AUDIT as an operator would.

The caller and the agent under test (raw_caller.py, raw_agent.py, wire.py and the Node
examples) import nothing of ``reach``; this driver may, to start the fabric, make
credentials and read the audit stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from reach.audit.eventmodels import decode_batch

from ..attacks.conftest import UpFabric, attacker, start_up, stop_up


def adder(name: str, level: int = 1) -> dict[str, Any]:
    """A capability that adds two numbers, with input and output schemas."""
    number = {"type": "number"}
    return {
        "name": name,
        "description": "a + b",
        "tags": ["math"],
        "latency_sla_ms": 500,
        "idempotent": True,
        "security_level": level,
        "input_schema": {
            "type": "object",
            "properties": {"a": number, "b": number},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
        "output_schema": {
            "type": "object",
            "properties": {"sum": number},
            "required": ["sum"],
        },
    }


async def add(payload: Any) -> Any:
    return {"sum": payload["a"] + payload["b"]}


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpFabric]:
    """One `reach up` for the module."""
    fabric = start_up(tmp_path_factory.mktemp("up"))
    try:
        yield fabric
    finally:
        stop_up(fabric)


async def audit_events(fabric: UpFabric) -> list[dict[str, Any]]:
    """Every event in REACH_AUDIT, read by the admin message by message."""
    admin = await attacker(fabric, fabric.admin)
    try:
        js = admin.jetstream()
        info = await js.stream_info("REACH_AUDIT")
        events: list[dict[str, Any]] = []
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            try:
                msg = await js.get_msg("REACH_AUDIT", seq)
            except Exception:  # a gap
                continue
            decoded, _ = decode_batch(msg.data or b"")
            events += [event.model_dump() for event in decoded]
        return events
    finally:
        await admin.close()


async def audited(
    fabric: UpFabric, call_ids: set[str], timeout: float = 10.0
) -> list[dict[str, Any]]:
    """The audit events of ``call_ids`` once each of them has one (AssertionError after
    ``timeout``: audit batches are written a moment after the calls)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        events = [e for e in await audit_events(fabric) if e["call_id"] in call_ids]
        if {e["call_id"] for e in events} == call_ids:
            return events
        if loop.time() > deadline:
            seen = {e["call_id"] for e in events}
            raise AssertionError(f"calls not audited within {timeout}s: {call_ids - seen}")
        await asyncio.sleep(0.2)
