"""The error kinds and codes of docs/protocol.md, as a caller raises them.

A third party's agent, written with nats-py and msgpack only (no Agent-Reach code: it
reads the envelope and answers with maps built by hand), answers each error of the
protocol's table on a fabric `reach up` started; a ReachClient calls it and gets the
error the table names, with its fields. Then an Agent-Reach agent's contract error
carries its field in ``err.path``, which the caller reads rather than the description.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import msgpack
import nats
import pytest
from nats.aio.msg import Msg

from reach.caller.client import ReachClient
from reach.errors import (
    AuthenticationFailed,
    BusinessError,
    CodecError,
    ContractError,
    InternalError,
    NotAuthorized,
    ReachError,
    ReachTimeout,
    Unavailable,
)

from .calls_helpers import capability, make_agent, wait_routable
from .up_helpers import Secured

#: what the third party's agent answers, by case: the ``err`` map of its reply
ANSWERS: dict[str, dict[str, Any]] = {
    "not_authorized": {"kind": "denied", "code": "not_authorized", "desc": "not for you"},
    "level": {"kind": "denied", "code": "insufficient_level:3:2", "desc": "level 3 needed"},
    "level_unsaid": {"kind": "denied", "code": "insufficient_level", "desc": "too low"},
    "wrong_agent": {"kind": "denied", "code": "wrong_agent", "desc": "bound elsewhere"},
    "no_token": {"kind": "denied", "code": "no_token", "desc": "echo requires a token"},
    "bad_token": {"kind": "denied", "code": "authentication_failed", "desc": "expired"},
    "replayed": {"kind": "denied", "code": "replayed", "desc": "call c-1 attempt 1 replayed"},
    "new_denial": {"kind": "denied", "code": "geo_fenced", "desc": "not from here"},
    "contract": {
        "kind": "contract",
        "code": "type",
        "desc": 'a["b: c"]: expected integer, got "x"',
        "path": 'a["b: c"]',
    },
    "contract_text": {"kind": "contract", "code": "minimum", "desc": "items[2].n: must be >= 0"},
    "contract_no_path": {"kind": "contract", "code": "bad_envelope", "desc": "no id"},
    "business": {"kind": "business", "code": "no_data", "desc": "no data for 1999"},
    "unavailable": {"kind": "unavailable", "code": "over_capacity", "desc": "at 64 calls"},
    "timeout": {"kind": "timeout", "code": "deadline_passed", "desc": "too late"},
    "internal": {"kind": "internal", "code": "crash", "desc": "boom"},
}


def _reply(case: str) -> bytes:
    err = ANSWERS.get(case)
    if err is None:
        return msgpack.packb(
            {"v": 1, "ok": False, "err": {"kind": "gremlins", "code": "x", "desc": "?"}}
        )
    return msgpack.packb({"v": 1, "ok": False, "err": err, "by": "a-1"})


@asynccontextmanager
async def third_party_agent(fabric: Secured) -> AsyncIterator[None]:
    """An agent as docs/protocol.md describes it, with nats-py: the NATS login with the
    credential's client id and secret and its own inbox prefix, a subscription in the
    capability's queue group, and a hand-built reply to each request."""
    creds = json.loads(fabric.agent.read_text())
    nc = await nats.connect(
        creds["url"],
        user=creds["client_id"],
        password=creds["secret"],
        inbox_prefix=f"_INBOX.{creds['client_id']}",
        allow_reconnect=False,
    )

    async def answer(msg: Msg) -> None:
        request = msgpack.unpackb(msg.data)
        payload = msgpack.unpackb(request["b"])
        await nc.publish(msg.reply, _reply(payload["case"]))

    await nc.subscribe("reach.v1.cap.echo", queue="echo", cb=answer)
    await nc.flush()
    try:
        yield
    finally:
        await nc.close()


async def _raised(client: ReachClient, case: str) -> ReachError:
    with pytest.raises(ReachError) as caught:
        await client.call("echo", {"case": case}, timeout=5)
    return caught.value


async def test_each_error_of_the_table_is_raised_with_its_fields(secured: Secured) -> None:
    async with (
        third_party_agent(secured),
        ReachClient(servers=secured.url, credentials=secured.watcher, max_retries=0) as client,
    ):
        for case in ("not_authorized", "wrong_agent", "level_unsaid"):
            error = await _raised(client, case)
            assert type(error) is NotAuthorized, case
            assert (error.level_required, error.level_held) == (0, 0)
            assert (error.code, error.agent_id) == (ANSWERS[case]["code"], "a-1")
        error = await _raised(client, "level")
        assert isinstance(error, NotAuthorized)
        assert (error.level_required, error.level_held) == (3, 2)
        assert error.code == "insufficient_level:3:2"
        for case in ("no_token", "bad_token", "replayed", "new_denial"):
            error = await _raised(client, case)
            assert type(error) is AuthenticationFailed, case
            assert (error.code, error.agent_id) == (ANSWERS[case]["code"], "a-1")
            assert ANSWERS[case]["desc"] in str(error)

        error = await _raised(client, "contract")
        assert type(error) is ContractError
        # the reply's path, not the description cut at its first colon
        assert (error.path, error.rule) == ('a["b: c"]', "type")
        # no err.path, no field: a description that looks like "<path>: <reason>" is text
        for case in ("contract_text", "contract_no_path"):
            error = await _raised(client, case)
            assert type(error) is ContractError, case
            assert error.path == "", case

        error = await _raised(client, "business")
        assert isinstance(error, BusinessError)
        assert (error.code, error.description, error.agent_id) == (
            "no_data",
            "no data for 1999",
            "a-1",
        )
        assert type(await _raised(client, "unavailable")) is Unavailable
        assert type(await _raised(client, "timeout")) is ReachTimeout
        error = await _raised(client, "internal")
        assert isinstance(error, InternalError)
        assert (error.code, error.description, error.agent_id) == ("crash", "boom", "a-1")
        # a kind the protocol does not have: the reply is refused, naming the field
        error = await _raised(client, "unknown_kind")
        assert isinstance(error, CodecError)
        assert error.path == "err.kind"


async def test_an_agents_contract_error_names_its_field_in_the_reply(secured: Secured) -> None:
    odd = "b: c"  # a key a description cut at its first colon would lose
    schema = {"type": "object", "properties": {odd: {"type": "integer"}}}
    agent, _ = make_agent(secured.url, "a-1", capability("echo", level=2, input_schema=schema))
    agent.credentials = secured.agent
    async with (
        agent,
        ReachClient(servers=secured.url, credentials=secured.watcher, validate=False) as client,
    ):
        await wait_routable(client, "echo", 1)
        with pytest.raises(ContractError) as caught:
            await client.call("echo", {odd: "x"}, timeout=5)
    assert caught.value.path == '["b: c"]'
    assert caught.value.rule == "type"
