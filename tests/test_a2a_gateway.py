"""`reach a2a` against a fabric `reach up` started (tokens on), used through the A2A SDK's
own client: an Agent Card per agent whose skills are its capabilities, `SendMessage`
(and 0.3's `message/send`) answered by a fabric call, its errors naming the layer,
`GetTask` onto async-mode jobs, and an index that follows the registry."""

from __future__ import annotations

import asyncio
import contextlib
import math
import re
import signal
import subprocess
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from a2a.client import (
    A2ACardResolver,
    AgentCardResolutionError,
    Client,
    ClientConfig,
    ClientFactory,
)
from a2a.client.auth.credentials import CredentialService
from a2a.client.auth.interceptor import AuthInterceptor
from a2a.helpers import get_data_parts, get_message_text, new_data_part, new_text_part
from a2a.types import (
    AgentCard,
    GetExtendedAgentCardRequest,
    GetTaskRequest,
    InvalidParamsError,
    Message,
    Part,
    Role,
    SendMessageConfiguration,
    SendMessageRequest,
    Task,
    TaskState,
)

from reach.agent.agent import Agent
from reach.agent.jobs import JobRecord
from reach.caller.result import CallResult
from reach.errors import (
    AuthenticationFailed,
    BusinessError,
    CircuitOpen,
    ContractError,
    InternalError,
    NoResponders,
    NotAuthorized,
    NotFound,
    ReachError,
)
from reach.gateways.a2a_cards import SCHEMAS_EXTENSION, agents_of, card_for, runs_as_job
from reach.gateways.a2a_tasks import (
    choose_skill,
    completed_task,
    failed_task,
    job_task,
    payload_of,
)
from reach.gateways.failures import layer_of
from reach.security.credentials import CredentialsFile
from reach.wire.models import Instance, parse_manifest

from .cli_helpers import CLEAN_ENV, REACH, reach_cli
from .up_helpers import Secured, secured_agent

#: an end-to-end run of whole programs: `make test-long` (CI runs it after `make test`)
pytestmark = pytest.mark.long

#: how long the gateway may take to say it listens, to exit once told to, and the
#: registry's news to reach its index
READY_TIMEOUT = 30.0
EXIT_TIMEOUT = 20.0
FOLLOW_TIMEOUT = 10.0

HEALTH = {"interval_sec": 0.5, "timeout_sec": 0.3, "failures_before_unhealthy": 2}
REPORT_INPUT = {
    "type": "object",
    "properties": {"industry": {"type": "string"}, "time_range": {"type": "string"}},
    "required": ["industry", "time_range"],
    "examples": [{"industry": "ev", "time_range": "2025"}],
}


async def add_creds(fabric: Secured, tmp_path: Path, client_id: str, *options: str) -> Path:
    """Level-2 credentials made by the fabric's admin (`reach creds add`)."""
    out = tmp_path / f"{client_id}.creds"
    code, text, err = await reach_cli(
        "creds", "add", client_id, "--level", "2", *options,
        "--out", str(out), "--servers", fabric.url, "--creds", str(fabric.admin),
    )  # fmt: skip
    assert code == 0, text + err
    return out


def reporter(fabric: Secured, creds: Path) -> Agent:
    """rep-1 ("reporter"): a report with an input contract, a summary, and a capability
    above the gateway's clearance."""
    agent = Agent(
        {
            "agent_id": "rep-1",
            "agent_name": "reporter",
            "version": "2.1.0",
            "health": HEALTH,
            "capabilities": [
                {
                    "name": "report",
                    "description": "A report on an industry.",
                    "input_schema": REPORT_INPUT,
                    "tags": ["report"],
                    "security_level": 2,
                },
                {"name": "summary", "security_level": 1},
                {"name": "secret", "security_level": 3},
            ],
        },
        servers=fabric.url,
        credentials=creds,
    )

    @agent.capability("report")
    async def report(req: dict[str, Any]) -> dict[str, Any]:
        return {"industry": req["industry"], "pages": 12}

    @agent.capability("summary")
    async def summary(req: Any) -> str:
        return "short"

    @agent.capability("secret")
    async def secret(req: Any) -> str:
        return "never seen"

    return agent


