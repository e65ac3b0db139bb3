"""Inputs from outside (a caller's arguments, a manifest, a callee's reply, a payload) that
used to escape as untyped errors, silence or timeouts: each is now refused at once with a
typed error, and whoever received it keeps working. Real nats-server throughout."""

from __future__ import annotations

import asyncio
import math
import secrets
import time
from typing import Any

import msgpack
import pytest

from reach import envelope, subjects
from reach.audit.records import decode_batch
from reach.calling.attempt import remote_error
from reach.client import ReachClient
from reach.errors import (
    AuthenticationFailed,
    ConfigurationError,
    ContractError,
    NotAuthorized,
    ReachTimeout,
)
from reach.messages import decode_model
from reach.models import AnnounceReply, parse_manifest
from reach.registry import Registrar
from reach.testing import NatsServer
from reach.transport import Connection, Message

from .calls_helpers import capability, make_agent, wait_routable

# -- 1. a capability name that is not a subject token ------------------------------------

BAD_NAMES = {
    "wildcard": "foo.>",
    "space": "foo bar",
    "long": "x" * 5000,
    "crlf": "x 0\r\n\r\nPUB reach.v1.bye.any 0\r\n\r\nPUB y",
}


@pytest.mark.parametrize("case", sorted(BAD_NAMES))
async def test_a_capability_name_that_is_no_subject_token_is_refused_and_the_client_goes_on(
    nats_server: NatsServer, client: ReachClient, case: str
) -> None:
    agent, b = make_agent(nats_server.url, "ok-1", capability("work", sla_ms=2000))
    async with agent:
        await wait_routable(client, "work", 1)
        await client.call("work", {"warm": 1})
        audit = client.audit
        assert audit is not None
        await asyncio.wait_for(audit.flush(), 5)
        written, dropped = audit.written, audit.dropped
        started = time.monotonic()
        with pytest.raises(ConfigurationError, match="not a capability name"):
            await client.call(BAD_NAMES[case], {"a": 1}, timeout=2)
        assert time.monotonic() - started < 1.5  # at once, not after the call's timeout
        # the same client still calls ...
        result = await client.call("work", {"after": 1}, timeout=2)
        assert result.agent_id == "ok-1"
        assert b.calls == 2
        # ... and its audit writer still writes: the failed call's event too, under "_"
        await asyncio.wait_for(audit.flush(), 5)
        assert (audit.written, audit.dropped, audit.pending) == (written + 2, dropped, 0)
    stream = await client.connection.stream(subjects.AUDIT_STREAM)
    names: list[str] = []
    async for msg in stream.read(subjects.audit("_", "*")):
        events, _ = decode_batch(msg.data)
        names += [event.capability for event in events]
    assert names == [BAD_NAMES[case]]


# -- 4. NaN and infinities against a float "multipleOf" ----------------------------------

MULTIPLE_OF = {"type": "object", "properties": {"x": {"type": "number", "multipleOf": 0.5}}}


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
async def test_nan_and_infinities_against_multiple_of_are_contract_errors_on_both_sides(
    nats_server: NatsServer, client: ReachClient, conn: Connection, value: float
) -> None:
    agent, b = make_agent(nats_server.url, "mo-1", capability("work", input_schema=MULTIPLE_OF))
    async with agent, ReachClient(servers=nats_server.url, validate=False) as loose:
        await wait_routable(client, "work", 1)
        await wait_routable(loose, "work", 1)
        # the caller's own pre-check
        with pytest.raises(ContractError):
            await client.call("work", {"x": value}, timeout=2)
        # the callee's check, for a caller that does not check
        with pytest.raises(ContractError):
            await loose.call("work", {"x": value}, timeout=2)
        # a raw request (an agent in another language), and its retry with the same call id
        call_id = secrets.token_hex(8)
        deadline_ms = int((time.time() + 5) * 1000)
        body = msgpack.packb({"x": value})
        subject = subjects.capability_instance("work", "mo-1")
        for attempt in (1, 2):
            meta = envelope.RequestMeta(call_id, deadline_ms=deadline_ms, attempt=attempt)
            raw = await conn.request(subject, envelope.pack_request(meta, body), timeout=2)
            reply = envelope.unpack_reply(raw)
            assert not reply.ok
            assert reply.kind == "contract"
        # and the agent keeps serving
        assert (await client.call("work", {"x": 1.5}, timeout=2)).agent_id == "mo-1"
    assert b.calls == 1


