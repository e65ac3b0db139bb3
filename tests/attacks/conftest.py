"""A fabric started by `reach up`, and the attacker's tools: plain nats-py, no SDK helpers.

Each module gets its own `reach up` (own free port, own store); a test that changes the
fabric for good (revokes the admin, rotates keys) should start its own with ``up_fabric``.
Attack code talks to NATS with nats-py directly, as an outsider holding a credential
would, so a refusal proven here does not depend on the SDK behaving.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import select
import signal
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import nats
import nats.errors
import nats.js.errors
import pytest
from nats.aio.client import Client as NatsClient

from reach.agent.agent import Agent
from reach.fabric.embedded import free_port

from ..calls_helpers import Behaviour, capability, make_agent
from ..cli_helpers import REACH, run_reach

#: seconds a `reach up` may take to print its first line
READY = 60.0


@dataclass
class UpFabric:
    """A running `reach up`: its URL, its store, and the credentials files made for a test."""

    url: str
    store: Path
    proc: subprocess.Popen[bytes]
    workdir: Path
    creds: dict[str, Path] = field(default_factory=dict)
    #: where `reach up`'s stderr (its log) goes, to be read by tests that bound it
    stderr: Path | None = None

    @property
    def admin(self) -> Path:
        return self.store / "admin.creds"

    async def add_client(
        self,
        client_id: str | None = None,
        *,
        level: int = 1,
        agent_id: str | None = None,
        caps: tuple[str, ...] = (),
        roles: tuple[str, ...] = (),
    ) -> tuple[str, Path]:
        """A new credential made with `reach creds add` by the admin; (client id, file)."""
        client_id = client_id or f"c-{uuid.uuid4().hex[:10]}"
        out = self.workdir / f"{client_id}.creds"
        args = ["creds", "add", client_id, "--level", str(level), "--out", str(out)]
        if agent_id is not None:
            args += ["--agent-id", agent_id]
        for cap in caps:
            args += ["--cap", cap]
        for role in roles:
            args += ["--role", role]
        code, stdout, stderr = await run_reach(
            *args, "--servers", self.url, "--creds", str(self.admin)
        )
        assert code == 0, stdout + stderr
        self.creds[client_id] = out
        return client_id, out

    async def add_agent(
        self, agent_id: str, capability_name: str, *, level: int = 1
    ) -> tuple[Agent, Behaviour, Path]:
        """A test agent serving ``capability_name`` (at security ``level``) with a
        credential of its own bound to it, of that level (an agent serves nothing above
        its clearance); (agent, its behaviour, its credentials file)."""
        _, creds = await self.add_client(level=level, agent_id=agent_id, caps=(capability_name,))
        agent, served = make_agent(self.url, agent_id, capability(capability_name, level=level))
        agent.credentials = creds
        return agent, served, creds

    def secret_of(self, path: Path) -> tuple[str, str]:
        data = json.loads(path.read_text())
        return str(data["client_id"]), str(data["secret"])


def start_up(workdir: Path, *extra: str) -> UpFabric:
    """Start `reach up` on a free port with its store under ``workdir``; wait until ready."""
    port = free_port()
    store = workdir / "store"
    stderr = workdir / "up.stderr"
    with stderr.open("ab") as log:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(
            [REACH, "up", "--port", str(port), "--store", str(store), *extra],
            stdout=subprocess.PIPE,
            stderr=log,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], READY)
    line = proc.stdout.readline() if ready else b""
    if not line.startswith(b"Agent-Reach up"):
        proc.kill()
        proc.wait()
        raise AssertionError(f"reach up did not start: {line!r} {stderr.read_text()[-2000:]}")
    return UpFabric(
        url=f"nats://127.0.0.1:{port}", store=store, proc=proc, workdir=workdir, stderr=stderr
    )


def stop_up(fabric: UpFabric) -> None:
    fabric.proc.send_signal(signal.SIGTERM)
    try:
        fabric.proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        fabric.proc.kill()
        fabric.proc.communicate()


@pytest.fixture(scope="module")
def up_fabric(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpFabric]:
    """One `reach up` for the module."""
    fabric = start_up(tmp_path_factory.mktemp("up"))
    try:
        yield fabric
    finally:
        stop_up(fabric)


async def attacker(
    fabric: UpFabric, creds: Path | None, *, inbox: str | None = None, **kwargs: Any
) -> NatsClient:
    """A nats-py connection logged in with ``creds`` (None: anonymous), the way any NATS
    client would: user = client id, password = secret, inbox under ``_INBOX.<client_id>``
    unless ``inbox`` says otherwise. No reconnects: a refusal must show at once."""
    options: dict[str, Any] = {
        "servers": [fabric.url],
        "allow_reconnect": False,
        "connect_timeout": 5,
        "max_reconnect_attempts": 0,
        **kwargs,
    }
    if creds is not None:
        client_id, secret = fabric.secret_of(creds)
        options |= {"user": client_id, "password": secret}
        options["inbox_prefix"] = inbox or f"_INBOX.{client_id}"
    return await nats.connect(**options)


class Refusals:
    """The permission violations the server reported to one attacker connection."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.seen = asyncio.Event()

    async def on_error(self, exc: Exception) -> None:
        """nats-py error callback (error_cb=refusals.on_error)."""
        self.errors.append(str(exc))
        self.seen.set()

    def about(self, subject: str) -> bool:
        # nats-py reports the server's error in lower case
        return any(subject.lower() in error.lower() for error in self.errors)

    async def wait_for(self, subject: str, timeout: float = 5.0) -> None:
        async def until() -> None:
            while not self.about(subject):
                self.seen.clear()
                await self.seen.wait()

        try:
            await asyncio.wait_for(until(), timeout)
        except TimeoutError:
            raise AssertionError(f"{subject} was not refused; refusals: {self.errors}") from None


