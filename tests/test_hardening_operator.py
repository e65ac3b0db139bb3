"""Regressions found in review, on the operator's side: NATS permission refusals, the
``reach`` commands' output and option checks, and manifests with stray newlines."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from reach import subjects
from reach.agent import Agent
from reach.cli import main
from reach.client import ReachClient
from reach.embedded import free_port
from reach.errors import AuthError, ConfigurationError, NoResponders
from reach.models import parse_manifest
from reach.registry import Registrar
from reach.security.credentials import CredentialsFile
from reach.security.fabric import connect_as
from reach.testing import NatsServer
from reach.transport import Connection

from .calls_helpers import capability, make_agent, wait_routable
from .cli_helpers import REACH

#: the environment of a `reach` run that must not pick up the developer's fabric
CLEAN_ENV = {
    k: v for k, v in os.environ.items() if k not in ("REACH_URL", "REACH_CREDS", "COLUMNS")
}


async def reach_cli(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = 60
) -> tuple[int, str, str]:
    """Exit code, stdout and stderr of ``reach ARGS`` (piped, so not a terminal); killed
    if still running after ``timeout``."""
    proc = await asyncio.create_subprocess_exec(
        REACH,
        *args,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=CLEAN_ENV if env is None else env,
        cwd=cwd,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        pytest.fail(f"reach {' '.join(args)} still running after {timeout}s")
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


# -- 4. NATS permission refusals on a secured fabric -------------------------------------


@dataclass
class Secured:
    """A fabric `reach up` started (auth callout), with a caller's and an agent's
    credentials made by its admin."""

    url: str
    admin: Path
    watcher: Path
    agent: Path


@pytest.fixture
async def secured(tmp_path: Path) -> AsyncIterator[Secured]:
    port = free_port()
    store = tmp_path / "store"
    proc = subprocess.Popen(  # noqa: ASYNC220 - fork+exec, returns at once
        [REACH, "up", "--port", str(port), "--store", str(store)],
        stdout=subprocess.PIPE,
        env={**CLEAN_ENV, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 60)
        assert line.startswith(b"Agent-Reach up"), line
        url = f"nats://127.0.0.1:{port}"
        admin = store / "dev.creds"
        made = {}
        for name, extra in (
            ("watcher", ()),  # a caller: what an operator might wrongly use for a command
            ("agent-a", ("--agent-id", "a-1", "--cap", "echo")),
        ):
            made[name] = tmp_path / f"{name}.creds"
            code, out, err = await reach_cli(
                "creds", "add", name, "--level", "2", *extra, "--out", str(made[name]),
                "--servers", url, "--creds", str(admin),
            )  # fmt: skip
            assert code == 0, out + err
        yield Secured(url, admin, made["watcher"], made["agent-a"])
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)


def secured_agent(fabric: Secured) -> Agent:
    agent, _ = make_agent(fabric.url, "a-1", capability("echo", level=2))
    agent.credentials = fabric.agent
    return agent


async def test_a_refused_request_or_kv_write_is_permission_denied_not_a_timeout(
    secured: Secured,
) -> None:
    from reach.errors import PermissionDenied  # new with the fix

    async with secured_agent(secured):
        conn, _ = await connect_as([secured.url], name="watcher", credentials=secured.watcher)
        try:
            # a caller may not probe an agent: the server drops the request and says so
            with pytest.raises(PermissionDenied, match=r"reach\.v1\.probe\.a-1") as caught:
                await conn.request(subjects.probe("a-1"), b"", timeout=1.0)
            assert isinstance(caught.value, AuthError)
            assert "refused these credentials" in str(caught.value)
            # a subject it may publish to, where nobody listens: not blamed on the refusal
            with pytest.raises(NoResponders):
                await conn.request(subjects.capability("nobody_here"), b"", timeout=1.0)
            # it may read the registry, not write it
            registry = await conn.key_value(subjects.REGISTRY_BUCKET, create=False)
            assert await registry.get("agent.a-1") is not None
            with pytest.raises(PermissionDenied, match="KV put"):
                await registry.put("agent.forged-1", b"{}")
        finally:
            await conn.close()


async def test_a_refusal_ends_the_operation_at_once_not_at_its_timeout(
    secured: Secured,
) -> None:
    """nats-server reports a refused publish at once (an -ERR on the connection); a
    request, a stream read or a bucket opening waited for its own timeout before saying
    so (`reach agents` with a caller's credentials took 5 s). Each now ends as soon as the
    refusal arrives: well within deadlines far shorter than their timeouts."""
    from reach.errors import PermissionDenied

    async with secured_agent(secured):
        conn, _ = await connect_as([secured.url], name="watcher", credentials=secured.watcher)
        try:
            async with asyncio.timeout(10):  # the request's own timeout: 60 s
                with pytest.raises(PermissionDenied, match=r"reach\.v1\.probe\.a-1"):
                    await conn.request(subjects.probe("a-1"), b"", timeout=60.0)
            audit = await conn.stream(subjects.AUDIT_STREAM, create=False, check=False)
            async with asyncio.timeout(3):  # nats-py's JetStream API timeout: 5 s
                with pytest.raises(PermissionDenied, match="read REACH_AUDIT"):
                    async for _ in audit.read():
                        pass
            async with asyncio.timeout(3):
                with pytest.raises(PermissionDenied, match="open stream REACH_AUDIT"):
                    await conn.stream(subjects.AUDIT_STREAM, create=False)
            async with asyncio.timeout(3):  # no jobs role
                with pytest.raises(PermissionDenied, match="open KV bucket REACH_JOBS"):
                    await conn.key_value(subjects.JOBS_BUCKET, create=False)
            # the connection is as good as before: what it may do, it does
            registry = await conn.key_value(subjects.REGISTRY_BUCKET, create=False)
            assert await registry.get("agent.a-1") is not None
        finally:
            await conn.close()


async def test_agents_and_top_with_a_callers_credentials_still_list_the_agents(
    secured: Secured,
) -> None:
    """A caller may not read the audit stream: the list shows without observed p99 (and
    a note saying why) rather than the command failing after a timeout."""
    async with (
        secured_agent(secured),
        ReachClient(servers=secured.url, credentials=secured.admin) as admin,
    ):
        await wait_routable(admin, "echo", 1)
        as_watcher = ("--servers", secured.url, "--creds", str(secured.watcher))
        code, out, err = await reach_cli("agents", *as_watcher)
        assert code == 0, err
        (row,) = [line for line in out.splitlines() if "a-1" in line]
        assert "echo" in row
        assert "healthy" in row
        assert "note: no observed p99" in err
        assert "refused these credentials" in err
        code, out, err = await reach_cli("top", "--once", *as_watcher)
        assert code == 0, err
        assert "1 instance(s)" in out
        assert "calls not shown" in out
        assert [line for line in out.splitlines() if line.lstrip().startswith("a-1")]


# -- 5. identifiers with a trailing newline ----------------------------------------------

VALID = {
    "agent_id": "agent-1",
    "agent_name": "report",
    "version": "1.0.0",
    "name": "echo",
    "tag": "data-query",
}


def manifest_yaml(**values: str) -> str:
    """A manifest file; JSON strings are YAML double-quoted scalars ("\\n" a newline)."""
    v = {k: json.dumps(value) for k, value in {**VALID, **values}.items()}
    return (
        f"agent_id: {v['agent_id']}\n"
        f"agent_name: {v['agent_name']}\n"
        f"version: {v['version']}\n"
        "capabilities:\n"
        f"  - name: {v['name']}\n"
        f"    tags: [{v['tag']}]\n"
        "    security_level: 1\n"
    )


@pytest.mark.parametrize(
    ("field", "path"),
    [
        ("agent_id", "agent_id"),
        ("agent_name", "agent_name"),
        ("version", "version"),
        ("name", "capabilities[0].name"),
        ("tag", "capabilities[0].tags[0]"),
    ],
)
def test_validate_refuses_an_identifier_with_a_trailing_newline(
    tmp_path: Path, field: str, path: str
) -> None:
    good = tmp_path / "good.yaml"
    good.write_text(manifest_yaml(), encoding="utf-8")
    result = CliRunner().invoke(main, ["validate", str(good)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    bad = tmp_path / "bad.yaml"
    text = manifest_yaml(**{field: VALID[field] + "\n"})
    bad.write_text(text, encoding="utf-8")
    result = CliRunner().invoke(main, ["validate", str(bad)], catch_exceptions=False)
    assert result.exit_code == 1, result.output
    assert result.stdout.splitlines()[0].startswith(f"{path}: must be")
    assert result.stderr.endswith("invalid manifest, 1 problem\n")
    data = yaml.safe_load(text)
    cap = data["capabilities"][0]
    loaded = {**data, "name": cap["name"], "tag": cap["tags"][0]}
    assert loaded[field] == VALID[field] + "\n"  # the YAML escape is read as a newline
    with pytest.raises(ConfigurationError):
        parse_manifest(data)


# -- 6. `reach agents` piped -------------------------------------------------------------


async def test_agents_piped_prints_each_agent_on_one_line_however_wide(
    nats_server: NatsServer, client: ReachClient
) -> None:
    names = ("generate_industry_report", "summarise_quarterly_filings", "forecast_demand")
    agent, _ = make_agent(
        nats_server.url, "report-generator-eu-west-001", *(capability(n) for n in names)
    )
    async with agent:
        await wait_routable(client, names[0], 1)
        code, out, err = await reach_cli("agents", "--servers", nats_server.url)
    assert code == 0, err
    (row,) = [line for line in out.splitlines() if "report-generator-eu-west-001" in line]
    assert ", ".join(names) in row  # not wrapped onto the lines below
    assert "healthy" in row
    assert len(row.rstrip()) > 80
    assert len(out.strip().splitlines()) == 3  # header, rule, the one agent


# -- 7. `reach up --port` with a NATS to use ---------------------------------------------


def _listening(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(1.0)
        return sock.connect_ex(("127.0.0.1", port)) == 0


async def _has_registry(conn: Connection) -> bool:
    with contextlib.suppress(ConfigurationError):
        await conn.key_value(subjects.REGISTRY_BUCKET, create=False)
        return True
    return False


@pytest.mark.parametrize("how", ["REACH_URL", "--servers"])
async def test_up_with_a_port_and_a_nats_to_use_is_refused_before_starting_anything(
    nats_server: NatsServer, conn: Connection, tmp_path: Path, how: str
) -> None:
    port = free_port()
    args = ["up", "--port", str(port), "--store", str(tmp_path / "store")]
    env = dict(CLEAN_ENV)
    if how == "REACH_URL":
        env["REACH_URL"] = nats_server.url
    else:
        args += ["--servers", nats_server.url]
    code, _, err = await reach_cli(*args, env=env, cwd=tmp_path, timeout=20)
    assert code == 2, err
    assert "--port" in err
    assert how in err
    assert err.strip().count("\n") == 0
    # nothing started: no registrar on the NATS named, no NATS on the port, no store
    assert not await _has_registry(conn)
    assert not _listening(port)
    assert not (tmp_path / "store").exists()


# -- 8. the credentials file's url, from the command line --------------------------------


async def test_a_command_connects_where_its_credentials_file_says(
    nats_server: NatsServer, registrar: Registrar, tmp_path: Path
) -> None:
    """No --servers and no REACH_URL: the url in the file, not 127.0.0.1:4222."""
    creds = tmp_path / "watcher.creds"
    CredentialsFile(nats_server.url, "watcher", "open-fabric-ignores-it").write(creds)
    agent, _ = make_agent(nats_server.url, "located-1", capability("echo"))
    async with agent:
        code, out, err = await reach_cli("agents", "--creds", str(creds), cwd=tmp_path)
        assert code == 0, err
        assert "located-1" in out
        # REACH_URL still wins over the file
        env = {**CLEAN_ENV, "REACH_URL": "nats://127.0.0.1:1"}
        code, _, err = await reach_cli("agents", "--creds", str(creds), env=env, cwd=tmp_path)
        assert code == 1
        assert "127.0.0.1:1" in err


# -- 9. `reach audit tail --kind` --------------------------------------------------------


async def test_audit_tail_refuses_an_unknown_kind_naming_the_allowed_ones(
    nats_server: NatsServer, registrar: Registrar
) -> None:
    code, out, err = await reach_cli(
        "audit", "tail", "--kind", "bogus", "--servers", nats_server.url
    )
    assert code == 2, out + err
    assert "bogus" in err
    for allowed in ("ok", "error", "fallback", "denied", "retry", "timeout", "breaker"):
        assert f"'{allowed}'" in err
    code, out, err = await reach_cli(
        "audit", "tail", "--kind", "timeout", "--servers", nats_server.url
    )
    assert code == 0, err
    assert "no audit events" in out