# -- 5. a malformed "insufficient_level" code from a callee ------------------------------


@pytest.mark.parametrize(
    "code",
    [
        "insufficient_level:abc:1",
        "insufficient_level:3",
        "insufficient_level:",
        "insufficient_level:x:y",
    ],
)
def test_a_malformed_insufficient_level_code_is_an_authentication_failure(code: str) -> None:
    reply = envelope.Reply(ok=False, kind="denied", code=code, description="no", by="rogue-1")
    error = remote_error(reply, "work")
    assert isinstance(error, AuthenticationFailed)
    assert "rogue-1" in str(error)


def test_a_well_formed_insufficient_level_code_still_says_the_levels() -> None:
    reply = envelope.Reply(ok=False, kind="denied", code="insufficient_level:3:1", by="vault-1")
    error = remote_error(reply, "customer_orders")
    assert isinstance(error, NotAuthorized)
    assert (error.level_required, error.level_held) == (3, 1)


async def test_a_callee_replying_a_malformed_denial_gives_the_caller_a_typed_error(
    client: ReachClient, conn: Connection
) -> None:
    codes = ["insufficient_level:abc:1", "insufficient_level:3", "insufficient_level:"]
    answered: list[str] = []

    async def rogue(msg: Message) -> None:  # not an agent of ours: any process may answer
        code = codes[len(answered) % len(codes)]
        answered.append(code)
        await conn.respond(msg, envelope.pack_error("denied", code, "no", "rogue-1"))

    await conn.subscribe(subjects.capability("work"), rogue, queue="work")
    await conn.flush()
    for _ in codes:
        with pytest.raises(AuthenticationFailed, match="rogue-1"):
            await client.call("work", {"a": 1}, timeout=2)
    assert len(answered) == len(codes)


# -- 6. an output under the codec's limit whose reply is over the server's max_payload ---

CODEC_LIMIT = 1024 * 1024


async def test_an_output_too_large_for_a_message_is_a_contract_error_not_a_timeout(
    nats_server: NatsServer, client: ReachClient
) -> None:
    size = {"short_by": 10}

    async def big(req: Any) -> Any:
        # msgpack of {"s": str}: 1 (fixmap) + 2 ("s") + 5 (str32 header) + the string
        return {"s": "a" * (CODEC_LIMIT - 8 - size["short_by"])}

    agent, _ = make_agent(nats_server.url, "big-1", capability("work", sla_ms=1000), handler=big)
    async with agent:
        await wait_routable(client, "work", 1)
        assert client.connection.max_payload <= CODEC_LIMIT
        for short_by in (10, 40):  # within the codec's limit: only the envelope is over
            size["short_by"] = short_by
            with pytest.raises(ContractError, match="more than a message may carry") as err:
                await client.call("work", {}, timeout=4)
            assert not isinstance(err.value, ReachTimeout)
            assert err.value.rule == "output_too_large"
            assert "big-1" in str(err.value)
        size["short_by"] = 100_000  # a large output that fits still comes back
        result = await client.call("work", {}, timeout=4)
        assert len(result.value["s"]) == CODEC_LIMIT - 8 - 100_000


# -- 10. SLAs and timeouts that are not finite, or absurd --------------------------------

#: reach.models.MAX_SLA_MS (a day), spelled out: these tests must also run against code
#: that does not have the constant
MAX_SLA_MS = 24 * 3600 * 1000.0


def _manifest_with_sla(sla: float) -> dict[str, Any]:
    return {
        "agent_id": "slow-1",
        "agent_name": "slow",
        "version": "1.0.0",
        "capabilities": [capability("work", sla_ms=sla)],
    }


@pytest.mark.parametrize("sla", [math.inf, math.nan, MAX_SLA_MS * 2, 1e20])
def test_a_latency_sla_that_is_not_finite_or_beyond_a_day_is_refused(sla: float) -> None:
    with pytest.raises(ConfigurationError, match="latency_sla_ms"):
        parse_manifest(_manifest_with_sla(sla))


def test_a_latency_sla_of_a_day_is_accepted() -> None:
    manifest = parse_manifest(_manifest_with_sla(MAX_SLA_MS))
    assert manifest.capabilities[0].latency_sla_ms == MAX_SLA_MS