def exporter(fabric: Secured, creds: Path, gate: asyncio.Event) -> Agent:
    """export-1 ("exporter"), an async-mode agent: its calls are jobs, done at ``gate``."""
    agent = Agent(
        {
            "agent_id": "export-1",
            "agent_name": "exporter",
            "version": "1.0.0",
            "mode": "async",
            "health": HEALTH,
            "capabilities": [{"name": "bulk_export", "security_level": 2, "latency_sla_ms": 200}],
        },
        servers=fabric.url,
        credentials=creds,
    )

    @agent.capability("bulk_export")
    async def export(req: dict[str, Any]) -> dict[str, Any]:
        await gate.wait()
        return {"file": f"export-{req['rows']}.csv"}

    return agent


@contextlib.asynccontextmanager
async def gateway(fabric: Secured, creds: Path | None = None) -> AsyncIterator[str]:
    """`reach a2a` on a free loopback port, with a level-4 credential of the gateway role
    unless told others; its base URL. It must exit cleanly when told to."""
    if creds is None:
        creds = fabric.admin.parent.parent / "gw-a2a.creds"
        if not creds.exists():
            creds = await add_creds(
                fabric, creds.parent, "gw-a2a", "--level", "4", "--role", "gateway"
            )
    proc = subprocess.Popen(  # noqa: ASYNC220 - fork+exec, returns at once
        [REACH, "a2a", "--port", "0", "--servers", fabric.url, "--creds", str(creds)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**CLEAN_ENV, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), READY_TIMEOUT)
        found = re.search(r"on (http://\S+/) ", line.decode())
        assert found, line
        yield found.group(1).rstrip("/")
        proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.wait_for(asyncio.to_thread(proc.communicate), EXIT_TIMEOUT)
        assert proc.returncode == 0, err.decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=EXIT_TIMEOUT)


def message(*parts: Part, **metadata: str) -> SendMessageRequest:
    sent = Message(role=Role.ROLE_USER, message_id=uuid.uuid4().hex, parts=list(parts))
    sent.metadata.update(metadata)
    return SendMessageRequest(message=sent)


async def send(client: Client, request: SendMessageRequest) -> Task:
    """The task a non-streaming `SendMessage` answers with."""
    answers = [answer async for answer in client.send_message(request)]
    assert len(answers) == 1, answers
    assert answers[0].HasField("task"), answers
    return answers[0].task


def answer_of(task: Task) -> Any:
    assert task.status.state == TaskState.TASK_STATE_COMPLETED, task
    (artifact,) = task.artifacts
    (value,) = get_data_parts(artifact.parts)
    return value


def error_of(task: Task) -> tuple[str, dict[str, Any]]:
    """A failed task's status text and error data."""
    (data,) = get_data_parts(task.status.message.parts)
    return get_message_text(task.status.message), data


class Bearer(CredentialService):
    """The access token a caller got from the gateway's token endpoint, for every scheme
    the card names (the SDK's AuthInterceptor puts it in ``Authorization``)."""

    def __init__(self, token: str) -> None:
        self.token = token

    async def get_credentials(self, security_scheme_name: str, context: Any) -> str | None:
        return self.token


async def access_token(http: httpx.AsyncClient, base: str, creds: Path) -> str:
    """Log in at the gateway with an Agent-Reach credential (OAuth client credentials, at
    the token endpoint its metadata names); the access token."""
    server = (await http.get(f"{base}/.well-known/oauth-authorization-server")).json()
    data = CredentialsFile.read(creds)
    answer = await http.post(
        server["token_endpoint"],
        data={"grant_type": "client_credentials"},
        auth=(data.client_id, data.secret),
    )
    answer.raise_for_status()
    return str(answer.json()["access_token"])


async def login(http: httpx.AsyncClient, base: str, creds: Path) -> list[AuthInterceptor]:
    """The SDK's interceptors that carry the access token of ``creds``' login."""
    return [AuthInterceptor(Bearer(await access_token(http, base, creds)))]


def legacy_client(
    factory: ClientFactory, card: AgentCard, auth: list[AuthInterceptor] | None = None
) -> Client:
    """The SDK's client of A2A 0.3 (``message/send``, ``tasks/get``) for ``card``'s agent."""
    legacy = AgentCard()
    legacy.CopyFrom(card)
    (interface,) = [i for i in card.supported_interfaces if i.protocol_version == "0.3"]
    del legacy.supported_interfaces[:]
    legacy.supported_interfaces.append(interface)
    return factory.create(legacy, interceptors=auth)


async def index(http: httpx.AsyncClient, base: str) -> dict[str, dict[str, Any]]:
    response = await http.get(f"{base}/")
    response.raise_for_status()
    return {entry["name"]: entry for entry in response.json()["agents"]}


