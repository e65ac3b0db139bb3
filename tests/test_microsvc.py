"""Agents as NATS micro services: `$SRV.PING`, `$SRV.INFO` and `$SRV.STATS`.

A plain nats-py client, as `nats micro ls|info|stats` or any other NATS tool would, asks
the fabric's agents who they are, what they serve and what they served. The answers
follow the NATS micro protocol, read here with nats-py's own micro types (nats.micro).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import nats
import nats.errors
import pytest
from nats.aio.client import Client as NatsClient
from nats.micro.service import ServiceInfo, ServicePing, ServiceStats

from reach.agent.agent import Agent
from reach.agent.endpoint import endpoint_for
from reach.agent.microsvc import (
    INFO_TYPE,
    PING_TYPE,
    STATS_TYPE,
    MicroService,
    service_name,
    service_version,
)
from reach.caller.client import ReachClient
from reach.errors import BusinessError
from reach.security.callout import permissions_for
from reach.wire import envelope
from reach.wire.models import Manifest, parse_manifest

from .calls_helpers import Behaviour
from .cli_helpers import reach_cli
from .conftest import Fabric, vault_agent
from .srv_helpers import gather
from .up_helpers import Secured

#: what a capability of these tests takes and gives
TEXT_IN = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
TEXT_OUT = {"type": "object", "properties": {"echo": {"type": "string"}}}


def text_agent(url: str, creds: Path | None, agent_id: str, name: str, cap: str) -> Agent:
    """An agent named ``name`` serving ``cap`` at level 2: echoes ``text``, refuses "fail"."""
    manifest = {
        "agent_id": agent_id,
        "agent_name": name,
        "version": "1.2.0",
        "capabilities": [
            {
                "name": cap,
                "description": f"{cap} some text",
                "security_level": 2,
                "input_schema": TEXT_IN,
                "output_schema": TEXT_OUT,
            }
        ],
        "health": {"interval_sec": 0.5, "timeout_sec": 0.3, "failures_before_unhealthy": 2},
    }
    agent = Agent(manifest, servers=url, credentials=creds)

    @agent.capability(cap)
    async def serve(req: dict[str, Any]) -> dict[str, Any]:
        if req["text"] == "fail":
            raise BusinessError("asked to fail", code="asked_to_fail")
        return {"echo": req["text"]}

    return agent


def login_of(creds: Path) -> tuple[str, str]:
    """(client id, secret) of a credentials file: ``{url, client_id, secret}``."""
    data = json.loads(creds.read_text())
    return str(data["client_id"]), str(data["secret"])


async def discovery_client(url: str, creds: Path) -> NatsClient:
    """A plain nats-py connection of the client in ``creds``, with the inbox prefix a tool
    that asks ``$SRV`` uses on a secured fabric: ``_INBOX.<client_id>.srv``."""
    client_id, secret = login_of(creds)
    return await nats.connect(
        url,
        user=client_id,
        password=secret,
        inbox_prefix=f"_INBOX.{client_id}.srv",
        allow_reconnect=False,
    )


async def add_agent_creds(fabric: Secured, name: str, agent_id: str, cap: str) -> Path:
    out = fabric.admin.parent.parent / f"{name}.creds"
    code, stdout, stderr = await reach_cli(
        "creds", "add", name, "--level", "2", "--agent-id", agent_id, "--cap", cap,
        "--out", str(out), "--servers", fabric.url, "--creds", str(fabric.admin),
    )  # fmt: skip
    assert code == 0, stdout + stderr
    return out


async def test_every_agent_answers_srv_as_a_nats_micro_service(secured: Secured) -> None:
    beta_creds = await add_agent_creds(secured, "agent-b", "b-1", "shout")
    alpha = text_agent(secured.url, secured.agent, "a-1", "alpha", "echo")
    beta = text_agent(secured.url, beta_creds, "b-1", "beta", "shout")
    nc = await discovery_client(secured.url, secured.watcher)
    try:
        async with alpha, beta:
            # PING: every live agent answers, each with its name, id and version
            pings = await gather(nc, "$SRV.PING", want=2)
            assert {(p["name"], p["id"]) for p in pings} == {("alpha", "a-1"), ("beta", "b-1")}
            for p in pings:
                assert p["type"] == PING_TYPE
                assert ServicePing.from_dict(p).version == "1.2.0"
            assert [p["id"] for p in await gather(nc, "$SRV.PING.beta", want=1)] == ["b-1"]
            # an admin's tool (`nats micro ls` with the operator's credentials, in the
            # fabric account, with nats-py's default inbox) lists them too
            admin_id, admin_secret = login_of(secured.admin)
            admin = await nats.connect(
                secured.url, user=admin_id, password=admin_secret, allow_reconnect=False
            )
            try:
                listed = await gather(admin, "$SRV.PING", want=2)
                assert {p["id"] for p in listed} == {"a-1", "b-1"}
                (admin_info,) = await gather(admin, "$SRV.INFO.beta", want=1)
                assert [e.name for e in ServiceInfo.from_dict(admin_info).endpoints] == ["shout"]
            finally:
                await admin.close()

            # INFO of one name: its capabilities as endpoints, with their contracts
            (info,) = await gather(nc, "$SRV.INFO.alpha", want=1)
            assert info["type"] == INFO_TYPE
            (endpoint,) = ServiceInfo.from_dict(info).endpoints
            assert (endpoint.name, endpoint.subject, endpoint.queue_group) == (
                "echo",
                "reach.v1.cap.echo",
                "echo",
            )
            assert json.loads(endpoint.metadata["input_schema"]) == TEXT_IN
            assert json.loads(endpoint.metadata["output_schema"]) == TEXT_OUT
            assert endpoint.metadata["security_level"] == "2"

            # STATS: the calls made through ReachClient, and the one that failed
            async with ReachClient(servers=secured.url, credentials=secured.watcher) as client:
                await client.routes.wait_for(lambda c: bool(c.find("echo")), timeout=5)
                for text in ("a", "b", "c"):
                    assert (await client.call("echo", {"text": text})).value == {"echo": text}
                with pytest.raises(BusinessError):
                    await client.call("echo", {"text": "fail"})
            (stats,) = await gather(nc, "$SRV.STATS.alpha.a-1", want=1)
            assert stats["type"] == STATS_TYPE
            (served,) = ServiceStats.from_dict(stats).endpoints
            assert (served.name, served.num_requests, served.num_errors) == ("echo", 4, 1)
            assert "asked_to_fail" in (served.last_error or "")
            assert served.processing_time > 0
            assert served.average_processing_time == served.processing_time // 4

            # an agent that stopped answers no more
            await beta.stop()
            assert [p["id"] for p in await gather(nc, "$SRV.PING", want=2, timeout=1)] == ["a-1"]
    finally:
        await nc.close()


async def test_stats_count_calls_refused_before_they_run(fabric: Fabric) -> None:
    """A call that is denied (no token) or cannot be read is a request answered with an
    error: both count, and the last error names what it was."""
    agent = vault_agent(fabric, Behaviour())
    nc = await nats.connect(fabric.url, allow_reconnect=False)
    try:
        async with agent:
            subject = "reach.v1.cap.customer_orders"
            no_token = envelope.pack_request(envelope.RequestMeta(call_id="c-1"), b"\x80")
            for data, code in ((no_token, "no_token"), (b"not an envelope", "bad_envelope")):
                reply = envelope.unpack_reply((await nc.request(subject, data, timeout=5)).data)
                assert (reply.ok, reply.code) == (False, code)
            (stats,) = await gather(nc, "$SRV.STATS.test.vault-1", want=1)
            (served,) = stats["endpoints"]
            assert (served["num_requests"], served["num_errors"]) == (2, 2)
            assert served["data"] == {"denied": 1}
            assert served["last_error"].startswith("bad_envelope: ")
            assert served["processing_time"] == 0  # neither ran
    finally:
        await nc.close()


def sample_manifest(**changes: Any) -> Manifest:
    data = {
        "agent_id": "r-1",
        "agent_name": "reports",
        "version": "2.0.0-rc.1",
        "capabilities": [{"name": "report", "security_level": 3, "input_schema": TEXT_IN}],
    }
    return parse_manifest(data | changes)


def test_answers_have_the_shapes_nats_micro_reads() -> None:
    manifest = sample_manifest()

    async def handler(req: Any) -> Any:
        return req

    service = MicroService(
        manifest, [endpoint_for(manifest.capabilities[0], handler)], 1_700_000_000.25
    )
    ping, info, stats = (json.loads(service.answer(v)) for v in ("PING", "INFO", "STATS"))
    assert ServicePing.from_dict(ping).name == "reports"
    assert ServiceInfo.from_dict(info).version == "2.0.0-rc.1"
    assert stats["started"] == "2023-11-14T22:13:20.250Z"
    assert ServiceStats.from_dict(stats).endpoints[0].num_requests == 0
    # what NATS micro's schemas require beyond nats-py: string metadata, a string
    # description, endpoint data as an object
    for answer in (ping, info, stats):
        assert all(isinstance(v, str) for v in answer["metadata"].values())
    assert isinstance(info["description"], str)
    assert all(isinstance(v, str) for v in info["endpoints"][0]["metadata"].values())
    assert isinstance(stats["endpoints"][0]["data"], dict)
    assert {s for _, s in service.subjects()} == {
        f"$SRV.{verb}{rest}"
        for verb in ("PING", "INFO", "STATS")
        for rest in ("", ".reports", ".reports.r-1")
    }


def test_names_and_versions_are_made_fit_for_nats_micro() -> None:
    assert service_name("report-writer_2") == "report-writer_2"
    assert service_name("répört.x y") == "r_p_rt_x_y"
    assert service_version("1.4.0+build.7") == "1.4.0+build.7"
    assert service_version("1.4") == "0.0.0"


def test_srv_permissions_agents_answer_for_their_own_id_only() -> None:
    agent = permissions_for("agent", agent_id="a1", capabilities=["echo"], inbox_prefix="_INBOX.c1")
    srv = sorted(s for s in agent.subscribe_allow if s.startswith("$SRV"))
    assert srv == sorted(
        f"$SRV.{verb}{rest}" for verb in ("PING", "INFO", "STATS") for rest in ("", ".*", ".*.a1")
    )
    # answers go to the discovery space of inboxes, not to the rest of anyone's inbox
    assert "_INBOX.*.srv.>" in agent.publish_allow
    assert not any(s in ("_INBOX.>", "_INBOX.*.*", "_INBOX.*.*.*") for s in agent.publish_allow)
    assert not agent.allow_responses
    caller = permissions_for("caller", agent_id=None, capabilities=[], inbox_prefix="_INBOX.c2")
    assert "$SRV.>" in caller.publish_allow  # anyone may ask
    assert not any(s.startswith("$SRV") for s in caller.subscribe_allow)  # only agents answer
    assert "_INBOX.*.srv.>" not in caller.publish_allow
