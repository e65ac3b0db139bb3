"""The A2A gateway, served by uvicorn in this process over a real nats-server and
registrar (`reach a2a` itself, as a process, is tests/test_a2a_gateway.py):

- a task is its caller's: ids of 128 random bits, and `GetTask` (0.3: `tasks/get`)
  answers another caller, an id never issued and a raw job id as it answers nothing;
- the task store stays within its byte and count bounds however large the messages,
  keeps a task too large for it without its history, and frees expired tasks;
- a card is strict A2A 1.0 by default and 0.3 for a 0.3 reader, with ETag and 304.

The callers are told apart by a test-only ASGI middleware (``as_callers``) that sets the
request's Starlette user from a test header: it stands in for the gateway's login
middleware, which sets the same ``request.user`` from a bearer token.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
import uvicorn
from a2a.client import A2ACardResolver, ClientConfig, ClientFactory
from a2a.compat.v0_3 import types as v03
from a2a.compat.v0_3.conversions import to_core_agent_card
from a2a.helpers import get_data_parts, new_data_part, new_text_part
from a2a.types import (
    AgentCard,
    GetTaskRequest,
    Message,
    Part,
    Role,
    SendMessageConfiguration,
    SendMessageRequest,
    Task,
    TaskNotFoundError,
    TaskState,
)
from google.protobuf.json_format import ParseDict  # type: ignore[import-untyped]
from starlette.authentication import SimpleUser
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from reach.agent.agent import Agent
from reach.caller.client import ReachClient
from reach.clock import ManualClock
from reach.errors import ConfigurationError
from reach.gateways.a2a import A2AGateway
from reach.gateways.a2a_cards import card_document, card_for, security_of
from reach.gateways.a2a_store import NOT_KEPT_KEY, TaskStore
from reach.tasks import cancel_and_wait
from reach.testing import NatsServer

from .calls_helpers import capability, make_agent, wait_routable
from .poll_helpers import until

#: the test header ``as_callers`` takes a caller's name from
USER_HEADER = "x-test-user"
READY_TIMEOUT = 10.0


def as_callers(app: ASGIApp) -> ASGIApp:
    """``app`` with the request's user set to ``SimpleUser(<the test header>)``; a request
    without the header has no user, as on a gateway without login."""

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (name := Headers(scope=scope).get(USER_HEADER)):
            scope = {**scope, "user": SimpleUser(name)}
        await app(scope, receive, send)

    return wrapped


class _Server(uvicorn.Server):
    """uvicorn, leaving the test run's signals alone."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@contextlib.asynccontextmanager
async def live(gateway: A2AGateway) -> AsyncIterator[str]:
    """``gateway`` served on a free loopback port (its registry followed, as `reach a2a`
    does); its base URL."""
    await gateway.client.routes.follow_everything()
    sock = socket.create_server(("127.0.0.1", 0))
    server = _Server(uvicorn.Config(as_callers(gateway.app()), log_level="warning", lifespan="off"))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    try:

        def started() -> bool:
            assert not serving.done(), "uvicorn stopped before it started"
            return server.started

        await until(started, "uvicorn started", timeout=READY_TIMEOUT)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(serving), READY_TIMEOUT)
        await cancel_and_wait([serving])
        sock.close()


def caller(name: str | None) -> httpx.AsyncClient:
    """An HTTP client that is ``name`` to the gateway (nobody when None)."""
    return httpx.AsyncClient(timeout=10, headers={USER_HEADER: name} if name else {})


def message(*parts: Part, **metadata: str) -> SendMessageRequest:
    sent = Message(role=Role.ROLE_USER, message_id=uuid.uuid4().hex, parts=list(parts))
    sent.metadata.update(metadata)
    return SendMessageRequest(message=sent)


async def send(http: httpx.AsyncClient, card: AgentCard, request: SendMessageRequest) -> Task:
    """The task of a non-streaming ``SendMessage``, by the SDK's client."""
    client = ClientFactory(ClientConfig(streaming=False, httpx_client=http)).create(card)
    answers = [answer async for answer in client.send_message(request)]
    (answer,) = answers
    assert answer.HasField("task"), answer
    return answer.task


async def get_task(http: httpx.AsyncClient, card: AgentCard, task_id: str) -> Task:
    client = ClientFactory(ClientConfig(streaming=False, httpx_client=http)).create(card)
    return await client.get_task(GetTaskRequest(id=task_id))


async def rpc(http: httpx.AsyncClient, url: str, method: str, params: dict[str, Any]) -> Any:
    """A raw JSON-RPC request, saying its version (1.0's method names are capitalized);
    its answer."""
    headers = {"A2A-Version": "1.0" if method[0].isupper() else "0.3"}
    body = {"jsonrpc": "2.0", "id": 1, "method": method, "params": params}
    response = await http.post(url, json=body, headers=headers)
    assert response.status_code == 200, response.text
    return response.json()


