"""Tokens: issuing, every forged-token case, clock skew, rotation, the verification cache
(manual clocks, real Ed25519), and the REACH_KEYS store against a real nats-server."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import json
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from reach.clock import ManualClock
from reach.errors import AuthenticationFailed, ConfigurationError
from reach.security import (
    ClientRecord,
    KeyRing,
    KeyStore,
    PublicKey,
    SigningKey,
    TokenIssuer,
    TokenRejected,
    TokenVerifier,
)
from reach.tasks import cancel_and_wait
from reach.transport import Connection
from reach.wire import codec

from .poll_helpers import until
from .token_helpers import WALL, verifier_for


def record(level: int = 2, agent_id: str | None = "report-gen-001", **extra: Any) -> ClientRecord:
    return ClientRecord(
        client_id="report-gen",
        level=level,
        agent_id=agent_id,
        secret_hash="hs256$unused",
        created_at=WALL,
        **extra,
    )


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def forge(
    header: dict[str, Any], payload: dict[str, Any], sign: Callable[[bytes], bytes] | None
) -> str:
    """A JWT built by hand, as an attacker would."""
    signing_input = b64(json.dumps(header).encode()) + "." + b64(json.dumps(payload).encode())
    signature = sign(signing_input.encode()) if sign else b""
    return signing_input + "." + b64(signature)


def good_payload(**overrides: Any) -> dict[str, Any]:
    now = int(WALL)
    payload: dict[str, Any] = {
        "iss": "reach",
        "aud": "reach",
        "sub": "mallory",
        "lvl": 4,
        "roles": [],
        "iat": now,
        "nbf": now,
        "exp": now + 3600,
        "jti": "j1",
    }
    payload.update(overrides)
    return {k: v for k, v in payload.items() if v is not None}


def rejected(verifier: TokenVerifier, token: str) -> TokenRejected:
    with pytest.raises(TokenRejected) as exc:
        verifier.verify(token)
    assert isinstance(exc.value, AuthenticationFailed)
    return exc.value


# -- the valid flow ----------------------------------------------------------------------


def test_issued_token_verifies_and_carries_the_clients_claims(
    issuer: TokenIssuer, verifier: TokenVerifier, ring: KeyRing
) -> None:
    token, issued = issuer.issue_with_claims(record(level=3, roles=("registrar",)))
    claims = verifier.verify(token)
    assert claims == issued
    assert claims.client_id == "report-gen"
    assert claims.agent_id == "report-gen-001"
    assert claims.level == 3
    assert claims.has_role("registrar")
    assert not claims.has_role("admin")
    assert claims.kid == ring.active.kid
    assert (claims.iat, claims.nbf, claims.exp) == (WALL, WALL, WALL + 7200)
    assert len(claims.jti) >= 16


def test_token_header_and_claims_follow_the_contract(issuer: TokenIssuer, ring: KeyRing) -> None:
    token = issuer.issue(record(agent_id=None))
    header_b64, payload_b64, _ = token.split(".")
    header = json.loads(base64.urlsafe_b64decode(header_b64 + "=="))
    payload = json.loads(base64.urlsafe_b64decode(payload_b64 + "=="))
    assert header["alg"] == "EdDSA"
    assert header["kid"] == ring.active.kid
    assert set(payload) == {"iss", "aud", "sub", "lvl", "roles", "iat", "nbf", "exp", "jti"}
    assert (payload["iss"], payload["aud"], payload["sub"]) == ("reach", "reach", "report-gen")


def test_every_token_gets_a_fresh_jti(issuer: TokenIssuer, verifier: TokenVerifier) -> None:
    jtis = {verifier.verify(issuer.issue(record())).jti for _ in range(20)}
    assert len(jtis) == 20


def test_no_token_for_a_revoked_client(issuer: TokenIssuer) -> None:
    with pytest.raises(AuthenticationFailed, match="revoked"):
        issuer.issue(record(revoked_at=WALL))


# -- forged tokens -----------------------------------------------------------------------


def test_alg_none_is_refused(verifier: TokenVerifier, ring: KeyRing) -> None:
    for alg in ("none", "None", "NONE"):
        token = forge({"alg": alg, "kid": ring.active.kid}, good_payload(), None)
        assert rejected(verifier, token).reason == "alg_not_allowed"
    # no alg at all
    token = forge({"kid": ring.active.kid}, good_payload(), None)
    assert rejected(verifier, token).reason == "alg_not_allowed"


def test_hs256_signed_with_the_public_key_pem_is_refused(
    verifier: TokenVerifier, ring: KeyRing
) -> None:
    pub = ring.public_keys()[0]
    for secret in (pub.pem().encode(), pub.public_key.encode(), base64.b64decode(b"AA==")):
        for alg in ("HS256", "HS384", "HS512"):
            digest = getattr(hashlib, "sha" + alg[2:])

            def mac(data: bytes, key: bytes = secret, digest: Any = digest) -> bytes:
                return hmac.new(key, data, digest).digest()

            token = forge({"alg": alg, "typ": "JWT", "kid": ring.active.kid}, good_payload(), mac)
            assert rejected(verifier, token).reason == "alg_not_allowed"
            # an HMAC dressed up as EdDSA does not verify either
            token = forge({"alg": "EdDSA", "kid": ring.active.kid}, good_payload(), mac)
            assert rejected(verifier, token).reason == "bad_signature"


def test_rs256_signed_by_an_attacker_key_is_refused(verifier: TokenVerifier, ring: KeyRing) -> None:
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import padding

    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    token = forge(
        {"alg": "RS256", "kid": ring.active.kid},
        good_payload(),
        lambda data: rsa_key.sign(data, padding.PKCS1v15(), hashes.SHA256()),
    )
    assert rejected(verifier, token).reason == "alg_not_allowed"


def test_unknown_kid_is_refused(verifier: TokenVerifier) -> None:
    attacker = Ed25519PrivateKey.generate()
    token = forge({"alg": "EdDSA", "kid": "attacker-key"}, good_payload(), attacker.sign)
    err = rejected(verifier, token)
    assert err.reason == "unknown_kid"
    assert "attacker-key" in str(err)


def test_missing_kid_is_refused(verifier: TokenVerifier, ring: KeyRing) -> None:
    token = forge({"alg": "EdDSA"}, good_payload(), ring.active.private_key.sign)
    assert rejected(verifier, token).reason == "missing_kid"


def test_a_known_kid_with_another_keys_signature_is_refused(
    verifier: TokenVerifier, ring: KeyRing
) -> None:
    attacker = Ed25519PrivateKey.generate()
    token = forge({"alg": "EdDSA", "kid": ring.active.kid}, good_payload(), attacker.sign)
    assert rejected(verifier, token).reason == "bad_signature"


def test_tampered_level_is_refused(issuer: TokenIssuer, verifier: TokenVerifier) -> None:
    token = issuer.issue(record(level=1))
    header, payload_b64, signature = token.split(".")
    payload = json.loads(base64.urlsafe_b64decode(payload_b64 + "=="))
    payload["lvl"] = 4
    tampered = f"{header}.{b64(json.dumps(payload).encode())}.{signature}"
    assert rejected(verifier, tampered).reason == "bad_signature"
    # and the genuine token still says level 1
    assert verifier.verify(token).level == 1


def test_tampered_signature_is_refused(issuer: TokenIssuer, verifier: TokenVerifier) -> None:
    token = issuer.issue(record())
    head, _, sig = token.rpartition(".")
    flipped = sig[:10] + ("A" if sig[10] != "A" else "B") + sig[11:]
    assert rejected(verifier, f"{head}.{flipped}").reason in ("bad_signature", "bad_format")


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"iss": "evil"}, "wrong_issuer"),
        ({"iss": None}, "wrong_issuer"),
        ({"aud": "other-system"}, "wrong_audience"),
        ({"aud": ["other", "system"]}, "wrong_audience"),
        ({"aud": None}, "wrong_audience"),
        ({"exp": None}, "missing_claim"),
        ({"nbf": None}, "missing_claim"),
        ({"iat": None}, "missing_claim"),
        ({"sub": None}, "missing_claim"),
        ({"sub": ""}, "missing_claim"),
        ({"jti": None}, "missing_claim"),
        ({"lvl": None}, "missing_claim"),
        ({"lvl": 5}, "bad_level"),
        ({"lvl": 0}, "bad_level"),
        ({"lvl": "4"}, "bad_level"),
        ({"lvl": True}, "bad_level"),
        ({"lvl": 3.5}, "bad_level"),
        ({"exp": "tomorrow"}, "bad_claim"),
        ({"exp": True}, "bad_claim"),
        ({"roles": "admin"}, "bad_claim"),
        ({"agent_id": 7}, "bad_claim"),
        ({"exp": int(WALL) - 3600}, "expired"),
        ({"nbf": int(WALL) + 3600}, "not_yet_valid"),
        ({"iat": int(WALL) + 3600}, "not_yet_valid"),
    ],
)
def test_tokens_with_bad_claims_are_refused_even_when_properly_signed(
    verifier: TokenVerifier, ring: KeyRing, overrides: dict[str, Any], reason: str
) -> None:
    token = forge(
        {"alg": "EdDSA", "kid": ring.active.kid},
        good_payload(**overrides),
        ring.active.private_key.sign,
    )
    assert rejected(verifier, token).reason == reason


def test_a_list_audience_that_includes_ours_is_accepted(
    verifier: TokenVerifier, ring: KeyRing
) -> None:
    token = forge(
        {"alg": "EdDSA", "kid": ring.active.kid},
        good_payload(aud=["other", "reach"]),
        ring.active.private_key.sign,
    )
    assert verifier.verify(token).client_id == "mallory"


def test_an_issuer_with_another_name_is_refused(
    ring: KeyRing, clock: ManualClock, verifier: TokenVerifier
) -> None:
    other_iss = TokenIssuer(ring, issuer="elsewhere", clock=clock)
    assert rejected(verifier, other_iss.issue(record())).reason == "wrong_issuer"
    other_aud = TokenIssuer(ring, audience="elsewhere", clock=clock)
    assert rejected(verifier, other_aud.issue(record())).reason == "wrong_audience"


@pytest.mark.parametrize(
    "garbage",
    [
        "",
        "garbage",
        "a.b",
        "a.b.c",
        "a.b.c.d",
        "....",
        "eyJhbGciOiJFZERTQSJ9",
        b64(b"[]") + "." + b64(b"{}") + ".",
        b64(b'{"alg": "EdDSA", "kid": 5}') + "." + b64(b"{}") + ".",
        b64(b"\xff\xfe") + ".x.y",
        "x" * 10_000,
        "\u00e9\u00e9.\u00e9.\u00e9",
    ],
)
def test_garbage_is_refused_as_bad_format(verifier: TokenVerifier, garbage: str) -> None:
    assert rejected(verifier, garbage).reason == "bad_format"


def test_a_token_body_that_is_not_an_object_is_refused(
    verifier: TokenVerifier, ring: KeyRing
) -> None:
    signing_input = b64(json.dumps({"alg": "EdDSA", "kid": ring.active.kid}).encode()) + "."
    signing_input += b64(b"[1, 2, 3]")
    token = signing_input + "." + b64(ring.active.private_key.sign(signing_input.encode()))
    assert rejected(verifier, token).reason == "bad_format"


def test_non_string_tokens_are_refused(verifier: TokenVerifier) -> None:
    for value in (None, b"bytes", 5, ["x"]):
        assert rejected(verifier, value).reason == "bad_format"  # type: ignore[arg-type]


# -- clock skew --------------------------------------------------------------------------


def skewed(seconds: float) -> ManualClock:
    return ManualClock(wall=WALL + seconds)


@pytest.mark.parametrize(("skew", "ok"), [(-20, True), (20, True), (-40, False), (40, False)])
def test_clock_skew_within_the_leeway_is_accepted_beyond_it_refused(
    ring: KeyRing, skew: float, ok: bool
) -> None:
    # the verifier's clock runs `skew` seconds off the issuer's
    fresh = TokenIssuer(ring, clock=ManualClock(wall=WALL)).issue(record())
    expiring = TokenIssuer(ring, ttl_sec=60, clock=ManualClock(wall=WALL - 60)).issue(record())
    verifier = verifier_for(ring, skewed(skew))
    token = fresh if skew < 0 else expiring  # behind: nbf matters; ahead: exp matters
    if ok:
        assert verifier.verify(token).client_id == "report-gen"
    else:
        reason = "not_yet_valid" if skew < 0 else "expired"
        assert rejected(verifier, token).reason == reason


def test_leeway_is_configurable(ring: KeyRing) -> None:
    token = TokenIssuer(ring, clock=ManualClock(wall=WALL)).issue(record())
    strict = verifier_for(ring, skewed(-5), leeway_sec=0)
    assert rejected(strict, token).reason == "not_yet_valid"


# -- the cache ---------------------------------------------------------------------------


def test_a_cached_token_stops_verifying_after_it_expires(
    issuer: TokenIssuer, verifier: TokenVerifier, clock: ManualClock
) -> None:
    token = issuer.issue(record())
    first = verifier.verify(token)
    clock.advance(7200 + 30)
    assert verifier.verify(token) is first  # cached, still within leeway
    clock.advance(1)
    assert rejected(verifier, token).reason == "expired"
    assert rejected(verifier, token).reason == "expired"  # and stays refused


def test_a_cached_token_is_refused_once_its_key_is_removed(
    issuer: TokenIssuer, verifier: TokenVerifier, ring: KeyRing
) -> None:
    token = issuer.issue(record())
    verifier.verify(token)
    verifier.remove_key(ring.active.kid)
    assert rejected(verifier, token).reason == "unknown_kid"


def test_a_cached_token_is_rechecked_when_its_kid_changes_key(
    issuer: TokenIssuer, verifier: TokenVerifier, ring: KeyRing
) -> None:
    token = issuer.issue(record())
    verifier.verify(token)
    verifier.add_key(ring.active.kid, Ed25519PrivateKey.generate().public_key())
    assert rejected(verifier, token).reason == "bad_signature"


def test_failures_are_not_cached(issuer: TokenIssuer, ring: KeyRing, clock: ManualClock) -> None:
    verifier = TokenVerifier(clock=clock)
    token = issuer.issue(record())
    assert rejected(verifier, token).reason == "unknown_kid"
    verifier.add_key(ring.active.kid, ring.active.private_key.public_key())
    assert verifier.verify(token).client_id == "report-gen"


def test_a_forged_token_is_refused_while_the_genuine_one_is_cached(
    issuer: TokenIssuer, verifier: TokenVerifier
) -> None:
    token = issuer.issue(record(level=1))
    verifier.verify(token)
    header, payload_b64, signature = token.split(".")
    payload = json.loads(base64.urlsafe_b64decode(payload_b64 + "=="))
    payload["lvl"] = 4
    forged = f"{header}.{b64(json.dumps(payload).encode())}.{signature}"
    for _ in range(3):
        assert rejected(verifier, forged).reason == "bad_signature"
    assert verifier.verify(token).level == 1


def test_the_cache_is_bounded(issuer: TokenIssuer, ring: KeyRing, clock: ManualClock) -> None:
    verifier = verifier_for(ring, clock, cache_size=2)
    tokens = [issuer.issue(record()) for _ in range(5)]
    for token in tokens:
        verifier.verify(token)
    assert len(verifier._cache) == 2
    assert all(verifier.verify(t).client_id == "report-gen" for t in tokens)


def _full_checks(verifier: TokenVerifier, monkeypatch: pytest.MonkeyPatch) -> Callable[[], int]:
    """Count the verifier's checks in full (signature and all) from now on."""
    count = 0
    check = verifier._verify_uncached

    def counted(token: str) -> Any:
        nonlocal count
        count += 1
        return check(token)

    monkeypatch.setattr(verifier, "_verify_uncached", counted)
    return lambda: count


