"""Revocations: verifiers refuse a revoked client's tokens, the gate's registry of open
connections stays bounded, the system user is in the generated config.

The end-to-end attack (a revoked client's connection, tokens and renewals) is in
tests/attacks/test_revocation.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path

import pytest

from reach.clock import ManualClock
from reach.security import natsconf
from reach.security.credentials import ClientRecord
from reach.security.revocation import (
    REVOKED_PREFIX,
    ConnectionRegistry,
    Revocation,
    _disconnected,
    decode_revocation,
    encode_revocation,
    publish_revocation,
)
from reach.security.tokens import KeyRing, KeyStore, TokenIssuer, TokenRejected, TokenVerifier
from reach.tasks import cancel_and_wait
from reach.transport import Connection

from .poll_helpers import until
from .token_helpers import WALL


def record(client_id: str = "spy") -> ClientRecord:
    return ClientRecord(client_id=client_id, level=2, secret_hash="hs256$unused", created_at=WALL)


def reason(verifier: TokenVerifier, token: str) -> str:
    with pytest.raises(TokenRejected) as info:
        verifier.verify(token)
    return info.value.reason


# -- the verifier ---------------------------------------------------------------------------


def test_a_revoked_clients_tokens_are_refused_cached_ones_included(
    verifier: TokenVerifier, issuer: TokenIssuer, clock: ManualClock
) -> None:
    token = issuer.issue(record())
    other = issuer.issue(record("honest"))
    assert verifier.verify(token).client_id == "spy"  # checked once: now cached
    clock.advance(10)
    verifier.revoke("spy", clock.time())
    assert reason(verifier, token) == "revoked"
    assert reason(verifier, token) == "revoked"  # refusals are not cached as passes
    assert verifier.verify(other).client_id == "honest"


def test_tokens_issued_after_the_revocation_are_accepted(
    verifier: TokenVerifier, issuer: TokenIssuer, clock: ManualClock
) -> None:
    """A client id deleted and added again (a new secret) gets tokens that work."""
    old = issuer.issue(record())
    verifier.revoke("spy", clock.time())
    same_second = issuer.issue(record())
    assert reason(verifier, old) == "revoked"
    assert reason(verifier, same_second) == "revoked"  # iat is whole seconds: not after
    clock.advance(1)
    assert verifier.verify(issuer.issue(record())).client_id == "spy"
    assert reason(verifier, old) == "revoked"


def test_forgetting_a_revocation_accepts_the_tokens_again(
    verifier: TokenVerifier, issuer: TokenIssuer, clock: ManualClock
) -> None:
    token = issuer.issue(record())
    verifier.revoke("spy", clock.time())
    assert verifier.revoked == {"spy": clock.time()}
    verifier.unrevoke("spy")
    verifier.unrevoke("never-revoked")
    assert verifier.verify(token).client_id == "spy"


def test_revocation_records_round_trip_and_bad_ones_are_refused() -> None:
    rec = Revocation(client_id="spy", revoked_at=WALL)
    assert decode_revocation(encode_revocation(rec)) == rec
    from reach.errors import CodecError

    for junk in (b"\xc1", b"", b"\x90", encode_revocation(rec)[:-3]):
        with pytest.raises(CodecError):
            decode_revocation(junk)


async def test_a_following_verifier_learns_revocations_from_reach_keys(
    conn: Connection, ring: KeyRing, issuer: TokenIssuer, clock: ManualClock
) -> None:
    store = await KeyStore.open(conn, clock=clock)
    await store.publish_ring(ring)
    # one revocation there before the verifier starts, one bad record, one named wrongly
    await publish_revocation(store.bucket, "early", clock.time())
    await store.bucket.put(REVOKED_PREFIX + "junk", b"\xc1")
    await store.bucket.put(
        REVOKED_PREFIX + "mismatch",
        encode_revocation(Revocation(client_id="someone-else", revoked_at=WALL)),
    )
    token = issuer.issue(record())
    verifier = TokenVerifier(clock=clock)
    ready = asyncio.Event()
    task = asyncio.create_task(store.follow(verifier, ready))
    try:
        await asyncio.wait_for(ready.wait(), 5)
        assert verifier.revoked == {"early": clock.time()}
        assert verifier.verify(token).client_id == "spy"
        await publish_revocation(store.bucket, "spy", clock.time())
        await until(lambda: "spy" in verifier.revoked, "the revocation learnt", timeout=5.0)
        assert reason(verifier, token) == "revoked"
        await store.bucket.delete(REVOKED_PREFIX + "spy")
        await until(lambda: "spy" not in verifier.revoked, "the revocation lifted", timeout=5.0)
        assert verifier.verify(token).client_id == "spy"
        assert ring.active.kid in verifier.kids  # keys still followed as before
    finally:
        await cancel_and_wait([task])
        with contextlib.suppress(asyncio.CancelledError):
            await task  # done: raises what it failed with, if anything
    # KeyStore.all() reads keys only, never the revocations beside them
    assert [p.kid for p in await store.all()] == [ring.active.kid]


# -- the gate's registry of open connections --------------------------------------------------


def test_the_registry_remembers_connections_per_client(clock: ManualClock) -> None:
    reg = ConnectionRegistry(clock=clock)
    reg.admitted("spy", "NSERVER1", 7)
    reg.admitted("spy", "NSERVER2", 7)
    reg.admitted("honest", "NSERVER1", 8)
    assert reg.connections("spy") == [("NSERVER1", 7), ("NSERVER2", 7)]
    reg.disconnected("NSERVER2", 7)
    reg.disconnected("NSERVER9", 1)  # unknown: nothing happens
    assert reg.forget_client("spy") == [("NSERVER1", 7)]
    assert reg.connections("spy") == []
    assert reg.connections("honest") == [("NSERVER1", 8)]
    assert len(reg) == 1


def test_a_reused_connection_id_belongs_to_its_latest_login(clock: ManualClock) -> None:
    reg = ConnectionRegistry(clock=clock)
    reg.admitted("spy", "NSERVER1", 7)
    reg.admitted("honest", "NSERVER1", 7)  # a restarted server counts from 1 again
    assert reg.connections("spy") == []
    assert reg.connections("honest") == [("NSERVER1", 7)]
    assert len(reg) == 1


def test_the_registry_is_bounded_in_count_and_age(clock: ManualClock) -> None:
    reg = ConnectionRegistry(max_connections=3, max_age=60, clock=clock)
    for cid in range(1, 6):
        reg.admitted("spy", "NSERVER1", cid)
    assert len(reg) == 3
    assert reg.evicted == 2
    assert reg.connections("spy") == [("NSERVER1", 3), ("NSERVER1", 4), ("NSERVER1", 5)]
    clock.advance(30)
    reg.admitted("honest", "NSERVER1", 9)
    clock.advance(31)  # the spy's logins are older than a login lives: gone
    assert reg.connections("spy") == []
    assert reg.connections("honest") == [("NSERVER1", 9)]
    assert len(reg) == 1


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"not json",
        b"[]",
        b'{"server": {"id": "N1"}}',
        b'{"server": {"id": 5}, "client": {"id": 3}}',
        b'{"server": {"id": "N1"}, "client": {"id": true}}',
        b'{"server": {"id": "N1"}, "client": {"id": "3"}}',
        b'{"server": "N1", "client": {"id": 3}}',
    ],
)
def test_bad_disconnect_events_are_ignored(data: bytes) -> None:
    assert _disconnected(data) is None


def test_a_disconnect_event_names_server_and_connection() -> None:
    event = {"server": {"id": "NSERVER1", "name": "reach"}, "client": {"id": 42, "acc": "REACH"}}
    assert _disconnected(json.dumps(event).encode()) == ("NSERVER1", 42)


# -- the system user ---------------------------------------------------------------------------


def test_the_system_user_is_in_the_generated_config(tmp_path: Path) -> None:
    setup = natsconf.prepare(tmp_path)
    assert setup.system_user.account == natsconf.SYSTEM_ACCOUNT
    assert natsconf.prepare(tmp_path).system_user == setup.system_user  # kept in the store
    text = natsconf.render_auth(setup)
    assert f'user: "{natsconf.SYSTEM_USER}", password: "{setup.system_user.password}"' in text
    assert f'"{natsconf.SYSTEM_USER}" ]' in text  # among the auth_users: no callout for it


def test_a_store_without_the_system_password_is_not_loaded(tmp_path: Path) -> None:
    """The servers of a store are configured with the system user: loading the store
    without creating (``reach up --auth-callout``) names the missing password file."""
    natsconf.prepare(tmp_path)
    (tmp_path / "auth" / "system.pass").unlink()
    with pytest.raises(FileNotFoundError, match=r"system\.pass"):
        natsconf.prepare(tmp_path, create=False)
