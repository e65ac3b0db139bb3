"""What a call is given that it cannot carry or honour (a capability name that is no
subject token, NaN against a contract, a timeout that is not finite, a payload or an
output too large for a NATS message, a callee's malformed denial) is refused at once with
a typed error, not a timeout or an untyped one, and the client and the agent keep
working. Real nats-server throughout."""

from __future__ import annotations

import asyncio
import math
import secrets
import time
from typing import Any

import msgpack
import pytest

from reach.audit.eventmodels import decode_batch
from reach.caller.attempt import remote_error
from reach.caller.client import ReachClient
from reach.errors import (
    ConfigurationError,
    ContractError,
    NotAuthorized,
    ReachTimeout,
)
from reach.registry import Registrar
from reach.testing import NatsServer
from reach.transport import Connection, Message
from reach.wire import envelope, subjects

from .calls_helpers import capability, make_agent, wait_routable

# -- a capability name that is not a subject token -------------------------------------

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


# -- NaN and infinities against a float "multipleOf" -----------------------------------

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


# -- a malformed "insufficient_level" code from a callee -------------------------------


@pytest.mark.parametrize(
    "code",
    [
        "insufficient_level:abc:1",
        "insufficient_level:3",
        "insufficient_level:",
        "insufficient_level:x:y",
    ],
)
def test_a_malformed_insufficient_level_code_is_a_refusal_with_levels_unsaid(code: str) -> None:
    reply = envelope.Reply(ok=False, kind="denied", code=code, description="no", by="rogue-1")
    error = remote_error(reply, "work")
    assert isinstance(error, NotAuthorized)
    assert (error.level_required, error.level_held) == (0, 0)  # not guessed from the text
    assert (error.code, error.agent_id) == (code, "rogue-1")
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
        with pytest.raises(NotAuthorized, match="rogue-1"):
            await client.call("work", {"a": 1}, timeout=2)
    assert len(answered) == len(codes)


# -- an output under the codec's limit whose reply is over the server's max_payload ----

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


# -- a call timeout that is not finite, or absurd --------------------------------------


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


# -- a payload the server cannot carry -------------------------------------------------


async def test_a_payload_over_the_servers_max_payload_is_refused_before_it_is_sent(
    nats_server: NatsServer, registrar: Registrar
) -> None:
    agent, b = make_agent(nats_server.url, "a-1")
    async with agent, ReachClient(servers=nats_server.url) as client:
        await wait_routable(client, "work", 1)
        # within the codec's limits, too large for the server once the envelope is added
        big = {"blob": "x" * (client.connection.max_payload - 100)}
        for _ in range(25):  # more than the breaker's min_calls
            with pytest.raises(ContractError) as refused:
                await client.call("work", big)
        assert refused.value.rule == "max_bytes"
        snapshot = client.breakers.get("a-1").snapshot()
        assert (snapshot.state, snapshot.calls, snapshot.failures) == ("closed", 0, 0)
        assert (await client.call("work", {"small": 1})).agent_id == "a-1"
    assert b.calls == 1
