"""Answers sent where the attacker says: the reply subject of a request is the sender's
choice, and NATS permissions cannot restrict it.

A caller's or an agent's credential places its connection in the clients' account, which
has no JetStream; it reaches the fabric's account only through service imports, and each
answer comes back through a one-time mapping to the reply subject *in the clients'
account*. Two ways an attacker would still like to use an answer:

* a JetStream publish it may make (an audit batch under its own id, a record of its own
  job) is acknowledged on the reply subject: a PubAck (``{"stream": …, "seq": N}``)
  answered on ``$JS.API.STREAM.PURGE.<stream>`` is a purge of the first N messages;
* an answer handed back onto a subject the clients' account imports (another client's
  audit subject, another client's job record, the token or announce subjects) would be
  passed on into the fabric's account as a message of the attacker's making.

Each must land nowhere: the store is as it was, and a spy in the fabric's account (the
admin's login) sees no message the attacker did not send itself.
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path
from typing import Any

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from reach.transport.kvfollow import REPUBLISH_PREFIX
from reach.wire import subjects

from .conftest import (
    Refusals,
    UpFabric,
    attacker,
    fabric_state,
    start_up,
    stop_up,
    stream_configs,
)

#: where the attacker would like a PubAck to land: a purge (``seq``: up to that message),
#: a stream's deletion, a key of the signing-key and credential buckets
PUB_ACK_TARGETS = (
    "$JS.API.STREAM.PURGE.KV_REACH_CREDENTIALS",
    "$JS.API.STREAM.PURGE.KV_REACH_KEYS",
    "$JS.API.STREAM.PURGE.REACH_AUDIT",
    "$JS.API.STREAM.DELETE.REACH_AUDIT",
    "$KV.REACH_KEYS.pub.planted",
    "$KV.REACH_CREDENTIALS.client.planted",
)


async def audit_size(fabric: UpFabric) -> tuple[int, int]:
    """REACH_AUDIT's first sequence and number of messages, read by the admin."""
    admin = await attacker(fabric, fabric.admin)
    try:
        state = (await admin.jetstream().stream_info(subjects.AUDIT_STREAM)).state
        return state.first_seq, state.messages
    finally:
        await admin.close()


async def test_a_pub_ack_is_not_answered_onto_the_jetstream_api(tmp_path: Path) -> None:
    fabric = start_up(tmp_path)  # its own: the attack, when it works, wipes the store
    try:
        client_id, creds = await fabric.add_client(
            agent_id="eve-5", caps=("export",), roles=("jobs",)
        )
        before = await fabric_state(fabric), await stream_configs(fabric)
        first, count = await audit_size(fabric)
        nc = await attacker(fabric, creds)
        try:
            batch = subjects.audit("export", client_id)
            job = f"$KV.{subjects.JOBS_BUCKET}.job.{client_id}.eve-5.k1"
            for target in PUB_ACK_TARGETS:
                await nc.publish(batch, b"an audit batch", reply=target)
                await nc.publish(job, b"a job record", reply=target)
            # both are stored (and so acknowledged): the attack ran
            ack = await nc.request(batch, b"one more batch", timeout=5)
            assert json.loads(ack.data)["stream"] == subjects.AUDIT_STREAM
        finally:
            await nc.close()
        # nothing purged: every batch is still there, the first one included
        assert await audit_size(fabric) == (first or 1, count + len(PUB_ACK_TARGETS) + 1)
        assert (await fabric_state(fabric), await stream_configs(fabric)) == before
    finally:
        stop_up(fabric)


class Spy:
    """The admin's login in the fabric's account, keeping every message on the subjects
    the clients' account imports (where a passed-on answer would arrive)."""

    SUBJECTS = (f"{subjects.PREFIX}.>", f"$KV.{subjects.JOBS_BUCKET}.>")

    def __init__(self, nc: NatsClient) -> None:
        self.nc = nc
        self.seen: list[tuple[str, str, bytes]] = []

    async def start(self) -> None:
        for subject in self.SUBJECTS:
            await self.nc.subscribe(subject, cb=self.keep)
        await self.nc.flush()

    async def keep(self, msg: Msg) -> None:
        self.seen.append((msg.subject, msg.reply, bytes(msg.data)))