async def card_of(http: httpx.AsyncClient, url: str, token: str | None = None) -> AgentCard:
    """An agent's card, as whom ``token`` logged in sees it (anonymous without one)."""
    headers = {"authorization": f"Bearer {token}"} if token else {}
    return await A2ACardResolver(http, url).get_agent_card(http_kwargs={"headers": headers})


async def test_each_agent_has_a_card_of_its_capabilities_and_a_message_is_a_fabric_call(
    secured: Secured, tmp_path: Path
) -> None:
    caps = ("--cap", "report", "--cap", "summary", "--cap", "secret")
    # its secret capability is at level 3: it serves with a credential of that clearance
    rep_creds = await add_creds(
        secured, tmp_path, "rep-1", "--level", "3", "--agent-id", "rep-1", *caps
    )
    async with (
        secured_agent(secured),
        reporter(secured, rep_creds) as rep,
        gateway(secured) as base,
        httpx.AsyncClient(timeout=10) as http,
    ):
        agents = await index(http, base)
        assert set(agents) == {"test", "reporter"}
        # not logged in: the public skills (level 1), and word of an extended card
        public = await card_of(http, agents["reporter"]["url"])
        assert [s.id for s in public.skills] == ["summary"]
        assert public.capabilities.extended_agent_card
        # logged in at level 4: every skill
        admin = await access_token(http, base, secured.admin)
        cards = {name: await card_of(http, e["url"], admin) for name, e in agents.items()}
        assert [s.id for s in cards["test"].skills] == ["echo"]
        assert [s.id for s in cards["reporter"].skills] == ["report", "secret", "summary"]
        report = cards["reporter"].skills[0]
        assert report.description.startswith("A report on an industry.")
        assert list(report.examples) == ['{"industry":"ev","time_range":"2025"}']
        assert cards["reporter"].version == "2.1.0"
        # the contracts, in a card extension, with their numbers as they were written
        served = (
            await http.get(
                agents["reporter"]["card_url"], headers={"authorization": f"Bearer {admin}"}
            )
        ).json()
        (contracts,) = served["capabilities"]["extensions"]
        assert contracts["params"]["report"]["input_schema"] == REPORT_INPUT
        assert repr(contracts["params"]["secret"]["security_level"]) == "3"

        factory = ClientFactory(ClientConfig(streaming=False, httpx_client=http))
        # the watcher (level 2) logs in: its calls are its own, at its clearance
        auth = await login(http, base, secured.watcher)
        echo = factory.create(cards["test"], interceptors=auth)
        task = await send(echo, message(new_data_part({"x": 1})))
        assert answer_of(task) == {"by": "a-1", "echo": {"x": 1}}
        assert await echo.get_task(GetTaskRequest(id=task.id)) == task  # its call's task

        reports = factory.create(cards["reporter"], interceptors=auth)
        # the extended card: the skills the watcher's level (2) may call
        extended = await reports.get_extended_agent_card(GetExtendedAgentCardRequest())
        assert [s.id for s in extended.skills] == ["report", "summary"]
        good = new_text_part('{"industry": "ev", "time_range": "2025"}')
        assert answer_of(await send(reports, message(good, skill="report"))) == {
            "industry": "ev",
            "pages": 12,
        }
        # a contract-breaking input: the call fails, naming the contract and the field
        failed = await send(reports, message(new_data_part({"industry": "ev"}), skill="report"))
        assert failed.status.state == TaskState.TASK_STATE_FAILED
        text, data = error_of(failed)
        assert text.startswith("contract error calling report (ContractError)"), text
        assert data["layer"] == "contract"
        assert "time_range" in data["message"]
        # above the caller's clearance: the authorization layer says so
        denied = await send(reports, message(new_data_part({}), skill="secret"))
        assert error_of(denied)[1]["layer"] == "authorization"
        # several skills and none named: A2A's invalid-params error lists them
        with pytest.raises(InvalidParamsError, match="report, secret, summary"):
            await send(reports, message(new_data_part({})))

        # 0.3's method names (message/send) on the same endpoint, by the SDK's 0.3 client
        old = legacy_client(factory, cards["test"], auth)
        assert answer_of(await send(old, message(new_data_part("hi")))) == {
            "by": "a-1",
            "echo": "hi",
        }

        # a second gateway on the same port says why it cannot start
        port = base.rsplit(":", 1)[1]
        creds = ("--servers", secured.url, "--creds", str(secured.watcher))
        code, _, err = await reach_cli("a2a", "--port", port, "--no-login", *creds)
        assert code == 2, err
        assert f"cannot listen on 127.0.0.1:{port}" in err

        # an agent that stops leaves the index, and its card goes
        await rep.stop()
        deadline = time.monotonic() + FOLLOW_TIMEOUT
        while "reporter" in await index(http, base):
            assert time.monotonic() < deadline, "reporter still listed after it stopped"
            await asyncio.sleep(0.1)
        with pytest.raises(AgentCardResolutionError) as gone:
            await card_of(http, agents["reporter"]["url"])
        assert gone.value.status_code == 404


