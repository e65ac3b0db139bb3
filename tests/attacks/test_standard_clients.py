"""What a standard NATS client may do with a caller's or an agent's credential: open and
read the public buckets the way its key-value API does (nats-py ``key_value``, nats.js
``js.views.kv()``, nats.go ``KeyValue``: the account info, the bucket's stream info, direct
gets), and nothing beside.

The attacker holds one agent credential and uses the JetStream API subjects directly with
nats-py: deleting, purging or changing streams, reading REACH_CREDENTIALS, making a
consumer anywhere, writing registry keys, listening to another client's inbox. Each must
be refused by the server, and the fabric must be as it was.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import nats.errors

from reach.caller.client import ReachClient
from reach.wire import subjects

from ..calls_helpers import wait_routable
from .conftest import (
    STREAMS,
    Refusals,
    UpFabric,
    attacker,
    fabric_state,
    start_up,
    stop_up,
    stream_configs,
)

#: JetStream API requests no caller or agent may make, whatever the body
FORBIDDEN_API = (
    *(
        f"$JS.API.{api}.{stream}"
        for stream in STREAMS
        for api in (
            "STREAM.DELETE",
            "STREAM.PURGE",
            "STREAM.UPDATE",
            "STREAM.MSG.DELETE",
            "STREAM.SNAPSHOT",
            "STREAM.RESTORE",
            "CONSUMER.CREATE",
            "CONSUMER.DURABLE.CREATE",
            "CONSUMER.LIST",
            "CONSUMER.NAMES",
        )
    ),
    "$JS.API.STREAM.CREATE.KV_PWNED",
    "$JS.API.STREAM.CREATE.KV_REACH_CREDENTIALS",
    "$JS.API.STREAM.NAMES",  # every stream of the account, names and configs
    "$JS.API.STREAM.LIST",
    "$JS.API.ACCOUNT.PURGE.REACH",
    "$JS.API.META.LEADER.STEPDOWN",
    "$JS.API.STREAM.LEADER.STEPDOWN.KV_REACH_REGISTRY",
    # the credential store: not even its config, let alone a key
    "$JS.API.STREAM.INFO.KV_REACH_CREDENTIALS",
    "$JS.API.STREAM.MSG.GET.KV_REACH_CREDENTIALS",
    "$JS.API.DIRECT.GET.KV_REACH_CREDENTIALS",
    "$JS.API.DIRECT.GET.KV_REACH_CREDENTIALS.$KV.REACH_CREDENTIALS.client.admin",
    "$JS.API.STREAM.INFO.REACH_AUDIT",  # the audit stream is written, not read, by clients
    "$JS.API.DIRECT.GET.REACH_AUDIT",
    # KV writes: the registry is the registrar's, the keys the issuer's
    "$KV.REACH_REGISTRY.agent.victim-1",
    "$KV.REACH_REGISTRY.agent.eve-1",
    "$KV.REACH_KEYS.pub.pwned",
    "$KV.REACH_CREDENTIALS.client.pwned",
)

#: subscriptions no caller or agent may hold
FORBIDDEN_SUBSCRIPTIONS = (
    "_INBOX.victim-client.>",  # another client's replies
    "_INBOX.*.>",
    "$KV.REACH_CREDENTIALS.>",
    "$KV.REACH_REGISTRY.>",  # the stream's own subjects (a KV put is a publish there)
    f"{subjects.PREFIX}.kv.REACH_CREDENTIALS.>",
    "$JS.API.>",
)


async def test_a_standard_client_opens_and_reads_the_public_buckets(up_fabric: UpFabric) -> None:
    """nats-py's own key-value API works as it is, with an agent's credential: the account
    info (what nats.js asks before it opens a bucket), the bucket's stream info, a key's
    last value and the list of keys from the stream's subjects."""
    _, creds = await up_fabric.add_client(agent_id="reader-1", caps=("read",))
    _, caller_creds = await up_fabric.add_client(level=1)
    agent, _, _ = await up_fabric.add_agent("victim-1", "vault")
    async with agent:
        async with ReachClient(servers=up_fabric.url, credentials=caller_creds) as client:
            await wait_routable(client, "vault", 1)
        nc = await attacker(up_fabric, creds)
        try:
            js = nc.jetstream()
            info = await js.account_info()
            assert info.streams >= 3
            registry = await js.key_value(subjects.REGISTRY_BUCKET)
            entry = await registry.get(subjects.agent_key("victim-1"))
            assert entry.value
            assert b"victim-1" in entry.value
            stream = await js.stream_info(
                "KV_REACH_REGISTRY", subjects_filter="$KV.REACH_REGISTRY.agent.>"
            )
            assert "$KV.REACH_REGISTRY.agent.victim-1" in (stream.state.subjects or {})
            keys = await js.key_value(subjects.KEYS_BUCKET)
            kid_info = await js.stream_info("KV_REACH_KEYS", subjects_filter="$KV.REACH_KEYS.pub.>")
            kids = sorted(kid_info.state.subjects or {})
            assert kids
            assert (await keys.get(kids[0].removeprefix("$KV.REACH_KEYS."))).value
        finally:
            await nc.close()