def test_a_remembered_token_is_not_checked_again(
    issuer: TokenIssuer, verifier: TokenVerifier, monkeypatch: pytest.MonkeyPatch
) -> None:
    token = issuer.issue(record())
    verifier.verify(token)
    full = _full_checks(verifier, monkeypatch)
    for _ in range(1000):
        assert verifier.verify(token).client_id == "report-gen"
    assert full() == 0


def test_every_live_token_of_a_large_fabric_stays_remembered(
    issuer: TokenIssuer, verifier: TokenVerifier, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A registrar sees every agent's token on each heartbeat, round after round. With
    fewer places than tokens (4,096 before) a least-recently-used cache remembered none
    of them, and each heartbeat cost a full Ed25519 check (~150 µs): a registrar of
    10,000 agents spent its CPU on that alone."""
    tokens = [issuer.issue(record(agent_id=f"agent-{i}")) for i in range(5000)]
    for token in tokens:
        verifier.verify(token)
    full = _full_checks(verifier, monkeypatch)
    for token in tokens:  # the next round of heartbeats
        assert verifier.verify(token).level == 2
    assert full() == 0


def test_expired_tokens_are_let_go(
    issuer: TokenIssuer, verifier: TokenVerifier, clock: ManualClock
) -> None:
    """Holders renew their tokens and never show the old ones again: the cache keeps the
    live ones, not every token seen lately."""
    old = [issuer.issue(record()) for _ in range(3)]
    for token in old:
        verifier.verify(token)
    clock.advance(7200 + 31)  # past expiry and leeway
    fresh = [issuer.issue(record()) for _ in range(2)]
    for token in fresh:
        verifier.verify(token)
    assert sorted(verifier._cache) == sorted(fresh)


def test_a_token_that_expires_as_it_is_checked_is_still_answered(
    issuer: TokenIssuer, ring: KeyRing, clock: ManualClock
) -> None:
    """Valid when its claims are checked, past its expiry when the cache then reads the
    clock again: the answer stands and nothing else escapes (a StopIteration did, out of
    an empty cache, and ended the coroutine that asked)."""
    token = issuer.issue(record())
    valid_until = clock.time() + 7200 + 30

    class Stepping:
        def __init__(self) -> None:
            self.now = valid_until - 0.0015

        def time(self) -> float:
            self.now += 0.001  # each reading a millisecond later
            return self.now

        def monotonic(self) -> float:
            return self.now

    verifier = TokenVerifier({ring.active.kid: ring.active.private_key.public_key()})
    verifier._clock = Stepping()  # type: ignore[assignment]
    assert verifier.verify(token).client_id == "report-gen"


def test_a_call_token_is_for_one_capability_and_outlives_nothing(
    issuer: TokenIssuer, verifier: TokenVerifier, clock: ManualClock
) -> None:
    from reach.security.tokens import call_audience

    fabric = issuer.issue_with_claims(record())[1]
    token, claims = issuer.issue_with_claims(
        record(), audience=call_audience("orders"), not_after=fabric.exp - 600
    )
    assert claims.exp == fabric.exp - 600  # never later than the token it was exchanged for
    assert verifier.verify(token, call_audience("orders")).audience == ("call:orders",)
    assert rejected(verifier, token).reason == "wrong_audience"  # the fabric's audience
    with pytest.raises(AuthenticationFailed, match="does not include 'call:weather'"):
        verifier.verify(token, call_audience("weather"))
    # and the other way round: a fabric token is no call token
    with pytest.raises(AuthenticationFailed, match="audience"):
        verifier.verify(issuer.issue(record()), call_audience("orders"))


def test_a_token_request_is_a_login_or_an_exchange_never_both() -> None:
    from pydantic import ValidationError

    from reach.security.tokenexchange import TokenRequest

    TokenRequest(client_id="a", secret="s")
    TokenRequest(client_id="a", token="t", audience="orders")
    for bad in (
        {"client_id": "a"},
        {"client_id": "a", "secret": "s", "token": "t", "audience": "orders"},
        {"client_id": "a", "token": "t"},  # an exchange names its capability
        {"client_id": "a", "token": "t", "audience": "a.>"},  # not a capability name
    ):
        with pytest.raises(ValidationError):
            TokenRequest.model_validate(bad)


def test_a_lookup_function_can_supply_keys(
    issuer: TokenIssuer, ring: KeyRing, clock: ManualClock
) -> None:
    keys = {ring.active.kid: ring.active.private_key.public_key()}
    verifier = TokenVerifier(keys.get, clock=clock)
    assert verifier.verify(issuer.issue(record())).level == 2
    assert verifier.kids == frozenset()
    mapping_verifier = TokenVerifier(keys, clock=clock)
    assert mapping_verifier.kids == {ring.active.kid}


# -- rotation ----------------------------------------------------------------------------


def test_rotation_keeps_old_tokens_valid_until_they_expire(
    issuer: TokenIssuer, ring: KeyRing, clock: ManualClock
) -> None:
    old_kid = ring.active.kid
    old_token = issuer.issue(record())
    clock.advance(600)
    new_key = issuer.rotate()
    assert new_key.kid != old_kid
    assert ring.active is new_key
    verifier = verifier_for(ring, clock)
    new_token = issuer.issue(record())
    assert verifier.verify(new_token).kid == new_key.kid
    assert verifier.verify(old_token).kid == old_kid

    retired = {p.kid: p for p in ring.public_keys()}[old_kid]
    assert retired.not_after == WALL + 600 + 7200 + 30
    assert ring.prune() == []
    clock.advance(7200 - 600 + 30)  # the old token's last valid second
    assert verifier.verify(old_token).kid == old_kid
    clock.advance(601)
    assert rejected(verifier, old_token).reason == "expired"
    assert ring.prune() == [old_kid]
    assert [p.kid for p in ring.public_keys()] == [new_key.kid]
    assert verifier.verify(issuer.issue(record())).kid == new_key.kid


def test_a_retired_key_cannot_sign_tokens_that_outlive_it(
    ring: KeyRing, clock: ManualClock
) -> None:
    old = ring.active
    ring.rotate(7200)
    verifier = verifier_for(ring, clock)
    # e.g. a stolen old private key signing a fresh token after retirement
    clock.advance(3600)
    late = TokenIssuer(KeyRing(old, clock=clock), clock=clock).issue(record())
    assert rejected(verifier, late).reason == "key_retired"


def test_staged_key_is_published_before_it_signs(ring: KeyRing, clock: ManualClock) -> None:
    staged = ring.stage()
    assert ring.stage() is staged
    assert [p.kid for p in ring.public_keys()] == [ring.active.kid, staged.kid]
    assert all(p.not_after is None for p in ring.public_keys())
    assert ring.rotate(7200) is staged
    assert ring.staged is None


# -- keys on disk ------------------------------------------------------------------------


def test_signing_key_survives_a_restart_in_a_0600_file(tmp_path: Path, clock: ManualClock) -> None:
    path = tmp_path / "store" / "signing.key"
    ring = KeyRing.load_or_generate(path, clock)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again = KeyRing.load_or_generate(path, clock)
    assert again.active.kid == ring.active.kid
    assert again.active.created_at == ring.active.created_at
    token = TokenIssuer(again, clock=clock).issue(record())
    assert verifier_for(ring, clock).verify(token).kid == ring.active.kid


@pytest.mark.parametrize(
    "content",
    [
        "not json",
        "{}",
        '{"kid": "k1", "created_at": 1, "private_key": "not a pem"}',
        '{"kid": "bad kid", "created_at": 1, "private_key": ""}',
        '{"kid": "k1", "created_at": "yesterday", "private_key": ""}',
    ],
)
def test_bad_signing_key_files_are_explained(tmp_path: Path, content: str) -> None:
    path = tmp_path / "signing.key"
    path.write_text(content)
    path.chmod(0o600)
    with pytest.raises(ConfigurationError, match="signing key file"):
        SigningKey.load_private(path)


def test_a_signing_key_file_with_another_key_type_is_refused(tmp_path: Path) -> None:
    pem = (
        rsa.generate_private_key(public_exponent=65537, key_size=2048)
        .private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        .decode()
    )
    path = tmp_path / "signing.key"
    path.write_text(json.dumps({"kid": "k1", "created_at": 1.0, "private_key": pem}))
    path.chmod(0o600)
    with pytest.raises(ConfigurationError, match="not hold an Ed25519 key"):
        SigningKey.load_private(path)


def test_a_group_writable_signing_key_file_is_refused(tmp_path: Path, ring: KeyRing) -> None:
    path = tmp_path / "signing.key"
    ring.active.save_private(path)
    path.chmod(0o660)
    with pytest.raises(ConfigurationError, match="writable by group or others"):
        SigningKey.load_private(path)


def test_public_key_record_round_trips(ring: KeyRing) -> None:
    pub = ring.public_keys()[0]
    again = PublicKey.model_validate(pub.model_dump(mode="json"))
    assert again == pub
    raw = again.key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    assert raw == ring.active.private_key.public_key().public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw
    )
    with pytest.raises(ConfigurationError, match="not an Ed25519 key"):
        PublicKey(kid="k", public_key="AAAA", created_at=0).key()


# -- the key store (real nats-server) ----------------------------------------------------


async def test_published_keys_can_be_read_back(
    conn: Connection, ring: KeyRing, clock: ManualClock
) -> None:
    store = await KeyStore.open(conn, clock=clock)
    assert await store.all() == []
    ring.rotate(7200)
    await store.publish_ring(ring)
    assert {p.kid for p in await store.all()} == {p.kid for p in ring.public_keys()}
    active = await store.get(ring.active.kid)
    assert active is not None
    assert active.not_after is None
    assert await store.get("no-such-kid") is None
    assert await store.get("bad kid!") is None
    # the private key never goes into the bucket
    for pub in await store.all():
        entry = await store.bucket.get("pub." + pub.kid)
        assert entry is not None
        assert b"PRIVATE" not in entry.value


async def test_a_following_verifier_learns_new_keys_and_forgets_pruned_ones(
    conn: Connection, ring: KeyRing, clock: ManualClock
) -> None:
    store = await KeyStore.open(conn, clock=clock)
    await store.publish_ring(ring)
    issuer = TokenIssuer(ring, clock=clock)
    verifier = TokenVerifier(clock=clock)
    ready = asyncio.Event()
    task = asyncio.create_task(store.follow(verifier, ready))
    try:
        await asyncio.wait_for(ready.wait(), 5)
        old_token = issuer.issue(record())
        assert verifier.verify(old_token).kid == ring.active.kid
        old_kid = ring.active.kid

        # rotation publishes the next key before signing with it: no token is ever unknown
        new_key = await store.rotate(ring, issuer.ttl_sec, settle_sec=0.3)
        assert new_key.kid in verifier.kids
        assert verifier.verify(issuer.issue(record())).kid == new_key.kid
        assert verifier.verify(old_token).kid == old_kid

        clock.advance(7200 + 31)
        assert await store.prune() == [old_kid]
        assert [p.kid for p in await store.all()] == [new_key.kid]
        await until(lambda: old_kid not in verifier.kids, "the pruned key dropped", timeout=5.0)
        assert rejected(verifier, old_token).reason == "unknown_kid"
    finally:
        await cancel_and_wait([task])
        with contextlib.suppress(asyncio.CancelledError):
            await task  # done: raises what it failed with, if anything


async def test_bad_key_records_are_skipped(
    conn: Connection, ring: KeyRing, clock: ManualClock
) -> None:
    store = await KeyStore.open(conn, clock=clock)
    await store.publish_ring(ring)
    await store.bucket.put("pub.junk", b"\xc1")
    other = SigningKey.generate(clock).public()
    await store.bucket.put("pub.mismatch", codec.encode(other.model_dump(mode="json")))
    assert [p.kid for p in await store.all()] == [ring.active.kid]


async def test_a_session_keeps_a_bounded_number_of_call_tokens(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One call token per capability called: a caller that names ever new capabilities
    (or a typo in a loop) does not grow the session without bound."""
    from reach.security import session as session_module
    from reach.security.credentials import CredentialsFile
    from reach.security.session import TokenSession
    from reach.security.tokenexchange import TokenReply

    monkeypatch.setattr(session_module, "MAX_CALL_TOKENS", 3)
    session = TokenSession(None, CredentialsFile("nats://x", "c", "s"))  # type: ignore[arg-type]
    session._token, session._expires_at = "fabric", time.time() + 3600

    async def issued(request: Any) -> TokenReply:
        return TokenReply(token=f"call-{request.audience}", expires_at=time.time() + 600, level=1)

    monkeypatch.setattr(session, "_ask", issued)
    for name in ("a", "b", "c", "d", "e"):
        assert await session.fetch_call_token(name) == f"call-{name}"
    assert list(session._calls) == ["c", "d", "e"]
    assert session.call_token("e") == "call-e"
    assert session.call_token("a") is None