async def test_a_message_to_an_async_mode_capability_is_a_job_read_with_get_task(
    secured: Secured, tmp_path: Path
) -> None:
    # an async-mode agent, and a gateway that reads its jobs' records: the jobs role
    jobs = ("--role", "jobs")
    agent_id = ("--agent-id", "export-1", "--cap", "bulk_export")
    creds = await add_creds(secured, tmp_path, "export-1", *agent_id, *jobs)
    gw_creds = await add_creds(secured, tmp_path, "gw", *jobs, "--role", "gateway")
    gate = asyncio.Event()
    async with (
        exporter(secured, creds, gate),
        gateway(secured, gw_creds) as base,
        httpx.AsyncClient(timeout=10) as http,
    ):
        card = await card_of(http, (await index(http, base))["exporter"]["url"])
        factory = ClientFactory(ClientConfig(streaming=False, httpx_client=http))
        auth = await login(http, base, secured.watcher)
        client = factory.create(card, interceptors=auth)
        request = message(new_data_part({"rows": 5}))
        request.configuration.CopyFrom(SendMessageConfiguration(return_immediately=True))
        task = await send(client, request)
        # the job's id is in the task's metadata, and it is not done yet
        assert task.status.state == TaskState.TASK_STATE_SUBMITTED, task
        assert task.metadata["job_id"].split(".")[:2] == ["gw", "export-1"], task
        gate.set()
        deadline = time.monotonic() + FOLLOW_TIMEOUT
        while (got := await client.get_task(GetTaskRequest(id=task.id))).status.state in (
            TaskState.TASK_STATE_SUBMITTED,
            TaskState.TASK_STATE_WORKING,
        ):
            assert time.monotonic() < deadline, "the job did not finish"
            await asyncio.sleep(0.1)
        assert answer_of(got) == {"file": "export-5.csv"}
        assert got.context_id == task.context_id
        # and by 0.3's tasks/get
        old = legacy_client(factory, card, auth)
        assert answer_of(await old.get_task(GetTaskRequest(id=task.id))) == {"file": "export-5.csv"}
        # a message that waits: the job's result at once (the gate is open)
        assert answer_of(await send(client, message(new_data_part({"rows": 7})))) == {
            "file": "export-7.csv"
        }

        # a gateway whose credentials lack the jobs role: the job's call fails, saying why
        async with gateway(secured) as other:
            card = await card_of(http, (await index(http, other))["exporter"]["url"])
            other_auth = await login(http, other, secured.watcher)
            client = ClientFactory(ClientConfig(streaming=False, httpx_client=http)).create(
                card, interceptors=other_auth
            )
            text, data = error_of(await send(client, message(new_data_part({"rows": 1}))))
            assert data["layer"] == "authorization", text
            assert "REACH_JOBS" in text


# -- what the gateway makes of cards, messages, results and errors (no fabric) ----------


def instance(agent_id: str, version: str, *caps: dict[str, Any], mode: str = "sync") -> Instance:
    manifest = parse_manifest(
        {
            "agent_id": agent_id,
            "agent_name": "maker",
            "version": version,
            "mode": mode,
            "capabilities": list(caps),
        }
    )
    return Instance(manifest=manifest, instance_id=agent_id, registered_at=0, last_heartbeat_at=0)


def test_a_card_is_every_instance_of_a_name_the_newest_version_describing() -> None:
    old = instance("m-1", "1.9.0", {"name": "make", "description": "old"}, {"name": "mend"})
    new = instance(
        "m-2",
        "1.10.0",
        {"name": "make", "description": "new", "input_schema": {"examples": [{"n": 1}]}},
        mode="async",
    )
    ((name, found),) = agents_of([new, old]).items()
    card = card_for(name, found, "http://gw/agents/maker")
    assert card.version == "1.10.0"
    assert [(s.id, s.description.split(" (")[0]) for s in card.skills] == [
        ("make", "new"),
        ("mend", "The fabric capability mend."),
    ]
    assert list(card.skills[0].examples) == ['{"n":1}']
    assert runs_as_job(found, "make")
    assert not runs_as_job(found, "mend")
    assert [i.protocol_version for i in card.supported_interfaces] == ["1.0", "0.3"]
    (contracts,) = card.capabilities.extensions
    assert contracts.uri == SCHEMAS_EXTENSION
    assert contracts.params["make"]["input_schema"]["examples"][0]["n"] == 1


