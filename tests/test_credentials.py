"""Credentials: secret verifiers, the REACH_CREDENTIALS store (against a real
nats-server) and credentials files, whose url says where to connect when nothing else
does."""

from __future__ import annotations

import functools
import json
import logging
import os
import stat
from pathlib import Path

import pytest

from reach.agent.agent import Agent
from reach.caller.client import ReachClient
from reach.clock import ManualClock
from reach.errors import AuthenticationFailed, ConfigurationError
from reach.security import (
    ClientRecord,
    CredentialsFile,
    CredentialsRejected,
    CredentialStore,
    hash_secret,
    new_secret,
    verify_secret,
)
from reach.settings import DEFAULT_URL, resolve_servers
from reach.transport import Connection

# -- verifiers ---------------------------------------------------------------------------


def test_a_fast_verifier_verifies_its_secret_and_nothing_else() -> None:
    secret = new_secret()
    encoded = hash_secret(secret)
    assert verify_secret(secret, encoded)
    assert not verify_secret(secret[:-1], encoded)
    assert not verify_secret(secret + " ", encoded)
    assert not verify_secret("", encoded)
    assert not verify_secret("\ud800" * 40, encoded)  # a lone surrogate cannot be encoded
    assert not verify_secret("x" * 5000, encoded)


def test_a_fast_verifier_is_salted_and_names_its_scheme() -> None:
    secret = new_secret()
    first, second = hash_secret(secret), hash_secret(secret)
    assert first != second
    scheme, salt, digest = first.split("$")
    assert scheme == "hs256"
    assert salt
    assert digest
    assert secret not in first
    assert verify_secret(secret, second)


@pytest.mark.parametrize("secret", ["", "short", "correct horse battery staple"])
def test_only_random_secrets_get_a_fast_verifier(secret: str) -> None:
    with pytest.raises(ConfigurationError, match="new_secret"):
        hash_secret(secret)


@functools.cache
def _fast() -> tuple[str, str]:
    secret = new_secret()
    return secret, hash_secret(secret)


@pytest.mark.parametrize(
    "mangle",
    [
        lambda e: "",
        lambda e: "garbage",
        lambda e: e.replace("hs256$", "hs512$"),
        lambda e: e.replace("hs256$", "scrypt$16384$8$1$"),  # a scheme no record has
        lambda e: e + "$extra",
        lambda e: e.split("$", 1)[0],
        lambda e: "hs256$$" + e.rsplit("$", 1)[1],  # no salt
        lambda e: e.rsplit("$", 1)[0] + "$!!notbase64!!",
        lambda e: e.rsplit("$", 1)[0] + "$AAAA",  # digest too short
        lambda e: e.rsplit("$", 1)[0] + "$" + "A" * 44,  # right length, wrong digest
    ],
)
def test_a_malformed_fast_verifier_never_verifies_and_never_raises(mangle: object) -> None:
    secret, encoded = _fast()
    assert callable(mangle)
    assert verify_secret(secret, mangle(encoded)) is False


def test_new_secrets_are_long_and_unique() -> None:
    secrets = {new_secret() for _ in range(100)}
    assert len(secrets) == 100
    assert all(len(s) >= 43 for s in secrets)


# -- records -----------------------------------------------------------------------------


def _record(**overrides: object) -> ClientRecord:
    fields: dict[str, object] = {
        "client_id": "report-gen",
        "level": 2,
        "secret_hash": "hs256$...",
        "created_at": 1.0,
        **overrides,
    }
    return ClientRecord.model_validate(fields)


def test_record_roles_are_sorted_and_deduplicated() -> None:
    record = _record(roles=["registrar", "admin", "admin"])
    assert record.roles == ("admin", "registrar")
    assert record.has_role("admin")
    assert not _record().has_role("admin")


@pytest.mark.parametrize(
    "overrides",
    [
        {"client_id": ""},
        {"client_id": "has.dot"},
        {"client_id": "a" * 65},
        {"client_id": "spa ce"},
        {"level": 0},
        {"level": 5},
        {"roles": ["root"]},
        {"agent_id": "bad.agent"},
        {"unexpected": 1},
    ],
)
def test_invalid_records_are_refused(overrides: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="validation error"):
        _record(**overrides)


# -- the store (real nats-server) --------------------------------------------------------


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
async def store(conn: Connection, clock: ManualClock) -> CredentialStore:
    return await CredentialStore.open(conn, clock=clock)


