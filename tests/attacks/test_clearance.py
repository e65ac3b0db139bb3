"""An agent serves no capability above its credential's clearance.

The attacker holds a level-1 agent credential that lists ``vault_export`` and speaks the
wire protocol with nats-py and msgpack: it announces that capability at
``security_level: 4``, listening on its instance's subject for the calls of level-4
callers it would then be routed. The registrar refuses the announce (audited), nothing of
it reaches the registry, and a level-4 caller's call finds no instance to hand its
payload to. A record that serves above its token's clearance all the same (written
before announces were checked for it) is removed at its next heartbeat.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Any

import msgpack
import pytest

from reach.audit.reader import read_events
from reach.caller.client import ReachClient
from reach.errors import NotFound
from reach.registry.store import RegistryStore
from reach.security.membership import connect_as
from reach.wire import subjects
from reach.wire.models import Instance, Manifest, Readiness, Transition

from .conftest import UpFabric, ask, attacker, fabric_token, request_bytes

CAPABILITY = "vault_export"


def announce(agent_id: str, level: int, capability: str = CAPABILITY) -> dict[str, Any]:
    return {
        "instance_id": secrets.token_hex(8),
        "started_at": time.time(),
        "manifest": {
            "agent_id": agent_id,
            "agent_name": "rogue",
            "version": "1.0.0",
            "capabilities": [{"name": capability, "security_level": level}],
            "health": {"interval_sec": 1.0, "timeout_sec": 0.5, "failures_before_unhealthy": 2},
        },
    }


async def registry_keys(fabric: UpFabric) -> set[str]:
    admin = await attacker(fabric, fabric.admin)
    try:
        kv = await admin.jetstream().key_value(subjects.REGISTRY_BUCKET)
        try:
            return set(await kv.keys())
        except Exception:  # no keys yet
            return set()
    finally:
        await admin.close()


async def registrar_denials(fabric: UpFabric, agent_id: str, code: str) -> list[Any]:
    """The registrar's audited denials of ``agent_id`` with ``code``, polled until one is
    there (the registrar writes its audit events in batches, off the refusal's path)."""
    conn, _ = await connect_as([fabric.url], name="auditor", credentials=fabric.admin)
    try:
        async with asyncio.timeout(15):
            while True:
                found = [
                    event
                    async for event in read_events(conn)
                    if event.side == "registrar" and event.callee == agent_id and event.code == code
                ]
                if found:
                    return found
                await asyncio.sleep(0.1)
    finally:
        await conn.close()


async def test_a_level_1_agent_cannot_announce_a_level_4_capability(up_fabric: UpFabric) -> None:
    client_id, creds = await up_fabric.add_client(level=1, agent_id="rogue-l1", caps=(CAPABILITY,))
    nc = await attacker(up_fabric, creds)
    payloads: list[bytes] = []

    async def keep(msg: Any) -> None:
        payloads.append(msg.data)

    try:
        # where a registered instance is called: its own subject, as its credential allows
        await nc.subscribe(subjects.capability_instance(CAPABILITY, "rogue-l1"), cb=keep)
        token = await fabric_token(nc, *up_fabric.secret_of(creds))
        reply = await ask(
            nc, subjects.announce("rogue-l1"), request_bytes(announce("rogue-l1", 4), token)
        )
        assert reply.get("ok") is not True, reply
        err = reply["err"]
        assert (err["kind"], err["code"]) == ("denied", f"above_clearance:{CAPABILITY}:4:1"), err
        assert (
            f"holds clearance 1 and may not serve {CAPABILITY} at security_level 4" in (err["desc"])
        )

        keys = await registry_keys(up_fabric)
        assert subjects.agent_key("rogue-l1") not in keys
        assert not [key for key in keys if key.endswith(".rogue-l1")]

        (denial,) = await registrar_denials(
            up_fabric, "rogue-l1", f"above_clearance:{CAPABILITY}:4:1"
        )
        assert denial.caller == client_id
        assert denial.outcome == "denied"

        # a level-4 caller's payload: no instance of the capability, so it reaches no one
        _, cleared = await up_fabric.add_client(level=4)
        async with ReachClient(servers=up_fabric.url, credentials=cleared) as caller:
            assert await caller.discover(capability=CAPABILITY) == []
            with pytest.raises(NotFound):
                await caller.call(CAPABILITY, {"customers": "all"}, timeout=2.0)
        await nc.flush()
        assert payloads == []
    finally:
        await nc.close()


async def test_an_agent_may_announce_at_or_below_its_clearance(up_fabric: UpFabric) -> None:
    _, creds = await up_fabric.add_client(level=2, agent_id="honest-l2", caps=("ledger",))
    nc = await attacker(up_fabric, creds)
    try:
        token = await fabric_token(nc, *up_fabric.secret_of(creds))
        body = request_bytes(announce("honest-l2", 2, "ledger"), token)
        reply = await ask(nc, subjects.announce("honest-l2"), body)
        assert reply.get("ok"), reply
        assert msgpack.unpackb(reply["b"])["accepted"] is True
        assert subjects.agent_key("honest-l2") in await registry_keys(up_fabric)
    finally:
        await nc.close()


async def test_a_record_above_its_heartbeats_clearance_is_removed(up_fabric: UpFabric) -> None:
    """A record serving ``vault_dump`` at level 4 for a level-1 credential, as one
    written before announces were checked for the level: the first heartbeat it is read
    with removes it, answered ``denied``."""
    client_id, creds = await up_fabric.add_client(
        level=1, agent_id="rogue-old", caps=("vault_dump",)
    )
    data = announce("rogue-old", 4, "vault_dump")
    manifest = Manifest.model_validate(data["manifest"])
    now = time.time()
    record = Instance(
        manifest=manifest,
        instance_id=data["instance_id"],
        status="healthy",
        status_reason="announced",
        registered_at=now,
        last_heartbeat_at=now,
        max_concurrency=manifest.max_concurrency,
        readiness=Readiness(),
        registrar_id="earlier",
        transitions=[Transition(at=now, status="healthy", reason="announced")],
    )
    admin, _ = await connect_as([up_fabric.url], name="planter", credentials=up_fabric.admin)
    try:
        await (await RegistryStore.open(admin, create=False)).create(record)
    finally:
        await admin.close()
    assert subjects.agent_key("rogue-old") in await registry_keys(up_fabric)

    nc = await attacker(up_fabric, creds)
    try:
        token = await fabric_token(nc, *up_fabric.secret_of(creds))
        code = ""
        seq = 0
        async with asyncio.timeout(10):
            # the first heartbeat may come before the registrar's view holds the record
            while code != "above_clearance:vault_dump:4:1":
                seq += 1
                hb = {
                    "agent_id": "rogue-old",
                    "instance_id": data["instance_id"],
                    "seq": seq,
                    "sent_at": time.time(),
                    "in_flight": 0,
                    "max_concurrency": manifest.max_concurrency,
                }
                reply = await ask(nc, subjects.heartbeat("rogue-old"), request_bytes(hb, token))
                code = "ok" if reply.get("ok") else reply["err"]["code"]
                if code != "above_clearance:vault_dump:4:1":
                    await asyncio.sleep(0.2)
    finally:
        await nc.close()
    assert subjects.agent_key("rogue-old") not in await registry_keys(up_fabric)
    (denial,) = await registrar_denials(up_fabric, "rogue-old", "above_clearance:vault_dump:4:1")
    assert denial.caller == client_id