def test_a_message_names_its_skill_and_carries_its_input_as_data_or_json_text() -> None:
    skills = ["make", "mend"]
    by_metadata = message(new_data_part({"n": 5, "xs": [1.5, 2]}), skill="mend")
    assert choose_skill(by_metadata, skills) == "mend"
    payload = payload_of(by_metadata.message)
    assert payload == {"n": 5, "xs": [1.5, 2]}
    assert isinstance(payload["n"], int)  # a data part's doubles, whole: integers again
    assert payload_of(message(new_text_part("[1, 2]")).message) == [1, 2]
    with pytest.raises(InvalidParamsError, match="discovery: this agent has no skill 'melt'"):
        choose_skill(message(skill="melt"), skills)
    with pytest.raises(InvalidParamsError, match=r"contract: .* 'skill': make, mend"):
        choose_skill(message(), skills)
    assert choose_skill(message(), ["make"]) == "make"
    with pytest.raises(InvalidParamsError, match="serves no capability"):
        choose_skill(message(), [])
    with pytest.raises(InvalidParamsError, match="contract: the text part is not JSON"):
        payload_of(message(new_text_part("make it so")).message)
    with pytest.raises(InvalidParamsError, match="contract: the message holds no data part"):
        payload_of(message().message)


def test_a_result_json_cannot_hold_is_carried_as_json_can() -> None:
    value = {"raw": b"\x00\x01", "nan": math.nan, "big": 2**60, 7: ("a", "b")}
    result = CallResult(value, "make", "call-1", "m-1", 1, 2.5)
    task = completed_task("t-1", result, "ctx", [])
    assert (task.id, task.metadata["call_id"]) == ("t-1", "call-1")
    assert answer_of(task) == {"raw": "AAE=", "nan": None, "big": str(2**60), "7": ["a", "b"]}


@pytest.mark.parametrize(
    ("error", "layer", "state"),
    [
        (ContractError("no", path="industry"), "contract", TaskState.TASK_STATE_FAILED),
        (NotFound("nobody"), "discovery", TaskState.TASK_STATE_FAILED),
        (NoResponders("silent"), "routing", TaskState.TASK_STATE_FAILED),
        (CircuitOpen("m-1", 0.0), "breaker", TaskState.TASK_STATE_FAILED),
        (AuthenticationFailed("bad token"), "authentication", TaskState.TASK_STATE_FAILED),
        (
            NotAuthorized("low", level_required=3, level_held=2),
            "authorization",
            TaskState.TASK_STATE_FAILED,
        ),
        (BusinessError("no data", code="no_data"), "business", TaskState.TASK_STATE_REJECTED),
        (InternalError("boom"), "agent", TaskState.TASK_STATE_FAILED),
    ],
)
def test_a_failed_call_is_a_task_naming_the_layer(
    error: ReachError, layer: str, state: TaskState
) -> None:
    assert layer_of(error) == layer
    task = failed_task("t-1", "ctx", "make", error, [])
    assert task.status.state == state
    text, data = error_of(task)
    assert text.startswith(f"{layer} error calling make ({type(error).__name__}): ")
    assert data["layer"] == layer


def test_a_job_is_a_task_of_its_status() -> None:
    accepted = JobRecord(
        job_id="gw.m-1.abc", capability="make", agent_id="m-1", status="accepted", accepted_at=1
    )
    assert job_task("t-1", accepted, "ctx").status.state == TaskState.TASK_STATE_SUBMITTED
    running = accepted.model_copy(update={"status": "running"})
    assert job_task("t-1", running, "ctx").status.state == TaskState.TASK_STATE_WORKING
    done = accepted.model_copy(update={"status": "succeeded", "result": {"ok": True}})
    assert answer_of(job_task("t-1", done, "ctx")) == {"ok": True}
    failed = accepted.model_copy(
        update={"status": "failed", "error_kind": "business", "error_code": "x", "error": "no"}
    )
    task = job_task("t-1", failed, "ctx")
    assert (task.id, task.metadata["job_id"]) == ("t-1", "gw.m-1.abc")
    assert task.status.state == TaskState.TASK_STATE_REJECTED
    assert error_of(task)[1]["code"] == "x"