async def test_the_jetstream_api_beyond_reading_is_refused(
    up_fabric: UpFabric, refusals: Refusals
) -> None:
    _, creds = await up_fabric.add_client(level=4, agent_id="eve-1", caps=("weather",))
    _, caller_creds = await up_fabric.add_client(level=1)
    agent, _, _ = await up_fabric.add_agent("victim-1", "vault")
    async with agent:
        async with ReachClient(servers=up_fabric.url, credentials=caller_creds) as client:
            await wait_routable(client, "vault", 1)
        before = await fabric_state(up_fabric), await stream_configs(up_fabric)
        nc = await attacker(up_fabric, creds, error_cb=refusals.on_error)
        try:
            body = {
                "stream_name": "KV_REACH_CREDENTIALS",
                "config": {"durable_name": "d1", "deliver_subject": "_INBOX.eve-1.x"},
                "name": "KV_REACH_CREDENTIALS",
                "subjects": ["$KV.REACH_CREDENTIALS.>"],
                "seq": 1,
            }
            for subject in FORBIDDEN_API:
                await nc.publish(subject, json.dumps(body).encode(), reply=nc.new_inbox())
            for subject in FORBIDDEN_SUBSCRIPTIONS:
                await nc.subscribe(subject)
            with contextlib.suppress(nats.errors.Error):
                await nc.flush()
            for subject in FORBIDDEN_API:
                await refusals.wait_for(f'publish to "{subject}"')
            for subject in FORBIDDEN_SUBSCRIPTIONS:
                await refusals.wait_for(f'subscription to "{subject}"')
        finally:
            await nc.close()
        assert (await fabric_state(up_fabric), await stream_configs(up_fabric)) == before


#: where an attacker would like the JetStream API's answers to land
REPLY_TARGETS = (
    "$KV.REACH_CREDENTIALS.client.pwned",
    "$KV.REACH_KEYS.pub.pwned",
    "$KV.REACH_REGISTRY.agent.victim-1",
    "$JS.API.STREAM.PURGE.KV_REACH_CREDENTIALS",
    "$JS.API.STREAM.DELETE.REACH_AUDIT",
)


async def test_the_answers_of_the_api_it_may_use_land_nowhere_but_in_inboxes(
    tmp_path: Path,
) -> None:
    """A request's reply subject is the requester's choice, and the server answers a
    JetStream API request with the account's rights: a read a client may make must not
    write its answer into a bucket or a stream, nor run as another API request."""
    fabric = start_up(tmp_path)  # its own: the attack, when it works, wipes the store
    try:
        _, creds = await fabric.add_client(agent_id="eve-2", caps=("weather",))
        before = await fabric_state(fabric), await stream_configs(fabric)
        nc = await attacker(fabric, creds)
        try:
            for target in REPLY_TARGETS:
                for api in (
                    "$JS.API.INFO",
                    "$JS.API.STREAM.INFO.KV_REACH_REGISTRY",
                    "$JS.API.DIRECT.GET.KV_REACH_KEYS",
                    "$JS.API.STREAM.MSG.GET.KV_REACH_KEYS",
                ):
                    await nc.publish(api, b'{"last_by_subj":"$KV.REACH_KEYS.>"}', reply=target)
            await nc.flush()
        finally:
            await nc.close()
        assert (await fabric_state(fabric), await stream_configs(fabric)) == before
    finally:
        stop_up(fabric)


async def test_bytes_an_agent_wrote_are_not_answered_into_the_key_bucket(tmp_path: Path) -> None:
    """A job's record is bytes its agent chose; a direct get of it, answered on a key of
    REACH_KEYS, would plant a signing key of the attacker's (tokens of any level)."""
    fabric = start_up(tmp_path)
    try:
        client_id, creds = await fabric.add_client(
            agent_id="eve-4", caps=("export",), roles=("jobs",)
        )
        nc = await attacker(fabric, creds)
        try:
            key = f"$KV.REACH_JOBS.job.{client_id}.eve-4.k1"
            await nc.jetstream().publish(key, b"a public key record of the attacker's")
            direct_get = f"$JS.API.DIRECT.GET.KV_REACH_JOBS.{key}"
            await nc.publish(direct_get, b"", reply="$KV.REACH_KEYS.pub.planted")
            await nc.flush()
        finally:
            await nc.close()
        state = await fabric_state(fabric)
        assert "pub.planted" not in state["REACH_KEYS"]
    finally:
        stop_up(fabric)