@pytest.fixture
def refusals() -> Refusals:
    return Refusals()


async def fabric_state(fabric: UpFabric) -> dict[str, Any]:
    """What an attack must leave as it was, read with the admin's credentials: every key
    (and its revision) of the credential and key buckets, and the audit stream's size."""
    admin = await attacker(fabric, fabric.admin)
    try:
        js = admin.jetstream()
        state: dict[str, Any] = {}
        for bucket in ("REACH_CREDENTIALS", "REACH_KEYS"):
            kv = await js.key_value(bucket)
            # the keys as the stream's leader counts them (nats-py's kv.keys() reads them
            # with a fresh consumer, which can call itself done before the first key)
            prefix = f"$KV.{bucket}."
            info = await js.stream_info(f"KV_{bucket}", subjects_filter=f"{prefix}>")
            keys: dict[str, int] = {}
            for subject in sorted(info.state.subjects or {}):
                key = subject.removeprefix(prefix)
                try:
                    entry = await kv.get(key)
                except nats.js.errors.KeyNotFoundError:  # deleted: its marker is kept
                    keys[key] = -1
                    continue
                keys[key] = entry.revision or 0
            state[bucket] = keys
        info = await js.stream_info("REACH_AUDIT")
        state["REACH_AUDIT"] = (info.config.subjects, info.config.deny_delete)
        return state
    finally:
        await admin.close()


#: the streams whose configs an attack must leave as they were
STREAMS = ("KV_REACH_REGISTRY", "KV_REACH_KEYS", "KV_REACH_CREDENTIALS", "REACH_AUDIT")


async def stream_configs(fabric: UpFabric) -> dict[str, Any]:
    """Each stream's config and number of consumers, read by the admin."""
    admin = await attacker(fabric, fabric.admin)
    try:
        js = admin.jetstream()
        out: dict[str, Any] = {}
        for stream in STREAMS:
            info = await js.stream_info(stream)
            out[stream] = (info.config.as_dict(), info.state.consumer_count)
        return out
    finally:
        await admin.close()


# -- the wire protocol, as an attacker reads it in schemas/README.md -----------------------