async def test_added_client_authenticates_with_its_secret(store: CredentialStore) -> None:
    record, secret = await store.add("report-gen", 2, agent_id="report-gen-001")
    assert (record.client_id, record.level, record.agent_id) == ("report-gen", 2, "report-gen-001")
    assert secret not in record.secret_hash
    assert record.created_at == pytest.approx(1_700_000_000.0)
    assert await store.authenticate("report-gen", secret) == record
    assert await store.get("report-gen") == record


async def test_secret_is_stored_only_as_a_hash(store: CredentialStore) -> None:
    _, secret = await store.add("caller", 1)
    entry = await store.bucket.get("client.caller")
    assert entry is not None
    assert secret.encode() not in entry.value
    assert b"hs256$" in entry.value


async def test_adding_an_existing_client_is_refused(store: CredentialStore) -> None:
    await store.add("dup", 1)
    with pytest.raises(ConfigurationError, match="client dup exists"):
        await store.add("dup", 4, roles=["admin"])
    record = await store.get("dup")
    assert record is not None
    assert record.level == 1


async def test_adding_an_invalid_client_names_the_problem(store: CredentialStore) -> None:
    with pytest.raises(ConfigurationError, match="level"):
        await store.add("ok-id", 7)
    with pytest.raises(ConfigurationError, match="client_id"):
        await store.add("bad.id", 1)
    with pytest.raises(ConfigurationError, match="unknown role"):
        await store.add("ok-id", 1, roles=["superuser"])


async def test_unknown_client_and_wrong_secret_get_the_same_message(
    store: CredentialStore,
) -> None:
    await store.add("known", 1)
    with pytest.raises(CredentialsRejected) as unknown:
        await store.authenticate("nobody", "whatever")
    with pytest.raises(CredentialsRejected) as wrong:
        await store.authenticate("known", "whatever")
    assert str(unknown.value) == str(wrong.value) == "invalid client id or secret"
    assert (unknown.value.reason, wrong.value.reason) == ("unknown_client", "bad_secret")
    assert isinstance(unknown.value, AuthenticationFailed)


async def test_revoked_client_cannot_authenticate(store: CredentialStore) -> None:
    _, secret = await store.add("leaver", 3)
    revoked = await store.revoke("leaver")
    assert revoked.revoked
    assert revoked.revoked_at == pytest.approx(1_700_000_000.0)
    assert await store.revoke("leaver") == revoked  # idempotent
    with pytest.raises(CredentialsRejected, match="revoked") as exc:
        await store.authenticate("leaver", secret)
    assert exc.value.reason == "revoked"
    # without the secret, a revoked client looks like any other failure
    with pytest.raises(CredentialsRejected, match="invalid client id or secret"):
        await store.authenticate("leaver", "guess")


async def test_revoking_an_unknown_client_is_an_error(store: CredentialStore) -> None:
    with pytest.raises(ConfigurationError, match="no client ghost"):
        await store.revoke("ghost")


async def test_list_returns_every_client_sorted(store: CredentialStore) -> None:
    assert await store.list() == []
    await store.add("zeta", 1)
    await store.add("alpha", 4, roles=["admin"])
    await store.add("mid", 2, agent_id="mid-1")
    await store.revoke("mid")
    listed = await store.list()
    assert [r.client_id for r in listed] == ["alpha", "mid", "zeta"]
    assert [r.revoked for r in listed] == [False, True, False]


async def test_the_right_secret_gets_in_however_many_wrong_ones_came(
    store: CredentialStore,
) -> None:
    _, secret = await store.add("target", 2)
    for _ in range(50):
        with pytest.raises(CredentialsRejected, match="invalid client id or secret") as exc:
            await store.authenticate("target", "guess")
        assert exc.value.reason == "bad_secret"
    assert (await store.authenticate("target", secret)).client_id == "target"
    assert store.refusals["bad_secret"] == 50


async def test_unknown_client_ids_cost_no_state(store: CredentialStore) -> None:
    for i in range(200):
        with pytest.raises(CredentialsRejected) as exc:
            await store.authenticate(f"probe-{i}", "x")
        assert exc.value.reason == "unknown_client"
    with pytest.raises(CredentialsRejected) as exc:
        await store.authenticate("no.such id" * 50, "x")
    assert exc.value.client_id == "<invalid>"  # an attacker's string is not echoed
    assert store.refusals["unknown_client"] == 201