def answer_of(task: Task) -> Any:
    assert task.status.state == TaskState.TASK_STATE_COMPLETED, task
    (artifact,) = task.artifacts
    (value,) = get_data_parts(artifact.parts)
    return value


def is_random_id(task_id: str) -> bool:
    """At least 128 bits of hex."""
    return re.fullmatch(r"[0-9a-f]{32,}", task_id) is not None


async def card_at(http: httpx.AsyncClient, base: str, name: str) -> AgentCard:
    """An agent's card as the SDK's 1.x resolver reads it."""
    return await A2ACardResolver(http, f"{base}/agents/{name}").get_agent_card()


async def test_a_task_is_read_only_by_the_caller_that_sent_its_message(
    nats_server: NatsServer, client: ReachClient
) -> None:
    agent, _ = make_agent(nats_server.url, "a-1", capability("echo"))
    async with (
        agent,
        live(A2AGateway(client)) as base,
        caller("alice") as alice,
        caller("bob") as bob,
        caller(None) as nobody,
    ):
        await wait_routable(client, "echo", 1)
        card = await card_at(alice, base, "test")
        task = await send(alice, card, message(new_data_part({"x": 1})))
        assert answer_of(task) == {"by": "a-1", "echo": {"x": 1}}
        # its id is random, not the call's, which the metadata keeps
        assert is_random_id(task.id), task.id
        call_id = str(task.metadata["call_id"])
        assert call_id
        assert call_id not in task.id
        again = await send(alice, card, message(new_data_part({"x": 2})))
        assert again.id != task.id
        assert is_random_id(again.id)

        # the caller reads it back, by 1.0's GetTask and by 0.3's tasks/get
        assert await get_task(alice, card, task.id) == task
        url = f"{base}/agents/test"
        old = await rpc(alice, url, "tasks/get", {"id": task.id})
        assert old["result"]["id"] == task.id

        # anyone else is told what an id never issued is told, to the byte
        never = await rpc(alice, url, "GetTask", {"id": uuid.uuid4().hex * 2})
        assert never["error"]["code"] == -32001, never
        for other in (bob, nobody):
            with pytest.raises(TaskNotFoundError):
                await get_task(other, card, task.id)
            assert await rpc(other, url, "GetTask", {"id": task.id}) == never
            old_never = await rpc(other, url, "tasks/get", {"id": uuid.uuid4().hex * 2})
            assert await rpc(other, url, "tasks/get", {"id": task.id}) == old_never
        # the call id is no task id, nor is anything counted down from it
        assert await rpc(alice, url, "GetTask", {"id": call_id}) == never
        prefix, _, count = call_id.rpartition("-")
        assert await rpc(alice, url, "GetTask", {"id": f"{prefix}-{int(count) - 1}"}) == never

        # a caller without login has tasks of its own too, read by nobody else
        mine = await send(nobody, card, message(new_data_part({"x": 3})))
        assert answer_of(await get_task(nobody, card, mine.id))["echo"] == {"x": 3}
        with pytest.raises(TaskNotFoundError):
            await get_task(alice, card, mine.id)

        # 1.0's method names need the A2A-Version header: without it a request is 0.3's
        bare = {"jsonrpc": "2.0", "id": 1, "method": "GetTask", "params": {"id": task.id}}
        refused = (await alice.post(url, json=bare, headers={"A2A-Version": ""})).json()
        assert "version" in refused["error"]["message"].lower(), refused


def exporter(url: str, gate: asyncio.Event) -> Agent:
    """An async-mode agent: its calls are jobs, done at ``gate``."""
    agent = Agent(
        {
            "agent_id": "export-1",
            "agent_name": "exporter",
            "version": "1.0.0",
            "mode": "async",
            "health": {"interval_sec": 0.5, "timeout_sec": 0.3},
            "capabilities": [capability("bulk_export")],
        },
        servers=url,
    )

    @agent.capability("bulk_export")
    async def export(req: dict[str, Any]) -> dict[str, Any]:
        await gate.wait()
        return {"file": f"export-{req['rows']}.csv"}

    return agent