def request_bytes(body: bytes | dict[str, Any], token: str | None = None, **meta: Any) -> bytes:
    """A request envelope: ``{"v": 1, "id", "b", "tok"?, ...}`` (``meta``: ``dl``, ``at``…)."""
    packed = body if isinstance(body, bytes) else msgpack.packb(body)
    env: dict[str, Any] = {"v": 1, "id": secrets.token_hex(8), "b": packed, **meta}
    if token is not None:
        env["tok"] = token
    data: bytes = msgpack.packb(env)
    return data


async def ask(nc: NatsClient, subject: str, data: bytes, timeout: float = 5.0) -> dict[str, Any]:
    """Send ``data`` and return the reply envelope as a map, replies on a call-reply subject
    of the client's inbox (``<inbox prefix>.r.<base>.<token>``) as the protocol says."""
    inbox = f"{nc._inbox_prefix.decode()}.r.{secrets.token_hex(8)}"
    sub = await nc.subscribe(inbox + ".*", max_msgs=1)
    try:
        await nc.publish(subject, data, reply=inbox + "." + secrets.token_hex(8))
        msg = await sub.next_msg(timeout=timeout)
    finally:
        with contextlib.suppress(nats.errors.Error):
            await sub.unsubscribe()
    reply: dict[str, Any] = msgpack.unpackb(msg.data)
    return reply


def code_of(reply: dict[str, Any]) -> str:
    """``ok``, or the error code of a reply envelope."""
    return "ok" if reply.get("ok") else str(reply.get("err", {}).get("code", "?"))


async def fabric_token(nc: NatsClient, client_id: str, secret: str) -> str:
    """A login at the issuer: client id + secret for a fabric token."""
    body = {"client_id": client_id, "secret": secret}
    reply = await ask(nc, "reach.v1.auth.token", request_bytes(body))
    assert reply.get("ok"), reply
    return str(msgpack.unpackb(reply["b"])["token"])


async def call_token(
    nc: NatsClient, client_id: str, token: str, capability: str, instance: str
) -> dict[str, Any]:
    """An exchange at the issuer: the fabric token for a call token of one instance (the
    reply envelope: a refusal is an answer too)."""
    body = {"client_id": client_id, "token": token, "audience": capability, "instance": instance}
    return await ask(nc, "reach.v1.auth.token", request_bytes(body))


async def login_for_calls(
    fabric: UpFabric, creds: Path, capability: str, instance: str
) -> tuple[NatsClient, str]:
    """An attacker's connection with ``creds`` and the call token it gets for ``instance``
    by logging in and exchanging, as any client may."""
    client_id, secret = fabric.secret_of(creds)
    nc = await attacker(fabric, creds)
    try:
        token = await fabric_token(nc, client_id, secret)
        reply = await call_token(nc, client_id, token, capability, instance)
        assert reply.get("ok"), reply
    except BaseException:
        await nc.close()
        raise
    return nc, str(msgpack.unpackb(reply["b"])["token"])


async def spy_on(
    fabric: UpFabric, creds: Path, subject: str
) -> tuple[NatsClient, asyncio.Queue[bytes]]:
    """A second connection of an agent's credential, keeping the bytes of every message
    on ``subject`` (one of its own): what a rogue instance sees of the calls it is sent."""
    nc = await attacker(fabric, creds)
    captured: asyncio.Queue[bytes] = asyncio.Queue()

    async def keep(msg: Any) -> None:
        captured.put_nowait(msg.data)

    await nc.subscribe(subject, cb=keep)
    await nc.flush()
    return nc, captured


async def raw_login(port: int, user: str, password: str) -> bytes:
    """A login over a bare socket, as a flood would send it: the server's first answer
    (``-ERR 'Authorization Violation'`` when refused)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        await reader.readline()  # INFO
        login = json.dumps({"user": user, "pass": password, "verbose": False})
        writer.write(f"CONNECT {login}\r\nPING\r\n".encode())
        await writer.drain()
        return await asyncio.wait_for(reader.readline(), 10)
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
