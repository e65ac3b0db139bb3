"""An agent credential serves the capabilities it lists and no others.

The attacker holds one agent credential and speaks the wire protocol with nats-py and
msgpack: it logs in, gets a fabric token, and tries to become an instance of a capability
its credential does not list, both where the registrar decides (announce) and where NATS
does (subscribing to that capability's subjects).
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from reach.security.credentials import CredentialsFile, CredentialStore
from reach.security.membership import connect_as
from reach.wire import subjects

from .conftest import Refusals, UpFabric, ask, attacker, fabric_state, fabric_token, request_bytes


def manifest(agent_id: str, *caps: str) -> dict[str, Any]:
    return {
        "instance_id": secrets.token_hex(8),
        "started_at": time.time(),
        "manifest": {
            "agent_id": agent_id,
            "agent_name": "rogue",
            "version": "1.0.0",
            "capabilities": [{"name": cap, "security_level": 3} for cap in caps],
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


async def test_an_agent_cannot_announce_a_capability_its_credential_does_not_list(
    up_fabric: UpFabric,
) -> None:
    _, creds = await up_fabric.add_client(level=1, agent_id="rogue-1", caps=("weather",))
    nc = await attacker(up_fabric, creds)
    try:
        token = await fabric_token(nc, *up_fabric.secret_of(creds))
        alone = manifest("rogue-1", "secret_cap")
        reply = await ask(nc, subjects.announce("rogue-1"), request_bytes(alone, token))
        assert reply["err"]["code"] == "capability_not_allowed", reply
        assert "secret_cap" in reply["err"]["desc"]
        both = manifest("rogue-1", "weather", "secret_cap")
        reply = await ask(nc, subjects.announce("rogue-1"), request_bytes(both, token))
        assert reply["err"]["code"] == "capability_not_allowed", reply
    finally:
        await nc.close()
    assert subjects.agent_key("rogue-1") not in await registry_keys(up_fabric)


async def test_an_agent_credential_that_lists_no_capability_serves_none(
    up_fabric: UpFabric, refusals: Refusals
) -> None:
    # `reach creds add --agent-id` refuses to make one; an admin's script still could
    conn, _ = await connect_as([up_fabric.url], name="admin", credentials=up_fabric.admin)
    try:
        store = await CredentialStore.open(conn, create=False)
        _, secret = await store.add("unbound", 1, agent_id="unbound-1")
    finally:
        await conn.close()
    creds = up_fabric.workdir / "unbound.creds"
    CredentialsFile(up_fabric.url, "unbound", secret).write(creds)
    before = await fabric_state(up_fabric)
    nc = await attacker(up_fabric, creds, error_cb=refusals.on_error)
    try:
        token = await fabric_token(nc, *up_fabric.secret_of(creds))
        reply = await ask(
            nc, subjects.announce("unbound-1"), request_bytes(manifest("unbound-1", "any"), token)
        )
        assert reply["err"]["code"] == "capability_not_allowed", reply
        assert "no capability" in reply["err"]["desc"]
        for subject in (
            subjects.capability_instance("any", "unbound-1"),
            subjects.capability_instance("*", "unbound-1"),
            subjects.capability("any"),
        ):
            await nc.subscribe(subject, queue="any" if subject.count(".") == 3 else "")
            await refusals.wait_for(subject)
    finally:
        await nc.close()
    assert subjects.agent_key("unbound-1") not in await registry_keys(up_fabric)
    assert await fabric_state(up_fabric) == before


async def test_nats_delivers_an_agent_only_the_calls_of_its_own_capabilities(
    up_fabric: UpFabric, refusals: Refusals
) -> None:
    _, creds = await up_fabric.add_client(level=1, agent_id="rogue-2", caps=("weather",))
    nc = await attacker(up_fabric, creds, error_cb=refusals.on_error)
    try:
        for subject in (
            subjects.capability_instance("secret_cap", "rogue-2"),
            subjects.capability_instance("*", "rogue-2"),
            subjects.capability_instance("secret_cap", "victim-001"),
            subjects.capability("secret_cap"),
            "reach.v1.cap.>",
        ):
            await nc.subscribe(subject)
            await refusals.wait_for(subject)
        # its own are fine
        await nc.subscribe(subjects.capability_instance("weather", "rogue-2"))
        await nc.subscribe(subjects.capability("weather"), queue="weather")
        await nc.flush()
        assert not refusals.about("weather")
    finally:
        await nc.close()