async def test_a_job_is_read_by_its_task_id_and_only_by_its_caller(
    nats_server: NatsServer, client: ReachClient
) -> None:
    gate = asyncio.Event()
    async with (
        exporter(nats_server.url, gate),
        live(A2AGateway(client)) as base,
        caller("alice") as alice,
        caller("bob") as bob,
    ):
        await wait_routable(client, "bulk_export", 1)
        card = await card_at(alice, base, "exporter")
        request = message(new_data_part({"rows": 5}))
        request.configuration.CopyFrom(SendMessageConfiguration(return_immediately=True))
        task = await send(alice, card, request)
        assert task.status.state == TaskState.TASK_STATE_SUBMITTED
        assert is_random_id(task.id), task.id
        job_id = str(task.metadata["job_id"])
        assert job_id.split(".")[1] == "export-1"
        gate.set()
        deadline = time.monotonic() + READY_TIMEOUT
        while (got := await get_task(alice, card, task.id)).status.state in (
            TaskState.TASK_STATE_SUBMITTED,
            TaskState.TASK_STATE_WORKING,
        ):
            assert time.monotonic() < deadline, "the job did not finish"
            await asyncio.sleep(0.1)
        assert answer_of(got) == {"file": "export-5.csv"}
        assert (got.id, got.context_id) == (task.id, task.context_id)
        assert list(got.history) == list(task.history)
        # the job's own id was never handed out as a task id: not found, for anyone
        for someone in (alice, bob):
            with pytest.raises(TaskNotFoundError):
                await get_task(someone, card, job_id)
        with pytest.raises(TaskNotFoundError):
            await get_task(bob, card, task.id)


async def test_the_task_store_stays_within_its_bounds_however_large_the_messages(
    nats_server: NatsServer, client: ReachClient
) -> None:
    clock = ManualClock()
    store = TaskStore(max_bytes=256 * 1024, max_task_bytes=32 * 1024, ttl=600, clock=clock)
    agent, _ = make_agent(nats_server.url, "a-1", capability("echo"))
    async with agent, live(A2AGateway(client, tasks=store)) as base, caller("alice") as alice:
        await wait_routable(client, "echo", 1)
        card = await card_at(alice, base, "test")
        # the input is the small data part; the text after it is only the message's
        # history, which a task keeps for GetTask
        tasks = []
        for n in range(40):
            size = 2 * 1024 * 1024 if n % 10 == 9 else 20 * 1024
            request = message(new_data_part({"n": n}), new_text_part("x" * size))
            task = await send(alice, card, request)
            assert len(task.history[0].parts[1].text) == size  # the answer carries it all
            assert store.bytes <= store.max_bytes, (n, store.bytes)
            assert len(store) <= store.max_tasks
            tasks.append(task)
        # the oldest went to make room; the newest are kept, a large one without history
        with pytest.raises(TaskNotFoundError):
            await get_task(alice, card, tasks[0].id)
        large = await get_task(alice, card, tasks[39].id)
        assert answer_of(large)["echo"] == {"n": 39}
        assert list(large.history) == []
        assert list(large.metadata[NOT_KEPT_KEY]) == ["history"]
        small = await get_task(alice, card, tasks[38].id)
        assert small == tasks[38]

        # an hour on, with the store's time-to-live at ten minutes: all gone
        clock.advance(601)
        with pytest.raises(TaskNotFoundError):
            await get_task(alice, card, tasks[38].id)
        assert (len(store), store.bytes) == (0, 0)


def test_the_task_store_counts_drops_and_expires_what_it_keeps() -> None:
    clock = ManualClock()
    store = TaskStore(max_bytes=10_000, max_tasks=3, max_task_bytes=1_000, ttl=60, clock=clock)
    for n in range(5):
        store.put("alice", Task(id=f"t-{n}", context_id="c"))
        clock.advance(10)
    kept_ones = [store.get("alice", f"t-{n}") is not None for n in range(5)]
    assert kept_ones == [False, False, True, True, True]
    assert store.get("bob", "t-4") is None
    kept = store.bytes
    assert kept == sum(Task(id=f"t-{n}", context_id="c").ByteSize() + 5 for n in (2, 3, 4))
    assert store.drop("t-3")
    assert not store.drop("t-3")
    assert store.get("alice", "t-3") is None
    assert len(store) == 2
    clock.advance(40)  # t-2 was kept 60 s ago
    assert store.get("alice", "t-2") is None
    assert len(store) == 1
    # a task too large to keep whole: its history, then its artifacts and status message
    big = Task(id="big", context_id="c")
    big.history.append(Message(message_id="m", parts=[new_text_part("x" * 2_000)]))
    assert list(store.put("alice", big).metadata[NOT_KEPT_KEY]) == ["history"]
    assert len(big.history) == 1  # what was put is left as it was
    with pytest.raises(ConfigurationError, match="above its total"):
        TaskStore(max_bytes=10, max_task_bytes=11)