# -- credentials files -------------------------------------------------------------------


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_credentials_file_round_trips_with_mode_0600(tmp_path: Path) -> None:
    creds = CredentialsFile(url="nats://127.0.0.1:4222", client_id="dev", secret=new_secret())
    path = tmp_path / "store" / "dev.creds"
    creds.write(path)
    assert _mode(path) == 0o600
    assert json.loads(path.read_text()) == {
        "url": creds.url,
        "client_id": "dev",
        "secret": creds.secret,
    }
    assert CredentialsFile.read(path) == creds
    assert [p.name for p in path.parent.iterdir()] == ["dev.creds"]  # no temp file left


def test_rewriting_a_loose_credentials_file_makes_it_0600(tmp_path: Path) -> None:
    path = tmp_path / "dev.creds"
    path.write_text("old")
    path.chmod(0o644)
    CredentialsFile(url="nats://h:4222", client_id="dev", secret="s").write(path)
    assert _mode(path) == 0o600
    assert CredentialsFile.read(path).secret == "s"


def test_group_writable_credentials_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "dev.creds"
    CredentialsFile(url="nats://h:4222", client_id="dev", secret="s").write(path)
    path.chmod(0o620)
    with pytest.raises(ConfigurationError, match="writable by group or others"):
        CredentialsFile.read(path)
    path.chmod(0o602)
    with pytest.raises(ConfigurationError, match="chmod 600"):
        CredentialsFile.read(path)


def test_world_readable_credentials_file_is_read_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "dev.creds"
    CredentialsFile(url="nats://h:4222", client_id="dev", secret="s").write(path)
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="reach.security"):
        assert CredentialsFile.read(path).client_id == "dev"
    assert "readable by group or others" in caplog.text


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("not json", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        ('{"url": "nats://h", "client_id": "dev"}', "secret: missing"),
        ('{"url": "", "client_id": "dev", "secret": "s"}', "url: missing"),
        ('{"url": "nats://h", "client_id": 5, "secret": "s"}', "client_id: missing"),
        ('{"url": "nats://h", "client_id": "a.b", "secret": "s"}', "client_id: must be"),
    ],
)
def test_bad_credentials_files_are_explained(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "bad.creds"
    path.write_text(content)
    os.chmod(path, 0o600)
    with pytest.raises(ConfigurationError, match=message) as exc:
        CredentialsFile.read(path)
    assert str(path) in str(exc.value)


def test_missing_credentials_file_is_explained(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="not found"):
        CredentialsFile.read(tmp_path / "nope.creds")


# -- where a credentials file says to connect ------------------------------------------


def _creds(path: Path, url: str) -> Path:
    CredentialsFile(url, "watcher", "not-a-real-secret").write(path)
    return path


def test_the_credentials_files_url_is_used_without_servers_or_reach_url(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("REACH_URL", raising=False)
    monkeypatch.delenv("REACH_CREDS", raising=False)
    creds = _creds(tmp_path / "w.creds", "nats://fabric.example:4333")
    assert resolve_servers(None, creds) == ["nats://fabric.example:4333"]
    # an explicit servers= wins over it, and REACH_URL too
    assert resolve_servers("nats://here:1", creds) == ["nats://here:1"]
    monkeypatch.setenv("REACH_URL", "nats://env:2,nats://env:3")
    assert resolve_servers(None, creds) == ["nats://env:2", "nats://env:3"]


def test_clients_and_agents_connect_where_their_credentials_file_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("REACH_URL", raising=False)
    creds = _creds(tmp_path / "w.creds", "nats://fabric.example:4333")
    assert ReachClient(credentials=creds).servers == ["nats://fabric.example:4333"]
    agent = Agent(
        {
            "agent_id": "a-1",
            "agent_name": "a",
            "version": "1.0.0",
            "capabilities": [{"name": "echo"}],
        },
        credentials=str(creds),
    )
    assert agent.servers == ["nats://fabric.example:4333"]
    monkeypatch.setenv("REACH_URL", "nats://env:2")
    assert ReachClient(credentials=creds).servers == ["nats://env:2"]


@pytest.mark.parametrize(
    "body",
    [None, b"{not json", b"[1, 2]", b'{"url": ""}', b'{"url": 7}', b"\xff\xfe"],
    ids=["missing", "not-json", "not-an-object", "empty-url", "url-not-a-string", "binary"],
)
def test_an_unreadable_credentials_file_falls_back_to_the_default_url(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: bytes | None
) -> None:
    monkeypatch.delenv("REACH_URL", raising=False)
    path = tmp_path / "w.creds"
    if body is not None:
        path.write_bytes(body)
    assert resolve_servers(None, path) == [DEFAULT_URL]
    assert resolve_servers(None, tmp_path) == [DEFAULT_URL]  # a directory
    assert resolve_servers(None, None) == [DEFAULT_URL]