@pytest.mark.parametrize("sla", [math.inf, 1e20])
async def test_a_raw_announce_with_an_sla_no_deadline_can_follow_is_refused(
    conn: Connection, registrar: Registrar, sla: float
) -> None:
    """From an agent in another language (msgpack carries an infinity): registered, it
    would make every caller's deadline uncomputable."""
    body = msgpack.packb(
        {"manifest": _manifest_with_sla(sla), "instance_id": "i1", "started_at": time.time()}
    )
    raw = await conn.request(
        subjects.announce("slow-1"),
        envelope.pack_request(envelope.RequestMeta(secrets.token_hex(8)), body),
        timeout=2,
    )
    reply = envelope.unpack_reply(raw)
    assert not reply.ok, decode_model(AnnounceReply, reply.body)
    assert reply.kind == "contract"
    assert "latency_sla_ms" in reply.description
    assert await registrar.store.get("slow-1") is None


@pytest.mark.parametrize("timeout", [math.inf, math.nan, -1.0, 1e300])
async def test_a_call_timeout_that_is_not_finite_or_negative_is_refused_before_any_attempt(
    nats_server: NatsServer, client: ReachClient, timeout: float
) -> None:
    agent, b = make_agent(nats_server.url, "ok-1", capability("work"))
    async with agent:
        await wait_routable(client, "work", 1)
        await client.call("work", {"warm": 1})
        before = client.breakers.get("ok-1").snapshot()
        for _ in range(3):
            with pytest.raises(ConfigurationError, match="timeout"):
                await client.call("work", {}, timeout=timeout)
        after = client.breakers.get("ok-1").snapshot()
        assert (after.calls, after.failures) == (before.calls, before.failures)
        assert after.failures == 0
        assert after.state == "closed"
        assert (await client.call("work", {}, timeout=2)).agent_id == "ok-1"
    assert b.calls == 2


# -- 11. NaN or an infinity inside a capability's JSON Schema ----------------------------


def _manifest_with_schema(agent_id: str, bound: float) -> dict[str, Any]:
    return {
        "agent_id": agent_id,
        "agent_name": "nan",
        "version": "1.0.0",
        "capabilities": [
            {
                "name": "work",
                "security_level": 1,
                "input_schema": {
                    "type": "object",
                    "properties": {"x": {"type": "number", "maximum": bound}},
                },
            }
        ],
        "health": {"interval_sec": 3600, "timeout_sec": 5},
    }


@pytest.mark.parametrize("bound", [math.nan, math.inf, -math.inf])
def test_a_schema_holding_nan_or_an_infinity_is_refused_and_says_so(bound: float) -> None:
    with pytest.raises(ConfigurationError, match="NaN or an infinity") as err:
        parse_manifest(_manifest_with_schema("nan-1", bound))
    assert any("input_schema" in line for line in err.value.errors)


@pytest.mark.parametrize("bound", [math.nan, math.inf])
async def test_a_raw_announce_whose_schema_holds_nan_is_refused_not_accepted(
    nats_server: NatsServer, conn: Connection, registrar: Registrar, bound: float
) -> None:
    """An agent in another language: msgpack floats may be NaN, JSON's may not (the record
    would say ``"maximum": null``, which no route cache reads)."""
    body = msgpack.packb(
        {
            "manifest": _manifest_with_schema("nan-1", bound),
            "instance_id": "i1",
            "started_at": time.time(),
        }
    )
    raw = await conn.request(
        subjects.announce("nan-1"),
        envelope.pack_request(envelope.RequestMeta(secrets.token_hex(8)), body),
        timeout=2,
    )
    reply = envelope.unpack_reply(raw)
    if reply.ok:  # an answer that is not a refusal would have to say accepted=False
        answer = decode_model(AnnounceReply, reply.body)
        pytest.fail(f"the announce was answered as a success: {answer}")
    assert reply.kind == "contract"
    assert "NaN or an infinity" in reply.description
    assert await registrar.store.get("nan-1") is None
    # the registrar keeps serving well-formed announces
    agent, _ = make_agent(nats_server.url, "fine-1", capability("work"))
    async with agent:
        assert await registrar.store.get("fine-1") is not None