async def test_a_card_is_strict_a2a_1_0_by_default_and_0_3_for_a_0_3_reader(
    nats_server: NatsServer, client: ReachClient
) -> None:
    agent, _ = make_agent(nats_server.url, "a-1", capability("echo"))
    async with agent, live(A2AGateway(client)) as base, caller(None) as http:
        await wait_routable(client, "echo", 1)
        agent_url = f"{base}/agents/test"
        card_url = f"{agent_url}/.well-known/agent-card.json"

        # 1.0: only 1.0's fields (the SDK's parser without ignore_unknown_fields), with or
        # without the version header
        for headers in ({}, {"A2A-Version": "1.0"}):
            response = await http.get(card_url, headers=headers)
            served = response.json()
            card = ParseDict(served, AgentCard())
            assert [i.protocol_version for i in card.supported_interfaces] == ["1.0", "0.3"]
            assert {"url", "protocolVersion", "preferredTransport"}.isdisjoint(served)
            assert "securitySchemes" not in served  # a gateway without login
        assert response.headers["cache-control"] == "public, max-age=30"
        assert "A2A-Version" in response.headers["vary"]

        # 0.3: asked by the header, by A2A's request parameter, or by 0.3's older path
        legacy = []
        for url, headers in (
            (card_url, {"A2A-Version": "0.3"}),
            (f"{card_url}?A2A-Version=0.3", {}),
            (f"{agent_url}/.well-known/agent.json", {}),
        ):
            old = (await http.get(url, headers=headers)).json()
            parsed = v03.AgentCard.model_validate(old)
            assert parsed.model_dump(mode="json", exclude_none=True) == old  # nothing unknown
            assert (parsed.url, parsed.protocol_version) == (agent_url, "0.3")
            assert parsed.preferred_transport == "JSONRPC"
            assert "supportedInterfaces" not in old
            legacy.append(old)
        assert legacy[0] == legacy[1] == legacy[2]
        # a 1.0 client on the older path gets the 1.0 card
        newer = await http.get(
            f"{agent_url}/.well-known/agent.json", headers={"A2A-Version": "1.0"}
        )
        assert newer.json() == served

        # a 0.3 client that read the 0.3 card speaks 0.3 to the agent, end to end
        core = to_core_agent_card(v03.AgentCard.model_validate(legacy[0]))
        task = await send(http, core, message(new_data_part({"x": 1})))
        assert answer_of(task) == {"by": "a-1", "echo": {"x": 1}}
        assert answer_of(await get_task(http, core, task.id)) == {"by": "a-1", "echo": {"x": 1}}

        # revalidation: the same ETag answers 304 with no body; the two forms differ
        etag = response.headers["etag"]
        again = await http.get(card_url, headers={"If-None-Match": etag})
        assert (again.status_code, again.content, again.headers["etag"]) == (304, b"", etag)
        assert again.headers["cache-control"] == "public, max-age=30"
        changed = await http.get(card_url, headers={"If-None-Match": '"something-else"'})
        assert changed.status_code == 200
        old_etag = (await http.get(card_url, headers={"A2A-Version": "0.3"})).headers["etag"]
        assert old_etag != etag
        stale = await http.get(card_url, headers={"A2A-Version": "0.3", "If-None-Match": etag})
        assert stale.status_code == 200

        # no such agent: 404, in either form
        assert (await http.get(f"{base}/agents/nobody/.well-known/agent.json")).status_code == 404

        # a gateway with login: its cards say how to log in, at its own token endpoint
        async with live(A2AGateway(client, login=True)) as other:
            served = (await http.get(f"{other}/agents/test/.well-known/agent-card.json")).json()
            card = ParseDict(served, AgentCard())
            schemes = card.security_schemes
            flow = schemes["oauth2"].oauth2_security_scheme.flows.client_credentials
            assert flow.token_url == f"{other}/oauth/token"


def test_a_card_describes_the_login_when_the_gateway_has_one() -> None:
    assert security_of("http://gw:8080", False) == ({}, [])
    card = card_for(
        "maker", [], "http://gw:8080/agents/maker", security_of("http://gw:8080/", True)
    )
    served = card_document(card, "1.0")
    strict = ParseDict(served, AgentCard())
    flow = strict.security_schemes["oauth2"].oauth2_security_scheme.flows.client_credentials
    assert flow.token_url == "http://gw:8080/oauth/token"
    assert strict.security_schemes["bearer"].http_auth_security_scheme.scheme == "Bearer"
    assert [list(r.schemes) for r in strict.security_requirements] == [["oauth2"], ["bearer"]]
    # 0.3's names: securitySchemes with a type each, and security
    old = card_document(card, "0.3")
    parsed = v03.AgentCard.model_validate(old)
    assert parsed.model_dump(mode="json", exclude_none=True) == old
    assert old["security"] == [{"oauth2": []}, {"bearer": []}]
    assert old["securitySchemes"]["oauth2"]["type"] == "oauth2"
    assert old["securitySchemes"]["oauth2"]["flows"]["clientCredentials"]["tokenUrl"] == (
        "http://gw:8080/oauth/token"
    )
    assert old["securitySchemes"]["bearer"] == {
        "type": "http",
        "scheme": "Bearer",
        "description": "the token of the gateway's login",
    }
