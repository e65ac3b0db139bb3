"""Registry records are decoded by every route cache and registrar on every change, most
of them heartbeats: a manifest already seen is reused, never trusted blindly. A record no
registrar of ours wrote (anyone may write one on an open fabric) is refused as a codec
error and stops no route cache, client or registrar."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgpack
import pytest

from reach.caller.client import ReachClient
from reach.errors import CodecError, ConfigurationError
from reach.registry import Registrar, RegistrarConfig
from reach.registry.store import decode_instance
from reach.testing import NatsServer
from reach.transport import Connection, connect
from reach.wire import subjects
from reach.wire.modelcodec import encode_model
from reach.wire.models import Instance, parse_manifest
from tests.calls_helpers import capability, make_agent, wait_routable
from tests.routing_helpers import instance


def test_a_heartbeat_reuses_the_manifest_and_changes_the_rest() -> None:
    first = decode_instance(encode_model(instance("reuse-1")))
    beat = instance("reuse-1").model_copy(update={"in_flight": 7, "last_heartbeat_at": 9.0})
    second = decode_instance(encode_model(beat))
    assert second == beat
    assert second.manifest is first.manifest  # validated once
    assert (second.in_flight, second.last_heartbeat_at) == (7, 9.0)


def test_a_new_manifest_is_validated_and_used() -> None:
    decode_instance(encode_model(instance("upgrade-1", version="1.0.0")))
    upgraded = decode_instance(encode_model(instance("upgrade-1", version="2.0.0")))
    assert upgraded.manifest.version == "2.0.0"


def _record(**changes: Any) -> bytes:
    raw = instance("broken-1").model_dump(mode="json")
    raw.update(changes)
    return bytes(msgpack.packb(raw, use_bin_type=True))


@pytest.mark.parametrize(
    ("data", "names"),
    [
        (b"\xc1", "not a valid msgpack"),
        (msgpack.packb([1, 2]), "not a valid Instance"),
        (_record(manifest={"agent_id": "broken-1"}), "manifest"),
        (_record(in_flight="many"), "not a valid Instance"),
        (_record(status="sleeping"), "not a valid Instance"),
    ],
)
def test_a_broken_record_is_a_codec_error_that_says_so(data: bytes, names: str) -> None:
    with pytest.raises(CodecError, match=names):
        decode_instance(data)


def test_a_manifest_that_failed_is_not_remembered_as_good() -> None:
    bad = instance("twice-1").model_dump(mode="json")
    bad["manifest"]["capabilities"] = [{"name": "Not A Token!"}]
    data = bytes(msgpack.packb(bad, use_bin_type=True))
    for _ in range(2):
        with pytest.raises(CodecError, match="manifest"):
            decode_instance(data)
    assert isinstance(decode_instance(encode_model(instance("twice-1"))), Instance)


# -- a record no registrar wrote -------------------------------------------------------


def _nested_schema(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {}
    for _ in range(depth):
        schema = {"not": schema}
    return schema


def _poisoned_record(agent_id: str) -> bytes:
    """A record no registrar of ours writes (anyone may, on an open fabric)."""
    now = time.time()
    manifest = {
        "agent_id": agent_id,
        "agent_name": "evil",
        "version": "1.0.0",
        "capabilities": [{"name": "work", "input_schema": _nested_schema(500)}],
    }
    record = {
        "manifest": manifest,
        "instance_id": "i",
        "registered_at": now,
        "last_heartbeat_at": now,
    }
    return bytes(msgpack.packb(record))


def test_a_schema_nested_too_deep_is_refused_in_a_manifest_and_in_a_record() -> None:
    deep = {
        "agent_id": "deep-1",
        "agent_name": "deep",
        "version": "1.0.0",
        "capabilities": [{"name": "work", "input_schema": _nested_schema(500)}],
    }
    with pytest.raises(ConfigurationError, match="nested more than"):
        parse_manifest(deep)
    with pytest.raises(CodecError):
        decode_instance(_poisoned_record("evil-1"))
    # a contract as deep as any needs is fine
    fine = {**deep, "capabilities": [{"name": "work", "input_schema": _nested_schema(20)}]}
    assert parse_manifest(fine).capabilities[0].name == "work"


async def test_a_poisoned_registry_record_stops_no_route_cache_client_or_registrar(
    nats_server: NatsServer, registrar: Registrar, client: ReachClient, conn: Connection
) -> None:
    bucket = await conn.key_value(subjects.REGISTRY_BUCKET)
    await bucket.put(subjects.agent_key("evil-1"), _poisoned_record("evil-1"))
    # announced after the bad record (a later revision): every watch meets the bad one first
    agent, _ = make_agent(nats_server.url, "late-1", capability("work"))
    async with agent:
        # a running client's route cache still follows the registry
        await wait_routable(client, "work", 1)
        assert [i.agent_id for i in client.routes.find("work")] == ["late-1"]
        assert (await client.call("work", {"n": 1})).agent_id == "late-1"
        # a new client still connects (its first sync reads past the bad record)
        async with ReachClient(servers=nats_server.url, sync_timeout=5) as fresh:
            await wait_routable(fresh, "work", 1)
            assert [i.agent_id for i in fresh.routes.find("work")] == ["late-1"]
        # and a registrar starting now still syncs
        other_conn = await connect([nats_server.url], name="test-registrar-2")
        other = Registrar(other_conn, RegistrarConfig(liveness_interval_sec=0.2))
        try:
            await asyncio.wait_for(other.start(), 10)
            assert "late-1" in [i.agent_id for i in other.instances()]
        finally:
            await other.stop()
            await other_conn.close()
