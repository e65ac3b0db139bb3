"""A level-1 caller tries to write audit events and alert notices in another's name.

The writer's identity is the last token of the subject, which the server lets each
client publish under its own client id only; readers believe a body only where it
agrees with that token.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from reach.audit.batch import encode_batch

from ..audit_helpers import make_event
from ..cli_helpers import run_reach
from .conftest import Refusals, UpFabric, attacker


def forged_call(caller: str, call_id: str, *, retries: int = 0) -> Any:
    """A well-formed caller-side event of ``caller``'s call, as the SDK's writer makes it."""
    tried = [{"agent_id": "victim-001", "outcome": "timeout", "latency_ms": 1.0}] * retries
    return make_event(
        ts=time.time(),
        capability="secret_cap",
        call_id=call_id,
        caller=caller,
        callee="victim-001",
        outcome="ok",
        latency_ms=1.0,
        candidates=["victim-001"],
        n_candidates=1,
        attempts=[*tried, {"agent_id": "victim-001", "outcome": "ok", "latency_ms": 1.0}],
    )


async def tail_json(fabric: UpFabric) -> list[dict[str, Any]]:
    code, out, err = await run_reach(
        "audit", "tail", "--json", "--servers", fabric.url, "--creds", str(fabric.admin)
    )
    assert code == 0, err
    return [json.loads(line) for line in out.splitlines() if line.strip()]


async def alerts_json(fabric: UpFabric) -> list[dict[str, Any]]:
    code, out, err = await run_reach(
        "alerts", "--json", "--servers", fabric.url, "--creds", str(fabric.admin)
    )
    assert code == 0, err
    return [json.loads(line) for line in out.splitlines() if line.strip()]


async def test_a_caller_cannot_write_events_as_another_caller(
    up_fabric: UpFabric, refusals: Refusals
) -> None:
    victim, _ = await up_fabric.add_client(level=1)
    mallory, creds = await up_fabric.add_client(level=1)
    nc = await attacker(up_fabric, creds, error_cb=refusals.on_error)
    try:
        data = encode_batch([forged_call(victim, "FORGED-1")])
        # under the victim's name: the server refuses the subject
        theirs = f"reach.v1.audit.secret_cap.{victim}"
        await nc.publish(theirs, data)
        await nc.flush()
        await refusals.wait_for(theirs)
        # under its own name the batch is stored, but readers see who wrote it
        ack = await nc.jetstream().publish(
            f"reach.v1.audit.secret_cap.{mallory}", data, stream="REACH_AUDIT"
        )
        assert ack.seq >= 1
    finally:
        await nc.close()
    (forged,) = [e for e in await tail_json(up_fabric) if e["call_id"] == "FORGED-1"]
    assert forged["caller"] == victim  # what the body claims, shown as a claim only
    assert forged["writer"] == mallory
    assert forged["verified"] is False
    code, out, err = await run_reach(
        "audit", "tail", "--servers", up_fabric.url, "--creds", str(up_fabric.admin)
    )
    assert code == 0, err
    (line,) = [line for line in out.splitlines() if "FORGED-1" in line]
    assert "FORGED?" in line
    assert f"writer={mallory}" in line


async def test_forged_notices_raise_no_retry_storm_for_another_caller(
    up_fabric: UpFabric, refusals: Refusals
) -> None:
    victim, _ = await up_fabric.add_client(level=1)
    mallory, creds = await up_fabric.add_client(level=1)
    nc = await attacker(up_fabric, creds, error_cb=refusals.on_error)
    try:
        js = nc.jetstream()

        async def store(rows: list[Any]) -> int:
            subject = f"reach.v1.audit.secret_cap.{mallory}"
            ack = await js.publish(subject, encode_batch(rows), stream="REACH_AUDIT")
            return int(ack.seq)

        def notice(seq: int, calls: int) -> bytes:
            body = {"seq": seq, "calls": {"secret_cap": calls}, "notable": calls}
            return json.dumps(body).encode()

        # the victim's storm, stored under mallory's own name and announced by mallory
        storm = [forged_call(victim, f"STORM-{n}", retries=12) for n in range(3)]
        seq = await store(storm)
        await nc.publish(f"reach.v1.audited.secret_cap.{mallory}", notice(seq, 3))
        # the same notice under the victim's name: refused by the server
        theirs = f"reach.v1.audited.secret_cap.{victim}"
        await nc.publish(theirs, notice(seq, 3))
        await nc.flush()
        await refusals.wait_for(theirs)
        # mallory's own storm, genuinely its own: the alert rules see it, after the rest
        own = await store([forged_call(mallory, f"OWN-{n}", retries=12) for n in range(3)])
        await nc.publish(f"reach.v1.audited.secret_cap.{mallory}", notice(own, 3))
        await nc.flush()
    finally:
        await nc.close()
    storms = await storms_once_raised_for(up_fabric, mallory)
    assert not [a for a in storms if victim in a["key"]], storms


async def test_a_notice_cannot_point_at_another_writers_batch(
    up_fabric: UpFabric, refusals: Refusals
) -> None:
    """A notice names a stream sequence: one written by someone else is not read as the
    notice's writer's, nor counted twice as its real writer's."""
    victim, victim_creds = await up_fabric.add_client(level=1)
    mallory, creds = await up_fabric.add_client(level=1)
    honest = await attacker(up_fabric, victim_creds)
    try:
        # the victim's one genuine retried call (no storm on its own)
        ack = await honest.jetstream().publish(
            f"reach.v1.audit.secret_cap.{victim}",
            encode_batch([forged_call(victim, "REAL-1", retries=4)]),
            stream="REACH_AUDIT",
        )
    finally:
        await honest.close()
    nc = await attacker(up_fabric, creds, error_cb=refusals.on_error)
    try:
        body = {"seq": int(ack.seq), "calls": {"secret_cap": 1}, "notable": 1}
        for _ in range(5):  # replayed: 5 x 4 retries would be a storm
            await nc.publish(f"reach.v1.audited.secret_cap.{mallory}", json.dumps(body).encode())
        own = await nc.jetstream().publish(
            f"reach.v1.audit.secret_cap.{mallory}",
            encode_batch([forged_call(mallory, f"SYNC-{n}", retries=12) for n in range(2)]),
            stream="REACH_AUDIT",
        )
        body = {"seq": int(own.seq), "calls": {"secret_cap": 2}, "notable": 2}
        await nc.publish(f"reach.v1.audited.secret_cap.{mallory}", json.dumps(body).encode())
        await nc.flush()
    finally:
        await nc.close()
    storms = await storms_once_raised_for(up_fabric, mallory)
    assert not [a for a in storms if victim in a["key"]], storms


async def storms_once_raised_for(fabric: UpFabric, caller: str) -> list[dict[str, Any]]:
    """The retry_storm alerts, read once the one for ``caller``'s own storm is there: every
    notice sent before it has been read by then."""
    storms: list[dict[str, Any]] = []
    async with asyncio.timeout(30):
        while not any(a["details"].get("caller") == caller for a in storms):
            storms = [a for a in await alerts_json(fabric) if a["rule"] == "retry_storm"]
    return storms