async def sources(nc: NatsClient, client_id: str) -> list[tuple[str, bytes]]:
    """Requests the attacker may make, each answered by the fabric: the JetStream API
    (its account info, a stream's info, a direct get of a job record whose bytes it
    chose), a JetStream publish (its PubAck), the token issuer and the registrar."""
    job = f"$KV.{subjects.JOBS_BUCKET}.job.{client_id}.eve-6.k1"
    ack = await nc.request(job, b'{"chosen": "bytes"}', timeout=5)
    assert json.loads(ack.data)["stream"] == f"KV_{subjects.JOBS_BUCKET}"
    return [
        ("$JS.API.INFO", b""),
        (f"$JS.API.STREAM.INFO.KV_{subjects.REGISTRY_BUCKET}", b""),
        (f"$JS.API.DIRECT.GET.KV_{subjects.JOBS_BUCKET}.{job}", b""),
        (subjects.audit("export", client_id), b"an audit batch"),
        (subjects.TOKEN, b"not an envelope"),
        (subjects.REGISTRAR_PING, b""),
    ]


def targets(victim: str, victim_agent: str) -> tuple[str, ...]:
    """Imported subjects the attacker may not publish to, where a passed-on answer would
    act in the victim's name or as a fabric request."""
    return (
        subjects.audit("vault", victim),
        subjects.audited("vault", victim),
        f"$KV.{subjects.JOBS_BUCKET}.job.{victim}.{victim_agent}.k1",
        subjects.TOKEN,
        subjects.REGISTRAR_PING,
        subjects.announce(victim_agent),
        subjects.heartbeat(victim_agent),
        subjects.bye(victim_agent),
    )


async def answered(nc: NatsClient, requests: list[tuple[str, bytes]]) -> None:
    """Each request, sent once more with the attacker's own inbox, is answered."""
    for subject, data in requests:
        reply = await nc.request(subject, data, timeout=5)
        assert reply.data or reply.headers, subject


def republished(subject: str) -> bool:
    """A change of a public bucket the server republishes (the registrar's own record
    each second among them): the fabric's message, not an answer."""
    return subject.startswith(f"{REPUBLISH_PREFIX}.")


async def test_an_answer_is_not_passed_on_into_the_fabric_account(tmp_path: Path) -> None:
    fabric = start_up(tmp_path)
    try:
        client_id, creds = await fabric.add_client(
            agent_id="eve-6", caps=("export",), roles=("jobs",)
        )
        victim, _ = await fabric.add_client(level=4, roles=("jobs",))
        before = await fabric_state(fabric), await stream_configs(fabric)
        spy = Spy(await attacker(fabric, fabric.admin))
        nc = await attacker(fabric, creds)
        try:
            requests = await sources(nc, client_id)
            await spy.start()
            for target in targets(victim, "victim-a"):
                for subject, data in requests:
                    await nc.publish(subject, data, reply=target)
            await answered(nc, requests)  # served after the attack's requests
            await spy.nc.flush()
        finally:
            await nc.close()
            await spy.nc.close()
        passed_on = [
            (subject, reply, data[:80])
            for subject, reply, data in spy.seen
            if victim in subject or "victim-a" in subject or not (reply or republished(subject))
        ]
        assert passed_on == []
        # the attacker's own requests did arrive: the spy listens where it should
        assert {subjects.TOKEN, subjects.REGISTRAR_PING} <= {s for s, _, _ in spy.seen}
        assert (await fabric_state(fabric), await stream_configs(fabric)) == before
        assert await victim_records(fabric, victim) == {}
    finally:
        stop_up(fabric)


async def victim_records(fabric: UpFabric, victim: str) -> dict[str, Any]:
    """The audit batches and job records stored under the victim's id (none expected)."""
    admin = await attacker(fabric, fabric.admin)
    try:
        js = admin.jetstream()
        found: dict[str, Any] = {}
        for stream, pattern in (
            (subjects.AUDIT_STREAM, subjects.audit("*", victim)),
            (f"KV_{subjects.JOBS_BUCKET}", f"$KV.{subjects.JOBS_BUCKET}.job.{victim}.>"),
        ):
            info = await js.stream_info(stream, subjects_filter=pattern)
            found |= info.state.subjects or {}
        return found
    finally:
        await admin.close()


async def test_a_client_may_not_name_a_reply_subject_of_the_server_s_own(
    tmp_path: Path, refusals: Refusals
) -> None:
    """The one-time subjects that carry answers between accounts (``_R_.…``) are the
    server's: a client naming one as its reply is refused, so it cannot pose as an
    answer's way back into the fabric's account."""
    fabric = start_up(tmp_path)
    try:
        _, creds = await fabric.add_client()
        nc = await attacker(fabric, creds, error_cb=refusals.on_error)
        try:
            reply = f"_R_.{secrets.token_hex(3)}.{secrets.token_hex(3)}"
            await nc.publish(subjects.REGISTRAR_PING, b"", reply=reply)
            await refusals.wait_for(f'reply of "{reply}"')
        finally:
            await nc.close()
    finally:
        stop_up(fabric)
