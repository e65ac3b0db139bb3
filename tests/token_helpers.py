"""Token fixtures on a manual clock, shared by the token and revocation tests (a plugin
of tests/conftest.py; a module with a ``clock`` of its own keeps it)."""

from __future__ import annotations

from typing import Any

import pytest

from reach.clock import ManualClock
from reach.security.tokens import KeyRing, TokenIssuer, TokenVerifier

WALL = 1_700_000_000.0


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(wall=WALL)


@pytest.fixture
def ring(clock: ManualClock) -> KeyRing:
    return KeyRing.generate(clock)


@pytest.fixture
def issuer(ring: KeyRing, clock: ManualClock) -> TokenIssuer:
    return TokenIssuer(ring, clock=clock)


def verifier_for(ring: KeyRing, clock: ManualClock, **kwargs: Any) -> TokenVerifier:
    verifier = TokenVerifier(clock=clock, **kwargs)
    for pub in ring.public_keys():
        verifier.add_key(pub.kid, pub)
    return verifier


@pytest.fixture
def verifier(ring: KeyRing, clock: ManualClock) -> TokenVerifier:
    return verifier_for(ring, clock)
